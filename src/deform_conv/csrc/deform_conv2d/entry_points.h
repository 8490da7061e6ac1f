// deform_conv2d's entry points, with the schemas' arguments (schemas.h): the same functions in every backend, the
// CPU backend's in namespace cpu (cpu/deform_conv_cpu.cpp), the CUDA backend's in namespace cuda
// (cuda/deform_conv_cuda.cpp). The registration units bind them to the schemas. Host code.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

// input [B, C_in, H, W], offset [B, 2*offset_groups*kh*kw, H_out, W_out], weight [C_out, C_in/groups, kh, kw],
// mask [B, offset_groups*kh*kw, H_out, W_out], bias [C_out] -> [B, C_out, H_out, W_out]; the backward ->
// grad_input, grad_offset, grad_weight, grad_mask (without a mask: none), grad_bias (unless bias_defined: none).
#define DEFORM_CONV2D_ENTRY_POINTS                                                                                 \
  at::Tensor deform_conv2d_forward(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,   \
                                   const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias, \
                                   at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,    \
                                   c10::string_view border_gradient);                                            \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>           \
  deform_conv2d_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,       \
                         const at::Tensor& weight, const std::optional<at::Tensor>& mask, at::IntArrayRef stride, \
                         at::IntArrayRef padding, at::IntArrayRef dilation, bool bias_defined,                   \
                         c10::string_view border_gradient);

namespace deform_conv {
namespace cpu {
DEFORM_CONV2D_ENTRY_POINTS
}  // namespace cpu
namespace cuda {
DEFORM_CONV2D_ENTRY_POINTS
}  // namespace cuda
}  // namespace deform_conv

#undef DEFORM_CONV2D_ENTRY_POINTS
