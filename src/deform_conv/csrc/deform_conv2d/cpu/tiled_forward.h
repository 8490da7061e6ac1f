// The CPU forward of float32 layers whose tiles of output pixels are large enough, in one pass. Each task samples
// the columns of a tile of output pixels into a buffer that stays in cache, multiplies them by the weight at once
// (ATen's batch-reduce GEMM: oneDNN's microkernels, one thread each), and writes the product into the output,
// transposed to channels-first, with the bias. bfloat16 and float16 layers take the same path where the CPU
// multiplies them natively (half_gemm.h): the sampling in float32 from the image in its type (widened as it is
// loaded), the columns rounded once to the half type for the GEMM, which sums in float32, and the output rounded
// once; where their tiles would not fit, in tiles of whole images. Elsewhere they take the float32 path here, the
// image and the weight widened as they are turned and the output rounded as it is turned back. On the driver's
// path (columns_driver.h) the columns of a whole chunk go out to memory and come back for the GEMM, and the output
// makes a round trip in channels-last: for a layer of 64 channels at 56x56 that traffic costs about as much as the
// sampling itself.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "../conv_params.h"

namespace deform_conv {
namespace cpu {

// Whether tiled_forward serves this layer: float32 with the batch-reduce GEMM on oneDNN (batch_reduce_gemm_works)
// and tiles of at least 32 pixels within 512 KiB of columns and product (taps * C_in + C_out <= 4096), or a half
// type without a half GEMM here on the same terms (computed in float32, the same bits as on widened copies); or a
// half type with a half GEMM (half_gemm_for), an even taps * C_in/groups (the depth of the half types' packed weight
// comes in pairs of rows), and such tiles or else rows enough against its weight (columns_driver.h's rows_gemm_pays).
bool tiled_forward_applies(const ConvParams& p, const at::Tensor& input);

// `p` comes from make_conv_params on the same tensors (which validates them).
at::Tensor tiled_forward(const ConvParams& p, const at::Tensor& input, const at::Tensor& offset,
                         const std::optional<at::Tensor>& mask, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias);

}  // namespace cpu
}  // namespace deform_conv
