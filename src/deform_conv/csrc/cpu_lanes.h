// The CPU kernels' loops over channels in vector registers: sums in 16 fixed lanes (LaneSums, lane_dots), exact
// widening of float16/bfloat16 values and rounding of floats to them, 16, 8 or 4 at a time (load_lanes, store_lanes,
// widen_lanes, round_lanes), elementwise
// loops to the last channel (for_float_blocks), 16x16 blocks turned over (transpose_lanes, transpose_block), and
// the channel counts of common layers as constants (with_common_width).
//
// Sums: channel d goes to lane d % 16, and the lanes are then added pairwise (lane j + lane j + 8, then j + j + 4,
// j + j + 2, 0 + 1). The order is fixed here, not by the vector width the compiler picks: the same bits for any
// thread count and on any instruction set (AVX-512, AVX2, baseline x86-64, or another architecture).
//
// In float (the accumulation type of float, float16 and bfloat16) the lanes are one GCC/Clang vector, kept in
// registers, and the pairwise sums add its halves. What this replaces, an omp simd reduction per dot product,
// compiles to a sum through memory, lane by lane, that stalls on the vector store it has just made: in the family's
// backward that cost as much as all its other work. Other types (float64: exact checks, gradcheck), and compilers
// without vector extensions, take the same order lane by lane (LaneSums).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace deform_conv {
namespace cpu {

constexpr int kSumLanes = 16;

// The helpers below that issue AVX-512 instructions themselves (inline assembly, in the libraries compiled for
// AVX-512: cpu_kernels.h) are compiled for it too: Clang allocates an assembly operand's register in the helper
// itself, before inlining it into the kernels, and a zmm register exists only there.
#if DC_CPU_VECTOR_BITS == 512
#define DC_AVX512_ASM __attribute__((target("avx512f")))
#else
#define DC_AVX512_ASM
#endif
// Likewise a helper that calls an AVX2 builtin (partial_block) in the library compiled for AVX2, and its callers
// where a vector passes between them (Clang refuses a 256-bit vector returned across instruction sets).
#if DC_CPU_VECTOR_BITS == 256
#define DC_AVX2_HELPER __attribute__((target("avx2")))
#else
#define DC_AVX2_HELPER
#endif

// The 16 partial sums lane by lane, in an array.
template <typename acc_t>
struct LaneSums {
  acc_t lane[kSumLanes] = {};

