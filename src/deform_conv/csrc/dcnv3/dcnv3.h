// DCNv3 (InternImage's DCNv3Function), channels-last: input [N, H, W, G * C], offset [N, H_out, W_out, G * K * 2]
// ((x, y) per point), mask [N, H_out, W_out, G * K] -> [N, H_out, W_out, G * C], K = kh * kw - remove_center,
// points in the order and at the places of sampled_sum/points.h's ConvGrid. Its host code is written once for
// every backend, on the family's kernels (sampled_sum.h) of the backend it is given; entry_points.h binds it to
// each backend. Host code.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "../sampled_sum/points.h"
#include "../sampled_sum/sampled_sum.h"

namespace deform_conv {

// Checks the arguments (the backstop behind _ops/dcnv3/checks.py) and returns the grid.
ConvGrid make_dcnv3_grid(const at::Tensor& input, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                         at::IntArrayRef padding, at::IntArrayRef dilation, int64_t group, double offset_scale,
                         bool remove_center);

// A backward's grad_output: the forward output's shape [N, H_out, W_out, G * C], input's dtype and device.
void check_grid_grad_output(const ConvGrid& grid, const at::Tensor& grad_output, const at::Tensor& input);

// The family's conv-layout arguments, shared with DCNv4: input as the kernels' value [N, H * W, G, C] and the grid's
// single level.
struct GridCall {
  at::Tensor value, spatial_shapes, level_start_index, point_levels;
};
GridCall grid_call(const ConvGrid& grid, const at::Tensor& input, int64_t group);

at::Tensor dcnv3_forward(const SampledSumKernels& kernels, const at::Tensor& input, const at::Tensor& offset,
                         const at::Tensor& mask, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                         at::IntArrayRef padding, at::IntArrayRef dilation, int64_t group, double offset_scale,
                         bool remove_center);

std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward(
    const SampledSumKernels& kernels, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& offset, const at::Tensor& mask, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t group, double offset_scale, bool remove_center);

}  // namespace deform_conv
