// deform_conv2d's CUDA backend as its registration sees it (cuda/impl_ops.h): the two ops' implementations, with
// the schemas' arguments (schemas.h). Host code.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace deform_conv {
namespace cuda {

at::Tensor deform_conv2d_forward(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                                 at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                 c10::string_view border_gradient);

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>
deform_conv2d_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
                       const at::Tensor& weight, const std::optional<at::Tensor>& mask, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, bool bias_defined,
                       c10::string_view border_gradient);

}  // namespace cuda
}  // namespace deform_conv