  // lane j += a[j] * b[j], j < 16.
  template <typename A, typename B>
  void add_products(const A* a, const B* b) {
    add_products(a, b, kSumLanes);
  }
  // The same for j < count <= 16: the last channels of a sum go to lanes 0..count - 1.
  template <typename A, typename B>
  void add_products(const A* a, const B* b, int count) {
    for (int j = 0; j < count; ++j) lane[j] += static_cast<acc_t>(a[j]) * static_cast<acc_t>(b[j]);
  }
  acc_t total() const {
    acc_t t[kSumLanes];
    std::memcpy(t, lane, sizeof(t));
    for (int j = 0; j < 8; ++j) t[j] += t[j + 8];
    for (int j = 0; j < 4; ++j) t[j] += t[j + 4];
    for (int j = 0; j < 2; ++j) t[j] += t[j + 2];
    return t[0] + t[1];
  }
};

#if defined(__GNUC__)
typedef float FloatLanes __attribute__((vector_size(kSumLanes * sizeof(float))));
typedef float FloatHalfLanes __attribute__((vector_size(kSumLanes / 2 * sizeof(float))));
typedef float FloatQuarterLanes __attribute__((vector_size(kSumLanes / 4 * sizeof(float))));
// Two floats: the last pair of an elementwise loop (for_float_blocks) in one SSE operation.
typedef float FloatPairLanes __attribute__((vector_size(2 * sizeof(float))));

// The number of floats in a vector of them (FloatLanes, FloatHalfLanes, FloatQuarterLanes, FloatPairLanes).
template <typename V>
constexpr int kLanesOf = static_cast<int>(sizeof(V) / sizeof(float));

typedef uint32_t BitLanes __attribute__((vector_size(kSumLanes * sizeof(uint32_t))));
typedef uint16_t HalfBitLanes __attribute__((vector_size(kSumLanes * sizeof(uint16_t))));

// The bit patterns of a float vector V of 16, 8 or 4 lanes: Bits as 32-bit lanes, Half as 16-bit ones.
template <typename V>
struct LaneBits;
template <>
struct LaneBits<FloatLanes> {
  using Bits = BitLanes;
  using Half = HalfBitLanes;
};
template <>
struct LaneBits<FloatHalfLanes> {
  typedef uint32_t Bits __attribute__((vector_size(kSumLanes / 2 * sizeof(uint32_t))));
  typedef uint16_t Half __attribute__((vector_size(kSumLanes / 2 * sizeof(uint16_t))));
};
template <>
struct LaneBits<FloatQuarterLanes> {
  typedef uint32_t Bits __attribute__((vector_size(kSumLanes / 4 * sizeof(uint32_t))));
  typedef uint16_t Half __attribute__((vector_size(kSumLanes / 4 * sizeof(uint16_t))));
};

// The 16-bit patterns at p, as many as V has lanes, each shifted into the upper half of a 32-bit lane.
template <typename V>
inline typename LaneBits<V>::Bits upper_halves(const void* p) {
  typename LaneBits<V>::Half half;
  std::memcpy(&half, p, sizeof(half));
  return __builtin_convertvector(half, typename LaneBits<V>::Bits) << 16;
}

// The half-type values at p, as many as V has lanes, widened to float exactly. bfloat16 is the upper half of a
// float32. float16: c10's portable conversion (fp16_ieee_to_fp32_value, exact for every pattern: subnormals,
// infinities, NaNs) on all lanes at once; c10's own is written for one value, and compiled without F16C (the
// library's flags do not name it) the loops that call it stay scalar: a tenth of float32's speed.
template <typename V>
inline void widen_lanes(const c10::BFloat16* p, V& lanes) {
  const typename LaneBits<V>::Bits bits = upper_halves<V>(p);
  std::memcpy(&lanes, &bits, sizeof(lanes));
}

template <typename V>
inline void widen_lanes(const c10::Half* p, V& lanes) {
  using Bits = typename LaneBits<V>::Bits;
  const Bits w = upper_halves<V>(p);
  const Bits sign = w & 0x80000000u;
  const Bits two_w = w + w;
  V normalized, denormalized;
  const Bits normalized_bits = (two_w >> 4) + (0xE0u << 23);
  const Bits denormalized_bits = (two_w >> 17) | (126u << 23);
  std::memcpy(&normalized, &normalized_bits, sizeof(normalized));
  std::memcpy(&denormalized, &denormalized_bits, sizeof(denormalized));
  normalized *= 0x1.0p-112f;
  denormalized -= 0.5f;
  Bits normalized_out, denormalized_out;
  std::memcpy(&normalized_out, &normalized, sizeof(normalized_out));
  std::memcpy(&denormalized_out, &denormalized, sizeof(denormalized_out));
  const Bits is_denormalized = (Bits)(two_w < (1u << 27));  // all ones where true
  const Bits bits = sign | (denormalized_out & is_denormalized) | (normalized_out & ~is_denormalized);
  std::memcpy(&lanes, &bits, sizeof(lanes));
}

// The lanes rounded to bfloat16 at p: to nearest, ties to even, a NaN to 0x7FC0 (c10::BFloat16's rule; torch's
// vectorised .to() gives the same values, a NaN as another NaN's bits), on the bits.
template <typename V>
inline void round_lanes(const V& lanes, c10::BFloat16* p) {
  using Bits = typename LaneBits<V>::Bits;
  Bits bits;
  std::memcpy(&bits, &lanes, sizeof(bits));
  const Bits is_nan = (Bits)((bits & 0x7fffffffu) > 0x7f800000u);
  const Bits rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const auto out = __builtin_convertvector((rounded & ~is_nan) | (0x7fc0u & is_nan), typename LaneBits<V>::Half);
  std::memcpy(p, &out, sizeof(out));
}

// The lanes rounded to float16 at p: c10's portable conversion (fp16_ieee_from_fp32_value: to nearest, ties to
// even, overflow to infinity, subnormals, NaN to 0x7E00 with the sign), on all lanes at once. The same values as
// F16C's instruction, which keeps a NaN's payload instead.
template <typename V>
inline void round_lanes(const V& lanes, c10::Half* p) {
  using Bits = typename LaneBits<V>::Bits;
  Bits w;
  std::memcpy(&w, &lanes, sizeof(w));
  const Bits magnitude_bits = w & 0x7fffffffu;
  V base;
  std::memcpy(&base, &magnitude_bits, sizeof(base));
  base = (base * 0x1.0p+112f) * 0x1.0p-110f;
  const Bits shl1_w = w + w;
  const Bits sign = w & 0x80000000u;
  Bits bias = shl1_w & 0xff000000u;
  const Bits small = (Bits)(bias < 0x71000000u);
  bias = (bias & ~small) | (0x71000000u & small);
  const Bits bias_bits = (bias >> 1) + 0x07800000u;
  V bias_value;
  std::memcpy(&bias_value, &bias_bits, sizeof(bias_value));
  base = bias_value + base;
  Bits bits;
  std::memcpy(&bits, &base, sizeof(bits));
  const Bits nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
  const Bits is_nan = (Bits)(shl1_w > 0xff000000u);
  const Bits half = (sign >> 16) | (nonsign & ~is_nan) | (0x7e00u & is_nan);
  const auto out = __builtin_convertvector(half, typename LaneBits<V>::Half);
  std::memcpy(p, &out, sizeof(out));
}

// 16 elements from p, widened to float, exactly. (Vectors go by reference: passed by value they would change the
// calling convention between the instruction sets a portable library is compiled for.)
inline void load_lanes(const float* p, FloatLanes& lanes) { std::memcpy(&lanes, p, sizeof(lanes)); }

#if defined(DC_CPU_AVX512_BF16)
// 16 bfloat16 bit patterns widened to float, exactly: each zero-extended by an instruction of its own (GCC's vector
// conversion compiles to a slower sequence in a library compiled for AVX512-BF16), then moved to the upper half.
DC_AVX512_ASM inline void widen_bfloat16_bits(const HalfBitLanes& half, FloatLanes& lanes) {
  BitLanes bits;
  asm("vpmovzxwd %1, %0" : "=v"(bits) : "v"(half));
  bits <<= 16;
  std::memcpy(&lanes, &bits, sizeof(lanes));
}
#endif

// bfloat16 (widen_lanes; widen_bfloat16_bits in a library compiled for AVX512-BF16).
DC_AVX512_ASM inline void load_lanes(const c10::BFloat16* p, FloatLanes& lanes) {
#if defined(DC_CPU_AVX512_BF16)
  HalfBitLanes half;
  std::memcpy(&half, p, sizeof(half));
  widen_bfloat16_bits(half, lanes);
#else
  widen_lanes(p, lanes);
#endif
}

// float16 (widen_lanes). A library compiled for AVX-512 widens with AVX512F's conversion instruction, exact for
// every value (a signalling NaN comes out quiet, which no sum or product of it can tell apart), where the bits'
// way takes a dozen instructions.
DC_AVX512_ASM inline void load_lanes(const c10::Half* p, FloatLanes& lanes) {
#if DC_CPU_VECTOR_BITS == 512
  HalfBitLanes half;
  std::memcpy(&half, p, sizeof(half));
  asm("vcvtph2ps %1, %0" : "=v"(lanes) : "v"(half));
#else
  widen_lanes(p, lanes);
#endif
}

// Other types lane by lane.
template <typename scalar_t>
inline void load_lanes(const scalar_t* p, FloatLanes& lanes) {
  float wide[kSumLanes];
  for (int j = 0; j < kSumLanes; ++j) wide[j] = static_cast<float>(p[j]);
  std::memcpy(&lanes, wide, sizeof(lanes));
}

inline void store_lanes(const FloatLanes& lanes, float* p) { std::memcpy(p, &lanes, sizeof(lanes)); }

// count < 16 elements from p widened into the first lanes, +0 in the others, set in registers (copied through
// memory into a vector, they stalled every load on the stores just made). Floats in a library compiled for
// AVX-512 (cpu_kernels.h): one load under a mask, which reads nothing past the count. The half types: a block of 8
// and one of 4 widened in registers (widen_lanes) where the count holds them, the last 0-3 one by one (an offset
// group of 8 or 12 channels: the coordinates' gradient on a bfloat16 image widened every value on its own).
template <typename T>
DC_AVX512_ASM inline void load_first_lanes(const T* p, int count, FloatLanes& lanes) {
#if DC_CPU_VECTOR_BITS == 512
  if constexpr (std::is_same_v<T, float>) {
    const uint32_t mask = (uint32_t(1) << count) - 1;
    asm("kmovw %1, %%k1\n\tvmovups %2, %0%{%%k1%}%{z%}"
        : "=v"(lanes)
        : "r"(mask), "m"(*reinterpret_cast<const float(*)[kSumLanes]>(p))
        : "k1");
    return;
  }
#endif
#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector (GCC 9-11 take the loop below)
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) {
    FloatHalfLanes low = {}, high = {};  // lanes 0-7 and 8-15
    int j = 0;
    if (count >= 8) {
      widen_lanes(p, low);
      j = 8;
    }
    if (count - j >= 4) {
      FloatQuarterLanes quarter;
      widen_lanes(p + j, quarter);
      const FloatHalfLanes eight = __builtin_shufflevector(quarter, FloatQuarterLanes{}, 0, 1, 2, 3, 4, 5, 6, 7);
      (j == 0 ? low : high) = eight;
      j += 4;
    }
    lanes = __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; j < count; ++j) lanes[j] = static_cast<float>(p[j]);
    return;
  }
