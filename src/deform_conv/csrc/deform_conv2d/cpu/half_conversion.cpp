#include "half_conversion.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "sampling_point.h"

namespace deform_conv {
namespace cpu {
namespace {

// float32 to bfloat16 16 values at a time in vector registers (cpu_lanes.h: rounding adds half a unit of the
// dropped bits, ties to even, a NaN to 0x7FC0 -- c10::BFloat16's rule, on the bits), the rest one by one as
// c10::BFloat16 converts them (the same rule).
DC_CPU_DISPATCH void round_to_bfloat16(const float* src, int64_t n, c10::BFloat16* dst) {
  int64_t i = 0;
#if defined(__GNUC__)
  for (; i + kSumLanes <= n; i += kSumLanes) {
    FloatLanes lanes;
    load_lanes(src + i, lanes);
    store_lanes(lanes, dst + i);
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(src[i]);
}

// float16 has a different exponent range: the rounding is F16C's instruction where the CPU has it (every x86
// CPU with AVX2), c10::Half's software rounding elsewhere -- ten times slower, and the same values.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DC_HAVE_F16C_PATH 1
__attribute__((target("avx,f16c"))) void narrow_half_f16c(const float* src, int64_t n, c10::Half* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) dst[i].x = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

bool has_f16c() {
  static const bool has = __builtin_cpu_supports("f16c");
  return has;
}
#endif

// In blocks of the library's vector width (cpu_lanes.h's widening loads: exact).
template <typename half_t>
DC_CPU_DISPATCH void widen_blocks(const half_t* src, int64_t n, float* dst) {
  for_float_blocks(n, [&](const auto& tag, int64_t i) {
    std::decay_t<decltype(tag)> v;
    load_block(src + i, v);
    store_block(v, dst + i);
  });
}

}  // namespace

void widen(const c10::BFloat16* src, int64_t n, float* dst) { widen_blocks(src, n, dst); }
void widen(const c10::Half* src, int64_t n, float* dst) { widen_blocks(src, n, dst); }

void narrow(const float* src, int64_t n, c10::BFloat16* dst) { round_to_bfloat16(src, n, dst); }

void narrow(const float* src, int64_t n, c10::Half* dst) {
#ifdef DC_HAVE_F16C_PATH
  if (has_f16c()) return narrow_half_f16c(src, n, dst);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(src[i]);
}

namespace {

#if defined(__GNUC__)
// transpose_narrowing in blocks of 16 rows of src: whole blocks of the library's vector width turned over in
// registers (transpose.cpp), each row rounded there (cpu_lanes.h) and stored; the block's other columns turned
// over in float32 into `turned` [cols, 16] first, then rounded in vector blocks (for_float_blocks).
template <typename half_t>
DC_CPU_DISPATCH void transpose_narrowing_blocks(const float* src, int64_t rows, int64_t cols, int64_t ld_src,
                                                half_t* dst, int64_t ld_dst, const float* add, float* turned) {
  for (int64_t i0 = 0; i0 < rows; i0 += kSumLanes) {
    const int64_t block = std::min<int64_t>(kSumLanes, rows - i0);
    int64_t j0 = 0;
    for (; block == kSumLanes && j0 + kBlockLanes <= cols; j0 += kBlockLanes) {
      for (int64_t i = i0; i < i0 + kSumLanes; i += kBlockLanes) {
        transpose_block(src + i * ld_src + j0, ld_src, add != nullptr ? add + j0 : nullptr, dst + j0 * ld_dst + i,
                        ld_dst);
      }
    }
    for (int64_t j = j0; j < cols; ++j) {
      const float* from = src + i0 * ld_src + j;
      float* to = turned + j * kSumLanes;
      if (add != nullptr) {
        for (int64_t i = 0; i < block; ++i) to[i] = from[i * ld_src] + add[j];
      } else {
        for (int64_t i = 0; i < block; ++i) to[i] = from[i * ld_src];
      }
    }
    for (int64_t j = j0; j < cols; ++j) {
      for_float_blocks(block, [&](const auto& tag, int64_t i) {
        using V = std::decay_t<decltype(tag)>;
        V v;
        load_block(turned + j * kSumLanes + i, v);
        store_block(v, dst + j * ld_dst + i0 + i);
      });
    }
  }
}
#endif

}  // namespace

template <typename half_t>
void transpose_narrowing(const float* src, int64_t rows, int64_t cols, int64_t ld_src, half_t* dst, int64_t ld_dst,
                         const float* add) {
#if defined(__GNUC__)
  thread_local std::vector<float> turned;
  turned.resize(cols * kSumLanes);
  transpose_narrowing_blocks(src, rows, cols, ld_src, dst, ld_dst, add, turned.data());
#else
  // In blocks of 16 rows of src, as transpose() does; each block of a dst row is gathered in float32 and rounded
  // in one call.
  constexpr int64_t kBlock = 16;
  float gathered[kBlock];
  for (int64_t i0 = 0; i0 < rows; i0 += kBlock) {
    const int64_t block = std::min(kBlock, rows - i0);
    for (int64_t j = 0; j < cols; ++j) {
      const float* from = src + i0 * ld_src + j;
      if (add != nullptr) {
        for (int64_t i = 0; i < block; ++i) gathered[i] = from[i * ld_src] + add[j];
      } else {
        for (int64_t i = 0; i < block; ++i) gathered[i] = from[i * ld_src];
      }
      narrow(gathered, block, dst + j * ld_dst + i0);
    }
  }
#endif
}

template void transpose_narrowing<c10::BFloat16>(const float*, int64_t, int64_t, int64_t, c10::BFloat16*, int64_t,
                                                 const float*);
template void transpose_narrowing<c10::Half>(const float*, int64_t, int64_t, int64_t, c10::Half*, int64_t,
                                             const float*);

}  // namespace cpu
}  // namespace deform_conv
