// The CPU forward of float32 layers whose weight fits in a core's cache, in one pass. Each task samples the
// columns of a tile of output pixels into a buffer that stays in cache, multiplies them by the weight at once
// (ATen's batch-reduce GEMM: oneDNN's microkernels, one thread each), and writes the product into the output,
// transposed to channels-first, with the bias. On the driver's path (columns_driver.h) the columns of a whole
// chunk go out to memory and come back for the GEMM, and the output makes a round trip in channels-last: for a
// layer of 64 channels at 56x56 that traffic costs about as much as the sampling itself.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "../conv_params.h"

namespace deform_conv {
namespace cpu {

// Whether tiled_forward serves this layer: float32, a weight group of at most a few hundred KiB, and an ATen
// built with the batch-reduce GEMM for float32 on a CPU that has it (x86 with AVX2), with oneDNN enabled.
bool tiled_forward_applies(const ConvParams& p, const at::Tensor& input);

// `p` comes from make_conv_params on the same tensors (which validates them).
at::Tensor tiled_forward(const ConvParams& p, const at::Tensor& input, const at::Tensor& offset,
                         const std::optional<at::Tensor>& mask, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias);

}  // namespace cpu
}  // namespace deform_conv