#endif
  lanes = FloatLanes{};
#pragma GCC unroll 16
  for (int j = 0; j < kSumLanes; ++j) {
    if (j < count) lanes[j] = static_cast<float>(p[j]);
  }
}

// The lanes (16, 8 or 4) rounded to bfloat16 at p (round_lanes). A library compiled for AVX512-BF16
// (cpu_kernels.h) rounds with its instruction, one where the bits take ten: the same rounding, but it reads a
// subnormal as zero and keeps a NaN's sign and payload, so lanes with either (AVX512DQ's vfpclassps finds them)
// take the bits' way. (Written as assembly: the compiler is not told of AVX512-BF16, cpu_kernels.h says why. 8 and
// 4 lanes take AVX512VL's forms, which every CPU with AVX512-BF16 has.)
template <typename V>
DC_AVX512_ASM inline void round_bfloat16_lanes(const V& lanes, c10::BFloat16* p) {
#if defined(DC_CPU_AVX512_BF16)
  bool plain;  // no lane is a NaN or subnormal (the zero flag kortestw sets; the mask's bits past the lanes are 0)
  asm("vfpclassps $0xa1, %1, %%k1\n\tkortestw %%k1, %%k1" : "=@ccz"(plain) : "v"(lanes) : "k1");
  if (__builtin_expect(plain, 1)) {
    if constexpr (sizeof(V) == sizeof(FloatLanes)) {
      HalfBitLanes rounded;
      asm("vcvtneps2bf16 %1, %0" : "=v"(rounded) : "v"(lanes));
      std::memcpy(p, &rounded, sizeof(rounded));
    } else {
      typedef uint16_t EightHalves __attribute__((vector_size(8 * sizeof(uint16_t))));
      EightHalves rounded;  // 4 lanes: the first four
      asm("vcvtneps2bf16 %1, %0" : "=v"(rounded) : "v"(lanes));
      std::memcpy(p, &rounded, sizeof(V) / 2);
    }
    return;
  }
#endif
  round_lanes(lanes, p);
}

