// The CPU backend's entry points of deform_conv2d and its backward (schemas.h), registered by ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace deform_conv {
namespace cpu {

// input [B, C_in, H, W], offset [B, 2*offset_groups*kh*kw, H_out, W_out], weight [C_out, C_in/groups, kh, kw],
// mask [B, offset_groups*kh*kw, H_out, W_out], bias [C_out] -> [B, C_out, H_out, W_out]
at::Tensor deform_conv2d_forward(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                                 at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                 c10::string_view border_gradient);

// -> grad_input, grad_offset, grad_weight, grad_mask (without a mask: none), grad_bias (unless bias_defined: none)
std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>
deform_conv2d_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
                       const at::Tensor& weight, const std::optional<at::Tensor>& mask, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, bool bias_defined,
                       c10::string_view border_gradient);

}  // namespace cpu
}  // namespace deform_conv
