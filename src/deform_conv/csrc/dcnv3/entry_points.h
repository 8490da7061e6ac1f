// DCNv3's entry points, with the schemas' arguments (schemas.h), in namespace cpu and cuda: its host code (dcnv3.h)
// bound to that backend's family kernels (sampled_sum.h). Inline, so a library that registers only one backend
// never references the other's kernels. Host code.
#pragma once

#include "dcnv3.h"

#define DCNV3_ENTRY_POINTS                                                                                        \
  inline at::Tensor dcnv3_forward(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,     \
                                  at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding,  \
                                  at::IntArrayRef dilation, int64_t group, double offset_scale,                  \
                                  bool remove_center) {                                                          \
    return ::deform_conv::dcnv3_forward(sampled_sum_kernels(), input, offset, mask, kernel_size, stride, padding, \
                                        dilation, group, offset_scale, remove_center);                           \
  }                                                                                                              \
  inline std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward(                                          \
      const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,  \
      at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,    \
      int64_t group, double offset_scale, bool remove_center) {                                                  \
    return ::deform_conv::dcnv3_backward(sampled_sum_kernels(), grad_output, input, offset, mask, kernel_size,   \
                                         stride, padding, dilation, group, offset_scale, remove_center);         \
  }

namespace deform_conv {
namespace cpu {
DCNV3_ENTRY_POINTS
}  // namespace cpu
namespace cuda {
DCNV3_ENTRY_POINTS
}  // namespace cuda
}  // namespace deform_conv

#undef DCNV3_ENTRY_POINTS