inline void store_lanes(const FloatLanes& lanes, c10::BFloat16* p) { round_bfloat16_lanes(lanes, p); }

#if defined(DC_CPU_AVX512_BF16)
// 32 bfloat16 values at p widened exactly as two vectors, the even channels and the odd ones (AVX512-BF16
// libraries): the 32-bit words that hold them shifted, and masked (a bfloat16 is the upper half of a float32),
// where 16 at a time took a shuffle each.
inline void widen_bfloat16_pairs(const c10::BFloat16* p, FloatLanes& even, FloatLanes& odd) {
  BitLanes pairs;
  std::memcpy(&pairs, p, sizeof(pairs));
  const BitLanes low = pairs << 16, high = pairs & 0xffff0000u;
  std::memcpy(&even, &low, sizeof(low));
  std::memcpy(&odd, &high, sizeof(high));
}

// widen_bfloat16_pairs undone: the even and odd channels rounded to bfloat16 by one instruction and interleaved back
// into 32 values at p by another (AVX512BW's word permute, which every CPU with AVX512-BF16 has). Where a lane of
// either is a NaN or subnormal, c10::BFloat16's rounding value by value, as round_bfloat16_lanes does.
DC_AVX512_ASM inline void round_bfloat16_pairs(const FloatLanes& even, const FloatLanes& odd, c10::BFloat16* p) {
  bool plain;  // no lane of either is a NaN or subnormal
  asm("vfpclassps $0xa1, %1, %%k1\n\tvfpclassps $0xa1, %2, %%k2\n\tkortestw %%k2, %%k1"
      : "=@ccz"(plain)
      : "v"(even), "v"(odd)
      : "k1", "k2");
  if (__builtin_expect(plain, 1)) {
    // 32 words in 16 lanes of 32 bits (the library is not compiled for AVX512BW, whose vectors of words the
    // compiler would need): word 2j takes word j, and word 2j + 1 word 16 + j.
    static const BitLanes kInterleave = {0x100000, 0x110001, 0x120002, 0x130003, 0x140004, 0x150005,
                                         0x160006, 0x170007, 0x180008, 0x190009, 0x1a000a, 0x1b000b,
                                         0x1c000c, 0x1d000d, 0x1e000e, 0x1f000f};
    BitLanes halves, interleaved;  // words 0-15 the even channels', 16-31 the odd ones'
    asm("vcvtne2ps2bf16 %2, %1, %0" : "=v"(halves) : "v"(odd), "v"(even));
    asm("vpermw %1, %2, %0" : "=v"(interleaved) : "v"(halves), "v"(kInterleave));
    std::memcpy(p, &interleaved, sizeof(interleaved));
    return;
  }
  for (int j = 0; j < kSumLanes; ++j) {
    p[2 * j] = c10::BFloat16(even[j]);
    p[2 * j + 1] = c10::BFloat16(odd[j]);
  }
}
#endif

// The lanes rounded to float16 at p (round_lanes). A library compiled for AVX512-BF16 (whose CPUs all have AVX512DQ,
// cpu_kernels.h) rounds with AVX512F's conversion instruction (to nearest, ties to even, as round_lanes), but for
// lanes that hold a NaN, whose payload it keeps where c10 writes 0x7E00, or a float32 subnormal: those take the bits'
// way (AVX512DQ's vfpclassps finds them, as for bfloat16).
DC_AVX512_ASM inline void store_lanes(const FloatLanes& lanes, c10::Half* p) {
#if defined(DC_CPU_AVX512_BF16)
  bool plain;  // no lane is a NaN or subnormal
  asm("vfpclassps $0xa1, %1, %%k1\n\tkortestw %%k1, %%k1" : "=@ccz"(plain) : "v"(lanes) : "k1");
  if (__builtin_expect(plain, 1)) {
    HalfBitLanes rounded;
    asm("vcvtps2ph $0, %1, %0" : "=v"(rounded) : "v"(lanes));
    std::memcpy(p, &rounded, sizeof(rounded));
    return;
  }
#endif
  round_lanes(lanes, p);
}

// LaneSums::total()'s last steps, once lanes j and j + 8 are added: of 8 lanes, j + j + 4, then j + j + 2, 0 + 1.
inline float total_of(const FloatQuarterLanes& quarter) {
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}
inline float total_of(const FloatHalfLanes& half) {
  FloatQuarterLanes low, high;
  std::memcpy(&low, &half, sizeof(low));
  std::memcpy(&high, reinterpret_cast<const char*>(&half) + sizeof(low), sizeof(high));
  return total_of(FloatQuarterLanes(low + high));
}

// The 16 partial sums in one vector (lane_dots adds to them).
template <>
struct LaneSums<float> {
  FloatLanes lanes = {};

