// Sums over channels in 16 fixed lanes, for the CPU kernels' dot products: channel d goes to lane d % 16, and the
// lanes are then added pairwise (lane j + lane j + 8, then j + j + 4, j + j + 2, 0 + 1). The order is fixed here,
// not by the vector width the compiler picks: the same bits for any thread count and on any instruction set
// (AVX-512, AVX2, baseline x86-64, or another architecture).
//
// In float (the accumulation type of float, float16 and bfloat16) the lanes are one GCC/Clang vector, kept in
// registers, and the pairwise sums add its halves. What this replaces, an omp simd reduction per dot product,
// compiles to a sum through memory, lane by lane, that stalls on the vector store it has just made: in the family's
// backward that cost as much as all its other work. Other types (float64: exact checks, gradcheck), and compilers
// without vector extensions, take the same order lane by lane (LaneSums).
#pragma once

#include <cstdint>
#include <cstring>

namespace deform_conv {
namespace cpu {

constexpr int kSumLanes = 16;

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

// 16 elements from p, widened to float. (Vectors go by reference: passed by value they would change the calling
// convention between the instruction sets a portable library is compiled for.)
template <typename scalar_t>
inline void load_lanes(const scalar_t* p, FloatLanes& lanes) {
  float wide[kSumLanes];
  for (int j = 0; j < kSumLanes; ++j) wide[j] = static_cast<float>(p[j]);
  std::memcpy(&lanes, wide, sizeof(lanes));
}

inline void store_lanes(const FloatLanes& lanes, float* p) { std::memcpy(p, &lanes, sizeof(lanes)); }

// The 16 partial sums in one vector.
template <>
struct LaneSums<float> {
  FloatLanes lanes = {};

  template <typename A, typename B>
  void add_products(const A* a, const B* b) {
    FloatLanes va, vb;
    load_lanes(a, va);
    load_lanes(b, vb);
    lanes += va * vb;
  }
  // The lanes from count on add 0 * 0 (+0, which leaves a sum that began at +0 as it was).
  template <typename A, typename B>
  void add_products(const A* a, const B* b, int count) {
    float wa[kSumLanes] = {}, wb[kSumLanes] = {};
    for (int j = 0; j < count; ++j) wa[j] = static_cast<float>(a[j]), wb[j] = static_cast<float>(b[j]);
    add_products(wa, wb);
  }
  float total() const {
    FloatHalfLanes low, high;
    std::memcpy(&low, &lanes, sizeof(low));
    std::memcpy(&high, reinterpret_cast<const char*>(&lanes) + sizeof(low), sizeof(high));
    const FloatHalfLanes half = low + high;
    FloatQuarterLanes low4, high4;
    std::memcpy(&low4, &half, sizeof(low4));
    std::memcpy(&high4, reinterpret_cast<const char*>(&half) + sizeof(low4), sizeof(high4));
    const FloatQuarterLanes quarter = low4 + high4;
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
  }
};
#endif

}  // namespace cpu
}  // namespace deform_conv
