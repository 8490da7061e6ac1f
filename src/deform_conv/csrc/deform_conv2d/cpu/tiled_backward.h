// The CPU backward after the fill of a chunk's columns, in one pass over tiles of output pixels, for float32 layers
// (GEMMs on oneDNN's batch-reduce microkernels, brgemm.h) and for bfloat16 and float16 layers on the native half
// path (half_gemm.h): the weight's gradient from the whole chunk first, then for each tile of kPixelTile pixels its
// columns' gradient into a buffer that stays in cache, and at once the coordinates' and the input's gradients from
// it (sampling_passes.h: tile_grads). On the driver's path (columns_driver.h) the columns' gradient of a whole chunk
// goes out to memory and is read back by each of those two passes: for a layer of 64 channels at 56x56, 7 MiB of
// float32 an image, three times. (bfloat16 on a 2-core Sapphire Rapids Xeon, forward+backward: S1 9% faster, S5
// 10%, G3 14-22%; float32 S1 4% faster, G1 2-3% slower; the same bits.)
#pragma once

#include <ATen/core/Tensor.h>

#include "../columns_driver.h"

namespace deform_conv {
namespace cpu {

// SamplingPasses::tiled_backward for images [first, first + images) of a scalar_t layer (float, c10::BFloat16,
// c10::Half): grad_weights (float32) += the chunk's weight gradient, and the chunk's grad_offset, grad_mask (undefined
// without a mask) and grad_input (channels-last) from their columns' gradient, all three in float32. Each thread takes
// whole images, so that it alone adds into theirs of grad_input, in the driver's order: the same bits as the driver's
// GEMMs and passes. Returns false, doing nothing, where the chunk has fewer images than threads (the driver's input
// gradient then gives a thread a block of an image's channels where it has 16 or more), where the GEMMs do not run here
// (backward_gemms' and half_backward_gemms' conditions), a tensor is in another dtype (a half-type layer computed in
// float32, a float64 one) or a tile would not fit a thread's scratch memory.
template <typename scalar_t>
bool tiled_backward(const ConvParams& p, const SamplingTensors& tensors, const at::Tensor& grad_output,
                    int64_t first, int64_t images, const at::Tensor& weight_matrix, const at::Tensor& columns,
                    at::Tensor& grad_weights, at::Tensor& grad_offset, at::Tensor& grad_mask,
                    at::Tensor& grad_input);

}  // namespace cpu
}  // namespace deform_conv