  float total() const {
    FloatHalfLanes low, high;
    std::memcpy(&low, &lanes, sizeof(low));
    std::memcpy(&high, reinterpret_cast<const char*>(&lanes) + sizeof(low), sizeof(high));
    return total_of(FloatHalfLanes(low + high));
  }
};

// The widest vector of floats the library's loops use (kBlockLanes, BlockLanes): 16 lanes, or where the library
// is compiled for an instruction set whose registers hold fewer, as many as they hold (AVX2: 8, baseline x86-64:
// 4). GCC keeps a vector wider than the registers in memory, and multiplying it by a scalar built its 16 lanes there
// value by value, each sampling point's four weights 64 stores and loads that wait on them (the float32 fill of a
// layer of 16 channels an offset group ran 7 times slower so on an AVX2 EPYC).
#if DC_CPU_VECTOR_BITS == 256
constexpr int kBlockLanes = kSumLanes / 2;
#elif DC_CPU_VECTOR_BITS == 128
constexpr int kBlockLanes = kSumLanes / 4;
#else
constexpr int kBlockLanes = kSumLanes;
#endif

// A vector of kBlockLanes floats.
using BlockLanes = std::conditional_t<kBlockLanes == kSumLanes, FloatLanes,
                                      std::conditional_t<kBlockLanes == kSumLanes / 2, FloatHalfLanes,
                                                         FloatQuarterLanes>>;

// An elementwise loop over n floats in vector registers, its remainder included: f(tag, i) for blocks starting at i,
// tag a FloatLanes while 16 remain, then a FloatHalfLanes for 8, a FloatQuarterLanes for 4, a FloatPairLanes for 2,
// then a float for the last one (no wider than kBlockLanes: elementwise, the width changes no value). f loads and
// stores as many floats as sizeof its tag (std::memcpy) and computes on them as on scalars, so every element gets the
// same operations: the same bits as a plain loop. (The compiler's own vectorisation leaves a loop's remainder scalar in
// this library -- sources.py's GCC flags --, and layers whose channels come in pieces of 8, offset groups across few
// channels, ran wholly scalar. The pair: a layer of 40 channels in 5 weight and 4 offset groups, whose offset groups of
// 10 come in pieces of 8 + 2, 6 + 4, 4 + 6 and 2 + 8, two channels one by one in each, filled its columns 2-3% faster
// with it and added its input gradient 1-7% faster, one thread on the 2-core EPYC.)
template <typename F>
inline void for_float_blocks(int64_t n, const F& f) {
  int64_t i = 0;
  if constexpr (kBlockLanes == kSumLanes) {
    for (; i + kSumLanes <= n; i += kSumLanes) f(FloatLanes{}, i);
  }
  if constexpr (kBlockLanes >= kSumLanes / 2) {
    for (; i + kSumLanes / 2 <= n; i += kSumLanes / 2) f(FloatHalfLanes{}, i);
  }
  for (; i + kSumLanes / 4 <= n; i += kSumLanes / 4) f(FloatQuarterLanes{}, i);
  if (i + 2 <= n) {
    f(FloatPairLanes{}, i);
    i += 2;
  }
  for (; i < n; ++i) f(float{}, i);
}

// A block of for_float_blocks (V: one of its tags) from p, widened to float exactly (load_lanes for 16 lanes of a
// half type), and into p, rounded to its type (store_lanes for 16 lanes).
template <typename V, typename T>
inline void load_block(const T* p, V& v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(V));
  } else if constexpr (std::is_same_v<V, FloatLanes>) {
    load_lanes(p, v);
  } else if constexpr (std::is_same_v<V, float>) {
    v = static_cast<float>(*p);
  } else if constexpr ((std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>) &&
                       !std::is_same_v<V, FloatPairLanes>) {  // (a pair, value by value below)
    widen_lanes(p, v);  // 8 or 4 lanes in registers: layers whose channels come in pieces of 8 or 12
  } else {
    for (int j = 0; j < kLanesOf<V>; ++j) v[j] = static_cast<float>(p[j]);
  }
}

template <typename V, typename T>
inline void store_block(const V& v, T* p) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof(V));
  } else if constexpr (std::is_same_v<V, FloatLanes>) {
    store_lanes(v, p);
  } else if constexpr (std::is_same_v<V, float>) {
    *p = static_cast<T>(v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16> && !std::is_same_v<V, FloatPairLanes>) {
    round_bfloat16_lanes(v, p);  // 8 or 4 lanes in registers
  } else if constexpr (std::is_same_v<T, c10::Half> && !std::is_same_v<V, FloatPairLanes>) {
    round_lanes(v, p);
  } else {
    for (int j = 0; j < kLanesOf<V>; ++j) p[j] = static_cast<T>(v[j]);
  }
}
#endif

#if defined(__GNUC__)
// Lanes Lane::at(i), i < n, of a (numbered 0 to n - 1) and b (n to 2n - 1), vectors of n floats, as the shuffle
// builtins number them.
template <typename Lane, typename V, int... i>
inline V shuffle_lanes(const V& a, const V& b, std::integer_sequence<int, i...>) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, Lane::at(i)...);
#else
  return __builtin_shuffle(a, b, typename LaneBits<V>::Bits{static_cast<uint32_t>(Lane::at(i))...});
