// DCNv4's entry points, bound to each backend's family kernels as DCNv3's (dcnv3/entry_points.h). Host code.
#pragma once

#include "dcnv4.h"

#define DCNV4_ENTRY_POINTS                                                                                        \
  inline at::Tensor dcnv4_forward(const at::Tensor& input, const at::Tensor& offset_mask,                        \
                                  at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding,  \
                                  at::IntArrayRef dilation, int64_t group, double offset_scale,                  \
                                  bool remove_center, bool softmax) {                                            \
    return ::deform_conv::dcnv4_forward(sampled_sum_kernels(), input, offset_mask, kernel_size, stride, padding, \
                                        dilation, group, offset_scale, remove_center, softmax);                  \
  }                                                                                                              \
  inline std::tuple<at::Tensor, at::Tensor> dcnv4_backward(                                                      \
      const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset_mask,                     \
      at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,    \
      int64_t group, double offset_scale, bool remove_center, bool softmax) {                                    \
    return ::deform_conv::dcnv4_backward(sampled_sum_kernels(), grad_output, input, offset_mask, kernel_size,    \
                                         stride, padding, dilation, group, offset_scale, remove_center, softmax); \
  }

namespace deform_conv {
namespace cpu {
DCNV4_ENTRY_POINTS
}  // namespace cpu
namespace cuda {
DCNV4_ENTRY_POINTS
}  // namespace cuda
}  // namespace deform_conv

#undef DCNV4_ENTRY_POINTS
