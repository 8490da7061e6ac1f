// Turning a matrix over, as the CPU paths do between channels-first and channels-last layouts.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace deform_conv {
namespace cpu {

// dst[j * ld_dst + i] = src[i * ld_src + j] (+ add[j]) for i < rows, j < cols. `add` holds one value per row of
// dst; with nullptr nothing is added (adding 0 would turn -0 into +0).
void transpose(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst,
               const float* add = nullptr);

// The same for a half type (c10::BFloat16, c10::Half), its values moved as they are, bit for bit.
template <typename half_t>
void transpose(const half_t* src, int64_t rows, int64_t cols, int64_t ld_src, half_t* dst, int64_t ld_dst);

// The same from a half type into float32, each value widened exactly: a half-type image or weight turned for the
// float32 path (tiled_forward.h) in one pass, instead of a widened copy and a turn.
template <typename half_t>
void transpose(const half_t* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst);

// The same for 32-bit words, moved as they are: pairs of a half type's values (the packed weight's VNNI pairs,
// half_gemm.h).
void transpose(const uint32_t* src, int64_t rows, int64_t cols, int64_t ld_src, uint32_t* dst, int64_t ld_dst);

// dst[r, t, c] = src[r, c, t] for r < rows, c < channels, t < taps: each row's [channels, taps] turned over (a
// weight [C_out, C_in/G, kh, kw] into the columns' order, taps outer). float32, or a half type's bits moved as
// they are.
void taps_outer(const float* src, int64_t rows, int64_t channels, int64_t taps, float* dst);
template <typename half_t>
void taps_outer(const half_t* src, int64_t rows, int64_t channels, int64_t taps, half_t* dst);
// The same from a half type into float32, each value widened exactly.
template <typename half_t>
void taps_outer(const half_t* src, int64_t rows, int64_t channels, int64_t taps, float* dst);

// The weight [C_out, C_in/G, kh, kw] turned to the columns' order, [C_out, kh, kw, C_in/G] (taps_outer, row by row
// from the L1 cache, where ATen's copy of the permuted weight took 0.45 ms of S3's bfloat16 forward on the Xeon:
// 2.67-2.69 ms then, 2.32-2.41 so), in `dtype`: the weight's own, or float32 from a half type, widened as it is
// turned (the half types' float32 path: 2.4 million values for S3). An undefined tensor for float64 and weights
// in other layouts, left to ATen (SamplingPasses::weight_in_column_order).
at::Tensor weight_in_column_order(const at::Tensor& weight, at::ScalarType dtype);

}  // namespace cpu
}  // namespace deform_conv