#endif
}

template <typename Lane, typename V>
inline V shuffle_lanes(const V& a, const V& b) {
  return shuffle_lanes<Lane>(a, b, std::make_integer_sequence<int, kLanesOf<V>>{});
}

// For transpose_round over vectors of n lanes: of each 2h lanes, the first h from a's and then h from b's run number
// `part` (0 or 1) of h lanes.
template <int n, int h, int part>
struct RunLane {
  static constexpr int at(int i) {
    const int chunk = i / (2 * h) * (2 * h), offset = i % (2 * h);
    return offset < h ? chunk + part * h + offset : n + chunk + part * h + offset - h;
  }
};

// rows[0..n-1] (n rows of n floats, V a vector of n) turned over in registers: rows[k][i] becomes rows[i][k].
// log2(n) rounds, each pairing rows h apart (h = n/2, ..., 2, 1) and interleaving their runs of h lanes: for 16
// lanes 64 two-vector shuffles for 256 values, where moving them one by one took a load and a store each.
template <int h, typename V>
inline void transpose_round(V* rows) {
  constexpr int n = kLanesOf<V>;
#pragma GCC unroll 16
  for (int r = 0; r < n; ++r) {
    if (r & h) continue;
    const V a = rows[r], b = rows[r + h];
    rows[r] = shuffle_lanes<RunLane<n, h, 0>>(a, b);
    rows[r + h] = shuffle_lanes<RunLane<n, h, 1>>(a, b);
  }
}

template <typename V>
inline void transpose_lanes(V* rows) {
  if constexpr (kLanesOf<V> >= 16) transpose_round<8>(rows);
  if constexpr (kLanesOf<V> >= 8) transpose_round<4>(rows);
  transpose_round<2>(rows);
  transpose_round<1>(rows);
}

// The n x n block src[i * ld_src + j] (+ add[j]) into dst[j * ld_dst + i], i, j < n, n the library's vector width
// (kBlockLanes: 16, 8 for AVX2, 4 for baseline x86-64): src float, or a half type widened as it is loaded
// (load_block); dst float, or a half type each row rounded in registers (store_block). `add` nullptr adds nothing
// (adding 0 would turn -0 into +0).
// V: a narrower vector of floats turns a block of its width (transpose.cpp's 8 x 8 blocks, for 8 to 15 rows).
template <typename V = BlockLanes, typename S, typename T>
inline void transpose_block(const S* src, int64_t ld_src, const float* add, T* dst, int64_t ld_dst) {
  constexpr int n = kLanesOf<V>;
  V lanes[n];
#pragma GCC unroll 16
  for (int i = 0; i < n; ++i) load_block(src + i * ld_src, lanes[i]);
  transpose_lanes(lanes);
#pragma GCC unroll 16
  for (int j = 0; j < n; ++j) {
    if (add != nullptr) lanes[j] += add[j];
    store_block(lanes[j], dst + j * ld_dst);
  }
}

// For total_four: `step` 0 takes both vectors' halves (a's into lanes 0-7, b's into 8-15), `part` 0 the low and 1
// the high half of each; step 1 the quarters of four halves (lanes 0-7 of a, 8-15 of a, 0-7 of b, 8-15 of b) into
// four runs of four lanes; step 2 the third and fourth of each run of four, step 3 the second and first.
template <int step, int part>
struct TotalLane {
  static constexpr int at(int i) {
    switch (step) {
      case 0:
        return (i < 8 ? 0 : kSumLanes) + part * 8 + i % 8;
      case 1:
        return (i / 4 >= 2 ? kSumLanes : 0) + (i / 4) % 2 * 8 + part * 4 + i % 4;
      case 2:
        return i / 4 * 4 + (i % 4 + 2) % 4;
      default:
        return i / 4 * 4 + (i % 4 ^ 1);
    }
  }
};

// The totals of four lane sums at once, each added in LaneSums<float>::total()'s order (the same pairs, so the
// same bits): the four vectors' halves, quarters and pairs side by side in the lanes of fewer vectors, 8 shuffles
// and 5 additions where four totals one by one took about 30 instructions, much of the per-point work of a
// backward pass over few channels.
inline void total_four(const FloatLanes& a, const FloatLanes& b, const FloatLanes& c, const FloatLanes& d,
                       float total[4]) {
  const FloatLanes ab = shuffle_lanes<TotalLane<0, 0>>(a, b) + shuffle_lanes<TotalLane<0, 1>>(a, b);
  const FloatLanes cd = shuffle_lanes<TotalLane<0, 0>>(c, d) + shuffle_lanes<TotalLane<0, 1>>(c, d);
  const FloatLanes quarters = shuffle_lanes<TotalLane<1, 0>>(ab, cd) + shuffle_lanes<TotalLane<1, 1>>(ab, cd);
  const FloatLanes pairs = quarters + shuffle_lanes<TotalLane<2, 0>>(quarters, quarters);
  const FloatLanes sums = pairs + shuffle_lanes<TotalLane<3, 0>>(pairs, pairs);
  for (int k = 0; k < 4; ++k) total[k] = sums[4 * k];
}
#endif

