// FlashDeformAttn's entry points, bound to each backend's family kernels as DCNv3's (dcnv3/entry_points.h). Host
// code.
#pragma once

#include "flash_deform_attn.h"

#define FLASH_DEFORM_ATTN_ENTRY_POINTS                                                                           \
  inline at::Tensor flash_deform_attn_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,        \
                                              const at::Tensor& level_start_index,                              \
                                              const at::Tensor& sampling_loc_attn, int64_t n_points) {          \
    return ::deform_conv::flash_deform_attn_forward(sampled_sum_kernels(), value, spatial_shapes,               \
                                                    level_start_index, sampling_loc_attn, n_points);            \
  }                                                                                                             \
  inline std::tuple<at::Tensor, at::Tensor> flash_deform_attn_backward(                                         \
      const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,                 \
      const at::Tensor& level_start_index, const at::Tensor& sampling_loc_attn, int64_t n_points) {             \
    return ::deform_conv::flash_deform_attn_backward(sampled_sum_kernels(), grad_output, value, spatial_shapes, \
                                                     level_start_index, sampling_loc_attn, n_points);           \
  }

namespace deform_conv {
namespace cpu {
FLASH_DEFORM_ATTN_ENTRY_POINTS
}  // namespace cpu
namespace cuda {
FLASH_DEFORM_ATTN_ENTRY_POINTS
}  // namespace cuda
}  // namespace deform_conv

#undef FLASH_DEFORM_ATTN_ENTRY_POINTS
