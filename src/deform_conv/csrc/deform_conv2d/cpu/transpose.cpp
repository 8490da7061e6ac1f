#include "transpose.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#if DC_CPU_VECTOR_BITS == 512
#include <immintrin.h>
#endif

#include "sampling_point.h"

namespace deform_conv {
namespace cpu {
namespace {

#if defined(__GNUC__)
// One n x n block (n = kLanesOf<V>: kBlockLanes, or 8) of 16-bit or 32-bit values turned over in registers, bit
// for bit: each value in a 32-bit lane of its own (16-bit ones zero-extended: the shuffles move bits, they compute
// nothing).
template <typename V, typename T>
inline void transpose_bits_block(const T* src, int64_t ld_src, T* dst, int64_t ld_dst) {
  constexpr int n = kLanesOf<V>;
  using Bits = typename LaneBits<V>::Bits;
  using Row = std::conditional_t<sizeof(T) == 2, typename LaneBits<V>::Half, Bits>;
  V lanes[n];
#pragma GCC unroll 16
  for (int i = 0; i < n; ++i) {
    Row row;
    std::memcpy(&row, src + i * ld_src, sizeof(row));
    const Bits bits = __builtin_convertvector(row, Bits);
    std::memcpy(&lanes[i], &bits, sizeof(bits));
  }
  transpose_lanes(lanes);
#pragma GCC unroll 16
  for (int j = 0; j < n; ++j) {
    Bits bits;
    std::memcpy(&bits, &lanes[j], sizeof(bits));
    const Row row = __builtin_convertvector(bits, Row);
    std::memcpy(dst + j * ld_dst, &row, sizeof(row));
  }
}

// Rows [i_begin, i_end) (a multiple of V's width) and columns [0, cols rounded down to it) in n x n blocks; returns
// the end of those columns.
template <typename V, typename S, typename T>
inline int64_t transpose_vector_blocks(const S* src, int64_t i_begin, int64_t i_end, int64_t cols, int64_t ld_src,
                                       T* dst, int64_t ld_dst, const float* add) {
  constexpr int64_t n = kLanesOf<V>;
  const int64_t j_end = cols / n * n;
  for (int64_t j0 = 0; j0 < j_end; j0 += n) {
    for (int64_t i = i_begin; i < i_end; i += n) {
      if constexpr (std::is_same_v<T, float>) {
        transpose_block<V>(src + i * ld_src + j0, ld_src, add != nullptr ? add + j0 : nullptr,
                           dst + j0 * ld_dst + i, ld_dst);
      } else {
        transpose_bits_block<V>(src + i * ld_src + j0, ld_src, dst + j0 * ld_dst + i, ld_dst);
      }
    }
  }
  return j_end;
}
#endif

// transpose_in_blocks with blocks of kRows rows of src.
template <int64_t kRows, typename S, typename T>
inline void transpose_in_row_blocks(const S* src, int64_t rows, int64_t cols, int64_t ld_src, T* dst, int64_t ld_dst,
                                    const float* add) {
  // Rows [i_begin, i_end) and columns [j_begin, j_end), value by value.
  const auto turn_values = [&](int64_t i_begin, int64_t i_end, int64_t j_begin, int64_t j_end) {
    for (int64_t j = j_begin; j < j_end; ++j) {
      const S* __restrict__ from = src + j;
      T* __restrict__ to = dst + j * ld_dst;
      if constexpr (std::is_same_v<T, float>) {
        if (add != nullptr) {
          const float a = add[j];
          for (int64_t i = i_begin; i < i_end; ++i) to[i] = static_cast<float>(from[i * ld_src]) + a;
          continue;
        }
      }
      for (int64_t i = i_begin; i < i_end; ++i) to[i] = static_cast<T>(from[i * ld_src]);
    }
  };
  for (int64_t i0 = 0; i0 < rows; i0 += kRows) {
    const int64_t i_end = std::min(rows, i0 + kRows);
    // Rows [i0, i_whole) in blocks of the vector width, then 8 more in 8 x 8 blocks where 8 to 15 remain (a layer
    // of 8 or 12 channels), each over columns [0, its j_end); the rest value by value.
    int64_t i_whole = i0, j_whole = 0, i_eight = i0, j_eight = 0;
#if defined(__GNUC__)
    i_whole = i0 + (i_end - i0) / kBlockLanes * kBlockLanes;
    if (i_whole == i0 + kRows) {
      j_whole = transpose_vector_blocks<BlockLanes>(src, i0, i0 + kRows, cols, ld_src, dst, ld_dst, add);
    } else if (i_whole > i0) {
      j_whole = transpose_vector_blocks<BlockLanes>(src, i0, i_whole, cols, ld_src, dst, ld_dst, add);
    }
    i_eight = i_whole;
    if constexpr (kBlockLanes > 8) {
      if (i_end - i_whole >= 8) {
        i_eight = i_whole + 8;
        j_eight = transpose_vector_blocks<FloatHalfLanes>(src, i_whole, i_eight, cols, ld_src, dst, ld_dst, add);
      }
    }
#endif
    turn_values(i0, i_whole, j_whole, cols);
    turn_values(i_whole, i_eight, j_eight, cols);
    turn_values(i_eight, i_end, 0, cols);
  }
}

// In blocks of rows of src, each block's columns turned in turn, and each row of dst written as many contiguous
// values at a time as the block has rows. 16 rows where they lie apart in memory (src channels-first, each row a
// stream of its own, whose lines stay in the L1 cache while every column reads them; more rows ran slower); 128 where
// they are one contiguous span (src channels-last, read as one stream) of more than 16 rows, so that the strided rows
// of dst are written in runs of 128 values, not 16 (the channels-last input gradient of S1, S2, G5 and G1 turned back
// 1.3-1.7x faster on the 2-core EPYC, in noisy runs). Runs of the library's vector width turned over in registers
// (16x16, or 8x8 for AVX2: GCC keeps a vector wider than the registers in memory, and 16x16 blocks there ran slower
// than value by value), and with 16x16 blocks 8 of the 8 to 15 rows left in 8x8 blocks (an image of 8 or 12 channels
// turned channels-last: the float32 forward of 32 images of 8 channels, stride 2, ran 20% faster so on the Xeon, 2
// threads, its forward+backward 6%), the rest value by value. T: float from S float (with `add`) or a half type
// (widened, `add` nullptr); or S = T uint16_t or uint32_t, the bits of one or two values of a half type (`add`
// nullptr).
template <typename S, typename T>
DC_CPU_DISPATCH void transpose_in_blocks(const S* src, int64_t rows, int64_t cols, int64_t ld_src, T* dst,
                                         int64_t ld_dst, const float* add) {
  if (ld_src == cols && rows > 16) {
    transpose_in_row_blocks<128>(src, rows, cols, ld_src, dst, ld_dst, add);
  } else {
    transpose_in_row_blocks<16>(src, rows, cols, ld_src, dst, ld_dst, add);
  }
}

// taps_outer's loops: for each row and tap, its channels a row of taps apart (the row read from the L1 cache). In a
// library compiled for AVX-512, 16 channels a gather: the compiler left the loop scalar, at the speed of ATen's
// copy of the permuted tensor. 16-bit values are gathered as the 32-bit words they begin, and a word that would
// reach past `end` (the source's last value) is read value by value instead.
template <typename S, typename T>
DC_CPU_DISPATCH void taps_outer_rows(const S* src, int64_t rows, int64_t channels, int64_t taps, T* dst,
                                     const S* end) {
  for (int64_t r = 0; r < rows; ++r) {
    const S* __restrict__ from = src + r * channels * taps;
    T* __restrict__ to = dst + r * channels * taps;
    for (int64_t t = 0; t < taps; ++t) {
      int64_t c = 0;
#if DC_CPU_VECTOR_BITS == 512
      if constexpr (std::is_same_v<S, T>) {  // moving bits (widening is left to the loop below)
        if (channels * taps < (int64_t(1) << 30)) {
          const __m512i lanes = _mm512_mullo_epi32(
              _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(int(taps)));
          for (; c + 16 <= channels; c += 16) {
            const __m512i index = _mm512_add_epi32(lanes, _mm512_set1_epi32(int(c * taps + t)));
            if constexpr (std::is_same_v<T, float>) {
              _mm512_storeu_ps(to + t * channels + c, _mm512_i32gather_ps(index, from, 4));
            } else {
              if (from + (c + 15) * taps + t + 1 >= end) break;
              const __m512i words = _mm512_i32gather_epi32(index, from, 2);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + t * channels + c), _mm512_cvtepi32_epi16(words));
            }
          }
        }
      }
#endif
      for (; c < channels; ++c) to[t * channels + c] = static_cast<T>(from[c * taps + t]);
    }
  }
}

}  // namespace

