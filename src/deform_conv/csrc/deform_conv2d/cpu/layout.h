// Whole tensors turned between the channels-first layout the op takes and gives, [B, C, H, W], and the
// channels-last one its CPU passes work in, [B, H, W, C], on the blocked transposes (transpose.h): ATen's copy of
// a permuted tensor ran at a third to half their speed (0.76 ms for S4's 3.2 MB input on a 2-core Zen 3 EPYC, a
// quarter of its depthwise forward; 1.0-1.1 ms of S1's backward on a 2-core Xeon). A half type is widened to
// float32, or rounded once from it, in the same pass, so the float32 paths read and write half-type tensors
// without a widened copy of their own.
#pragma once

#include <ATen/core/Tensor.h>

namespace deform_conv {
namespace cpu {

// out (channels-last in memory, ChannelsLast-contiguous, the sizes of `channels_first`) = channels_first
// (contiguous): float32 or a half type moved as it is, or a half type widened to float32. Returns false, doing
// nothing, for other dtypes (float64) or layouts, to leave the copy to ATen.
bool channels_last(const at::Tensor& channels_first, at::Tensor& out);

// t [B, C, H, W] in `dtype`, channels-last in memory: t itself where it is so already, else turned
// (channels_last(), or ATen's copy where it does not apply) into allocate(t's sizes, t's options in `dtype`), a
// channels-last tensor (a fresh one where `allocate` is nullptr).
using ChannelsLastAllocator = at::Tensor (*)(at::IntArrayRef sizes, const at::TensorOptions& options);
at::Tensor in_channels_last(const at::Tensor& t, at::ScalarType dtype, ChannelsLastAllocator allocate = nullptr);

// out [B, C, H, W] (contiguous) = channels_last [B, H, W, C] (contiguous) turned over: float32 or a half type
// moved as it is, or float32 rounded once to a half type; `add_per_channel` (float32, C values, or nullptr) added
// in float32 before the rounding. Returns false, doing nothing, for other dtypes or layouts, to leave the copy to
// ATen (which cannot add).
bool channels_first(const at::Tensor& channels_last, at::Tensor& out, const float* add_per_channel = nullptr);

// rows [len, C] of float32 (+ add[c]) into out [C, ld_out] from its column 0, turned over: in float32, or rounded
// once to a half type (c10::BFloat16, c10::Half), the sum before the rounding; `add` nullptr adds nothing. What
// channels_first() does a run of an image's pixels at a time, for passes that hold their own rows (depthwise.cpp).
template <typename out_t>
void rows_to_channels_first(const float* rows, int64_t len, int64_t channels, const float* add, out_t* out,
                            int64_t ld_out);

// t in float32, contiguous: t itself where it is so already; a half type widened on the library's vectors, in
// parallel (ATen's conversion of G6's offsets and mask, 600,000 bfloat16 values, took 0.3-0.4 ms, an eighth of its
// forward, on the 2-core EPYC); anything else by ATen.
at::Tensor float32_contiguous(const at::Tensor& t);

}  // namespace cpu
}  // namespace deform_conv