// The widths with_common_width fixes at compile time (the channels of a group in the common layers).
constexpr bool is_common_width(int64_t n) { return n == 8 || n == 12 || n == 16 || n == 32 || n == 64; }

// Calls f(width): width a std::integral_constant<int64_t, n> where n is a common width (is_common_width) and at most
// max_width, else n itself. Inlined into f, the channel loops below over a width
// the compiler sees compile without their dispatch over block widths and tails (for_float_blocks, lane_dots) and
// the spills it brings, which cost as much as their arithmetic where a point has few channels.
template <int64_t max_width = 64, typename F>
inline void with_common_width(int64_t n, const F& f) {
  switch (n) {
    case 8:
      return f(std::integral_constant<int64_t, 8>{});
    case 12:
      return f(std::integral_constant<int64_t, 12>{});
    case 16:
      return f(std::integral_constant<int64_t, 16>{});
    case 32:
      if constexpr (max_width >= 32) return f(std::integral_constant<int64_t, 32>{});
      break;
    case 64:
      if constexpr (max_width >= 64) return f(std::integral_constant<int64_t, 64>{});
      break;
  }
  return f(n);
}

// dst[d] += w * src[d], d < len: a weighted row added into a gradient.
template <typename acc_t>
inline void add_scaled(acc_t w, const acc_t* __restrict__ src, int64_t len, acc_t* __restrict__ dst) {
#if defined(__GNUC__)
  if constexpr (std::is_same_v<acc_t, float>) {  // in vector registers to the last element: the same bits
    for_float_blocks(len, [&](const auto& tag, int64_t d) {
      using V = std::decay_t<decltype(tag)>;
      V s, t;
      std::memcpy(&s, src + d, sizeof(V));
      std::memcpy(&t, dst + d, sizeof(V));
      t = t + w * s;
      std::memcpy(dst + d, &t, sizeof(V));
    });
    return;
  }
#endif
  for (int64_t d = 0; d < len; ++d) dst[d] += w * src[d];
}

// dst[q][c] += k[q] * source(tag, c) for the four corners q of a point (four different pixels), c < len, where
// source gives the values of channels [c, c + the lanes of tag's type), a vector of floats or one value: one loop
// for the four corners, the source taken once for them. The same bits as add_scaled corner by corner, which takes
// the points with a corner outside the image. (The four read-modify-write streams in one loop: the input
// gradient's passes of deform_conv2d, bound by them, ran 8-10% faster so on its depthwise S4, on a 2-core Zen 3
// EPYC.)
template <typename scalar_t, typename Source>
inline void add_to_four_corners(scalar_t* const dst[4], const scalar_t k[4], int64_t len, const Source& source) {
  const auto add = [&](const auto& tag, int64_t c) {
    using V = std::decay_t<decltype(tag)>;
    const V value = source(tag, c);
    for (int q = 0; q < 4; ++q) {
      V sum;
      std::memcpy(&sum, dst[q] + c, sizeof(V));
      sum = sum + k[q] * value;
      std::memcpy(dst[q] + c, &sum, sizeof(V));
    }
  };
#if defined(__GNUC__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    for_float_blocks(len, add);
    return;
  }
#endif
  for (int64_t c = 0; c < len; ++c) add(scalar_t{}, c);
}

#if defined(__GNUC__)
// The total of 16 lane sums held as 16 / (the lanes of V) vectors V (BlockLanes: lanes 0-7 and 8-15 for AVX2), in
// LaneSums::total()'s order: lane j + lane j + 8 first (the blocks' halves), then total_of.
template <typename V>
inline float total_of_blocks(const V* sums) {
  constexpr int kBlocks = kSumLanes / kLanesOf<V>;
  if constexpr (kBlocks == 1) {
    return LaneSums<float>{sums[0]}.total();
  } else if constexpr (kBlocks == 2) {
    return total_of(FloatHalfLanes(sums[0] + sums[1]));
  } else {  // lanes 0-3, 4-7, 8-11, 12-15
    return total_of(FloatQuarterLanes((sums[0] + sums[2]) + (sums[1] + sums[3])));
  }
}
#endif

#if defined(__GNUC__) && (DC_CPU_VECTOR_BITS == 256 || DC_CPU_VECTOR_BITS == 128)
// Lanes [0, n) of a block of kBlockLanes from p, 0 < n < kBlockLanes, widened to float exactly; +0 in the others.
// Floats in a library compiled for AVX2: one load under a mask (AVX's vmaskmovps), which reads nothing past the
// count. (Built value by value, the block went through the stack, and each load of it waited on the stores: the
// coordinates' pass of a layer whose offset groups have 10 channels, 8 + 2, spent a third of its time there.)
template <typename T>
DC_AVX2_HELPER inline BlockLanes partial_block(const T* p, int n) {
#if DC_CPU_VECTOR_BITS == 256
  if constexpr (std::is_same_v<T, float>) {
    typedef int32_t IndexLanes __attribute__((vector_size(sizeof(BlockLanes))));
    const IndexLanes index = {0, 1, 2, 3, 4, 5, 6, 7};
    return __builtin_ia32_maskloadps256(reinterpret_cast<const BlockLanes*>(p), index < n);
  }
#endif
  BlockLanes lanes = {};
  int j = 0;
#if DC_CPU_VECTOR_BITS == 256 && (defined(__clang__) || __GNUC__ >= 12)  // __builtin_shufflevector
  if (n >= 4) {  // 4 of them widened at once (a half type's, value by value, c10's)
    FloatQuarterLanes quarter;
    load_block(p, quarter);
    lanes = __builtin_shufflevector(quarter, FloatQuarterLanes{}, 0, 1, 2, 3, 4, 5, 6, 7);
    j = 4;
  }
#endif
  for (; j < n; ++j) lanes[j] = static_cast<float>(p[j]);
  return lanes;
}