void taps_outer(const float* src, int64_t rows, int64_t channels, int64_t taps, float* dst) {
  taps_outer_rows(src, rows, channels, taps, dst, src + rows * channels * taps);
}

template <typename half_t>
void taps_outer(const half_t* src, int64_t rows, int64_t channels, int64_t taps, half_t* dst) {
  static_assert(sizeof(half_t) == sizeof(uint16_t), "a 16-bit type");
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  taps_outer_rows(bits, rows, channels, taps, reinterpret_cast<uint16_t*>(dst), bits + rows * channels * taps);
}

template void taps_outer<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, int64_t, c10::BFloat16*);
template void taps_outer<c10::Half>(const c10::Half*, int64_t, int64_t, int64_t, c10::Half*);

template <typename half_t>
void taps_outer(const half_t* src, int64_t rows, int64_t channels, int64_t taps, float* dst) {
  taps_outer_rows(src, rows, channels, taps, dst, src + rows * channels * taps);
}

template void taps_outer<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, int64_t, float*);
template void taps_outer<c10::Half>(const c10::Half*, int64_t, int64_t, int64_t, float*);

at::Tensor weight_in_column_order(const at::Tensor& weight, at::ScalarType dtype) {
  const at::ScalarType from = weight.scalar_type();
  const bool half = from == at::kBFloat16 || from == at::kHalf;
  const bool turns = dtype == from ? half || from == at::kFloat : half && dtype == at::kFloat;
  if (!weight.is_contiguous() || !turns) return at::Tensor();
  const int64_t rows = weight.size(0), channels = weight.size(1), taps = weight.size(2) * weight.size(3);
  at::Tensor turned = at::empty({rows, weight.size(2), weight.size(3), channels}, weight.options().dtype(dtype));
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    const int64_t at = begin * channels * taps;
    const auto turn = [&](auto half_type) {  // a half type's bits moved, or widened to float32
      using half_t = decltype(half_type);
      const half_t* src = weight.const_data_ptr<half_t>() + at;
      if (dtype == at::kFloat) {
        taps_outer(src, end - begin, channels, taps, turned.mutable_data_ptr<float>() + at);
      } else {
        taps_outer(src, end - begin, channels, taps, turned.mutable_data_ptr<half_t>() + at);
      }
    };
    switch (from) {
      case at::kBFloat16:
        return turn(c10::BFloat16());
      case at::kHalf:
        return turn(c10::Half());
      default:
        return taps_outer(weight.const_data_ptr<float>() + at, end - begin, channels, taps,
                          turned.mutable_data_ptr<float>() + at);
    }
  });
  return turned;
}

