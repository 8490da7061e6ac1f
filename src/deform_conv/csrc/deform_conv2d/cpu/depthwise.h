// The depthwise layer (groups == in_channels == out_channels) on the CPU, without columns and without GEMMs:
// each output channel is one input channel's samples weighted by kh*kw numbers, so the weighting is fused into
// the sampling pass. Forward and backward on tensors, for the op's CPU kernels. The half types run in float32,
// their input and grad_output widened as they are turned channels-last, their results rounded once (the output
// and the input's gradient as they are turned back): the bits of the float32 path on widened copies.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "../conv_params.h"

namespace deform_conv {
namespace cpu {

at::Tensor depthwise_forward(const ConvParams& p, const at::Tensor& input, const at::Tensor& offset,
                             const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                             const std::optional<at::Tensor>& bias);

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>
depthwise_backward(const ConvParams& p, const at::Tensor& grad_output, const at::Tensor& input,
                   const at::Tensor& offset, const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                   bool bias_defined);

}  // namespace cpu
}  // namespace deform_conv
