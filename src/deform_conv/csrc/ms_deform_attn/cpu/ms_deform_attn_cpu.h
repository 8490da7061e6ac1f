// The CPU backend's entry points of multi-scale deformable attention and its backward (schemas.h), registered by
// ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace deform_conv {
namespace cpu {

// value [N, S, M, D], spatial_shapes [L, 2], level_start_index [L], sampling_locations [N, Lq, M, L, P, 2],
// attention_weights [N, Lq, M, L, P] -> [N, Lq, M * D]
at::Tensor ms_deform_attn_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                  const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                                  const at::Tensor& attention_weights);

// -> grad_value, grad_sampling_locations, grad_attention_weights
std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations, const at::Tensor& attention_weights);

}  // namespace cpu
}  // namespace deform_conv
