// Multi-scale deformable attention's entry points, with the schemas' arguments (schemas.h): the same functions in
// every backend, the CPU backend's in namespace cpu (cpu/ms_deform_attn_cpu.cpp), the CUDA backend's in namespace
// cuda (cuda/ms_deform_attn_cuda.cpp). The registration units bind them to the schemas. Host code.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

// value [N, S, M, D], spatial_shapes [L, 2], level_start_index [L], sampling_locations [N, Lq, M, L, P, 2],
// attention_weights [N, Lq, M, L, P] -> [N, Lq, M * D]; the backward -> grad_value, grad_sampling_locations,
// grad_attention_weights.
#define MS_DEFORM_ATTN_ENTRY_POINTS                                                                               \
  at::Tensor ms_deform_attn_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,                  \
                                    const at::Tensor& level_start_index, const at::Tensor& sampling_locations,  \
                                    const at::Tensor& attention_weights);                                        \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward(                                        \
      const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,                  \
      const at::Tensor& level_start_index, const at::Tensor& sampling_locations,                                 \
      const at::Tensor& attention_weights);

namespace deform_conv {
namespace cpu {
MS_DEFORM_ATTN_ENTRY_POINTS
}  // namespace cpu
namespace cuda {
MS_DEFORM_ATTN_ENTRY_POINTS
}  // namespace cuda
}  // namespace deform_conv

#undef MS_DEFORM_ATTN_ENTRY_POINTS
