// From float32 to the half types (bfloat16, float16) for arrays, rounding to nearest even as torch's .to()
// does, so a value rounded here is the one torch would give. The CPU's half path samples and sums in float32 and
// rounds each stored value once: the columns the GEMM reads, and the output.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace deform_conv {
namespace cpu {

// dst[i] = src[i] widened to float32 (exactly), i < n.
void widen(const c10::BFloat16* src, int64_t n, float* dst);
void widen(const c10::Half* src, int64_t n, float* dst);

// dst[i] = src[i] rounded to the half type, i < n.
void narrow(const float* src, int64_t n, c10::BFloat16* dst);
void narrow(const float* src, int64_t n, c10::Half* dst);

// dst[j * ld_dst + i] = src[i * ld_src + j] (+ add[j]), rounded to the half type, for i < rows, j < cols: the
// tiled forward's product [pixels, C_out] into the output's channels-first rows.
template <typename half_t>
void transpose_narrowing(const float* src, int64_t rows, int64_t cols, int64_t ld_src, half_t* dst, int64_t ld_dst,
                         const float* add);

}  // namespace cpu
}  // namespace deform_conv