// lane_dots in float where the library's vectors hold fewer than 16 floats (kBlockLanes): each sum's 16 lanes as
// kSumLanes / kBlockLanes vectors of kBlockLanes (lanes 0-7 and 8-15 for AVX2), the same products added into the
// same lanes, and totalled in LaneSums::total()'s order: the same bits. (A vector of 16 floats, GCC keeps in memory
// there: the coordinates' gradient of layers with few channels a point ran several times slower so.)
template <int count, typename A, typename B>
inline void lane_dots_in_blocks(const A* a, const B* const* b, int64_t len, float* dot) {
  constexpr int kBlocks = kSumLanes / kBlockLanes;
  static_assert(kBlocks == 2 || kBlocks == 4, "blocks of 8 or 4 lanes");
  BlockLanes sums[count][kBlocks] = {};
  // Lanes [0, n) of 16 from p in kBlocks vectors, +0 in the others. (A block that is partly there is built apart,
  // by partial_block: with its element-by-element writes here, GCC kept every block of the loop in memory.)
  const auto load = [](const auto* p, int n, BlockLanes (&lanes)[kBlocks]) DC_AVX2_HELPER {
#pragma GCC unroll 4
    for (int k = 0; k < kBlocks; ++k) {
      const int first = k * kBlockLanes;
      if (first + kBlockLanes <= n) {
        load_block(p + first, lanes[k]);
      } else if (first >= n) {
        lanes[k] = BlockLanes{};
      } else {
        lanes[k] = partial_block(p + first, n - first);
      }
    }
  };
  for (int64_t d0 = 0; d0 < len; d0 += kSumLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kSumLanes, len - d0));
    BlockLanes lanes_a[kBlocks];
    load(a + d0, n, lanes_a);
#pragma GCC unroll 4
    for (int c = 0; c < count; ++c) {
      BlockLanes lanes_b[kBlocks];
      load(b[c] + d0, n, lanes_b);
      for (int k = 0; k < kBlocks; ++k) sums[c][k] += lanes_a[k] * lanes_b[k];
    }
  }
  for (int c = 0; c < count; ++c) dot[c] = total_of_blocks(sums[c]);
}
#endif

// dot[c] = sum over d < len of a[d] * b[c][d], for `count` vectors b[c], each summed in the lanes' order.
template <int count, typename acc_t, typename A, typename B>
inline void lane_dots(const A* a, const B* const* b, int64_t len, acc_t* dot) {
#if defined(__GNUC__) && (DC_CPU_VECTOR_BITS == 256 || DC_CPU_VECTOR_BITS == 128)
  if constexpr (std::is_same_v<acc_t, float>) {
    lane_dots_in_blocks<count>(a, b, len, dot);
    return;
  }
#endif
  LaneSums<acc_t> part[count];
#if defined(__GNUC__)
  if constexpr (std::is_same_v<acc_t, float>) {  // a's lanes loaded once for all count vectors
    for (int64_t d0 = 0; d0 < len; d0 += kSumLanes) {
      // The last channels go to the first lanes, +0 * +0 to the others (a sum that began at +0 stays as it was).
      const int n = static_cast<int>(std::min<int64_t>(kSumLanes, len - d0));
      const auto load = [n](const auto* p, FloatLanes& lanes) {
        if (n == kSumLanes) {
          load_lanes(p, lanes);
        } else {
          load_first_lanes(p, n, lanes);
        }
      };
      FloatLanes lanes_a;
      load(a + d0, lanes_a);
#pragma GCC unroll 4
      for (int c = 0; c < count; ++c) {
        FloatLanes lanes_b;
        load(b[c] + d0, lanes_b);
        part[c].lanes += lanes_a * lanes_b;
      }
    }
  } else
#endif
  {
    int64_t d0 = 0;
    for (; d0 + kSumLanes <= len; d0 += kSumLanes) {
#pragma GCC unroll 4
      for (int c = 0; c < count; ++c) part[c].add_products(a + d0, b[c] + d0);
    }
    if (d0 < len) {
#pragma GCC unroll 4
      for (int c = 0; c < count; ++c) part[c].add_products(a + d0, b[c] + d0, static_cast<int>(len - d0));
    }
  }
#if defined(__GNUC__)
  if constexpr (std::is_same_v<acc_t, float> && count == 4) {
    total_four(part[0].lanes, part[1].lanes, part[2].lanes, part[3].lanes, dot);
    return;
  }
#endif
#pragma GCC unroll 4
  for (int c = 0; c < count; ++c) dot[c] = part[c].total();
}

}  // namespace cpu
}  // namespace deform_conv
