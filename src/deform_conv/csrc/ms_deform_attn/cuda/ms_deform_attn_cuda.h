// Multi-scale deformable attention's CUDA backend as its registration sees it (cuda/impl_ops.h): the two ops'
// implementations, with the schemas' arguments (schemas.h). Host code.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace deform_conv {
namespace cuda {

at::Tensor ms_deform_attn_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                  const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                                  const at::Tensor& attention_weights);

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward(const at::Tensor& grad_output,
                                                                       const at::Tensor& value,
                                                                       const at::Tensor& spatial_shapes,
                                                                       const at::Tensor& level_start_index,
                                                                       const at::Tensor& sampling_locations,
                                                                       const at::Tensor& attention_weights);

}  // namespace cuda
}  // namespace deform_conv
