// The checks that derive a deformable convolution's sizes (ConvParams, conv_sizes.h) from its tensors. Host code.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <cstdint>

#include "conv_sizes.h"

namespace deform_conv {

// Checks every tensor against the others (the backstop behind the Python checks, for direct
// torch.ops calls) and returns the sizes. `grad_output`, when given, must have the output's shape.
ConvParams make_conv_params(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias,
                            c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                            c10::string_view border_gradient);

void check_grad_output(const ConvParams& p, const at::Tensor& grad_output, const at::Tensor& input);

}  // namespace deform_conv
