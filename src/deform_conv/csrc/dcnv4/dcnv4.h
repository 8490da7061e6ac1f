// DCNv4 (the DCNv4 repository's extension), channels-last: input [N, H, W, G * C], offset_mask [N, H_out, W_out, P]
// with P >= G * K * 3, group g's block at g * 3K holding its 2K offsets ((x, y) per point) then its K mask values
// (the rest padding: ignored, zero gradient), mask values used as given or, with `softmax`, under a softmax over
// each group's K -> [N, H_out, W_out, G * C]. The grid is DCNv3's (sampled_sum/points.h). Host code written once
// for every backend, as DCNv3's (dcnv3.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "../sampled_sum/sampled_sum.h"

namespace deform_conv {

at::Tensor dcnv4_forward(const SampledSumKernels& kernels, const at::Tensor& input, const at::Tensor& offset_mask,
                         at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding,
                         at::IntArrayRef dilation, int64_t group, double offset_scale, bool remove_center,
                         bool softmax);

std::tuple<at::Tensor, at::Tensor> dcnv4_backward(const SampledSumKernels& kernels, const at::Tensor& grad_output,
                                                  const at::Tensor& input, const at::Tensor& offset_mask,
                                                  at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                                  at::IntArrayRef padding, at::IntArrayRef dilation, int64_t group,
                                                  double offset_scale, bool remove_center, bool softmax);

}  // namespace deform_conv