template <typename half_t>
void transpose(const half_t* src, int64_t rows, int64_t cols, int64_t ld_src, half_t* dst, int64_t ld_dst) {
  static_assert(sizeof(half_t) == sizeof(uint16_t), "a 16-bit type");
  transpose_in_blocks(reinterpret_cast<const uint16_t*>(src), rows, cols, ld_src, reinterpret_cast<uint16_t*>(dst),
                      ld_dst, nullptr);
}

template void transpose<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, int64_t, c10::BFloat16*, int64_t);
template void transpose<c10::Half>(const c10::Half*, int64_t, int64_t, int64_t, c10::Half*, int64_t);

template <typename half_t>
void transpose(const half_t* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst) {
  static_assert(sizeof(half_t) == sizeof(uint16_t), "a 16-bit type");
  transpose_in_blocks(src, rows, cols, ld_src, dst, ld_dst, nullptr);
}

template void transpose<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t, int64_t, float*, int64_t);
template void transpose<c10::Half>(const c10::Half*, int64_t, int64_t, int64_t, float*, int64_t);

void transpose(const uint32_t* src, int64_t rows, int64_t cols, int64_t ld_src, uint32_t* dst, int64_t ld_dst) {
  transpose_in_blocks(src, rows, cols, ld_src, dst, ld_dst, nullptr);
}

void transpose(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst,
               const float* add) {
  transpose_in_blocks(src, rows, cols, ld_src, dst, ld_dst, add);
}

}  // namespace cpu
}  // namespace deform_conv
