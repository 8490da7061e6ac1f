// The forward: the weighted sum of each output row's samples. Part of the family's CPU kernels: included by
// sampled_sum_cpu.cpp only (internal linkage), compiled in one unit with multi-scale deformable attention's CPU
// entry points, so its names differ from those.
#pragma once

#include <ATen/OpMathType.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../cpu_kernels.h"
#include "../../cpu_lanes.h"
#include "levels.h"

namespace deform_conv {
namespace cpu {
namespace {

// About this many sampling points (times D channels) a task: enough to outweigh a task's cost.
constexpr int64_t kSumPointsPerTask = 2048;

// The forward's per-row scratch, over the row's G * K points: the points, and for each point whose four
// neighbours lie in its level and whose weight is finite (an interior point), its top-left neighbour and the
// weight times each neighbour's bilinear weight. Computed for all the row's points at once, in loops the compiler
// vectorises across points: a point's own arithmetic, not its D channels, is most of the forward's work when D is
// small (16 in every InternImage layer).
template <typename acc_t>
struct RowScratch {
  std::vector<acc_t> sum, sample, x, y, weight, c0, c1, c2, c3;
  std::vector<int32_t> interior;
  std::vector<int64_t> top_left;  // an interior point's top-left neighbour: its element of value (of the image)
  RowScratch(int64_t channels, int64_t row_points)
      : sum(channels), sample(channels), x(row_points), y(row_points), weight(row_points), c0(row_points),
        c1(row_points), c2(row_points), c3(row_points), interior(row_points),
        top_left(row_points) {}
};

// An interior point's sample of one channel, its weight folded into the neighbours' coefficients c0-c3: the one
// expression, in the one order, that every interior path below sums (so that they give the same bits).
template <typename scalar_t, typename acc_t>
inline acc_t interior_sample(acc_t c0, acc_t c1, acc_t c2, acc_t c3, scalar_t v0, scalar_t v1, scalar_t v2,
                             scalar_t v3) {
  return c0 * static_cast<acc_t>(v0) + c1 * static_cast<acc_t>(v1) + c2 * static_cast<acc_t>(v2) +
         c3 * static_cast<acc_t>(v3);
}

// Channels summed at once in sum_interior_group: one AVX-512 register of float32 (two of AVX2).
constexpr int64_t kChannelBlock = 16;

// kChannelBlock channels of sum_interior_group: for each, the K points' interior_sample added in order from 0, and
// written once, rounded. In float (the accumulation type of float, float16 and bfloat16) the block is one vector
// of cpu_lanes.h (or its parts: BlockLanes), the neighbours widened and the sums rounded there in registers (c10's
// float16 conversion, one value at a time, kept the plain loop scalar): interior_sample's operations in its order,
// so the same bits.
template <typename scalar_t, typename acc_t>
inline void sum_interior_block(const acc_t* __restrict__ c0, const acc_t* __restrict__ c1, const acc_t* __restrict__ c2,
                               const acc_t* __restrict__ c3, const int64_t* __restrict__ top_left,
                               const int64_t* __restrict__ down, int64_t count, const scalar_t* image,
                               int64_t pixel_stride, scalar_t* out) {
#if defined(__GNUC__)
  if constexpr (std::is_same_v<acc_t, float>) {
    static_assert(kChannelBlock % kBlockLanes == 0, "a block is whole vectors of lanes");
    // One vector, or (where the library's vectors hold fewer than 16 floats: kBlockLanes) its parts one after
    // another: GCC keeps a vector wider than the registers in memory.
    for (int64_t s = 0; s < kChannelBlock; s += kBlockLanes) {
      BlockLanes block = {};
      for (int64_t k = 0; k < count; ++k) {
        const scalar_t* v0 = image + top_left[k] + s;
        const scalar_t* v2 = v0 + down[k];
        BlockLanes n0, n1, n2, n3;
        load_block(v0, n0);
        load_block(v0 + pixel_stride, n1);
        load_block(v2, n2);
        load_block(v2 + pixel_stride, n3);
        block += c0[k] * n0 + c1[k] * n1 + c2[k] * n2 + c3[k] * n3;
      }
      store_block(block, out + s);
    }
    return;
  }
#endif
  acc_t block[kChannelBlock] = {};
  for (int64_t k = 0; k < count; ++k) {
    const scalar_t* __restrict__ v0 = image + top_left[k];
    const scalar_t* __restrict__ v1 = v0 + pixel_stride;
    const scalar_t* __restrict__ v2 = v0 + down[k];
    const scalar_t* __restrict__ v3 = v2 + pixel_stride;
#pragma omp simd
    for (int64_t j = 0; j < kChannelBlock; ++j) {
      block[j] += interior_sample(c0[k], c1[k], c2[k], c3[k], v0[j], v1[j], v2[j], v3[j]);
    }
  }
  for (int64_t j = 0; j < kChannelBlock; ++j) out[j] = static_cast<scalar_t>(block[j]);
}

// The sums of a group whose K points are all interior: for each block of channels, the K points' contributions
// added in registers, in the order of the points (the same additions, in the same order, as the point-by-point
// loop of sum_rows_body: the same bits), and written once. Most groups of most rows are such; the point-by-point
// loop stores and reloads the sums at every point.
template <typename scalar_t, typename acc_t>
inline void sum_interior_group(const RowScratch<acc_t>& r, int64_t first, int64_t count, const int64_t* row_step,
                               const scalar_t* image, int64_t pixel_stride, int64_t channels, scalar_t* out) {
  const acc_t *__restrict__ c0 = r.c0.data() + first, *__restrict__ c1 = r.c1.data() + first,
              *__restrict__ c2 = r.c2.data() + first, *__restrict__ c3 = r.c3.data() + first;
  const int64_t *__restrict__ top_left = r.top_left.data() + first, *__restrict__ down = row_step + first;
  int64_t d0 = 0;
  for (; d0 + kChannelBlock <= channels; d0 += kChannelBlock) {
    sum_interior_block(c0, c1, c2, c3, top_left, down, count, image + d0, pixel_stride, out + d0);
  }
  for (int64_t d = d0; d < channels; ++d) {  // the channels after the last whole block
    acc_t sum = 0;
    for (int64_t k = 0; k < count; ++k) {
      const scalar_t* v0 = image + top_left[k];
      const scalar_t* v2 = v0 + down[k];
      sum += interior_sample(c0[k], c1[k], c2[k], c3[k], v0[d], v0[d + pixel_stride], v2[d], v2[d + pixel_stride]);
    }
    out[d] = static_cast<scalar_t>(sum);
  }
}

// For every point of the row (read into r.x, r.y, r.weight): whether it is interior, and if so its neighbours'
// coefficients, computed as bilinear_point's weights times the point's weight: the same operations, the same bits,
// and its top-left neighbour's element of value (of the image: InteriorLimits' first and row_step).
template <typename acc_t>
void prepare_row(int64_t row_points, const InteriorLimits<acc_t>& limits, int64_t pixel_stride,
                 RowScratch<acc_t>& r) {
  const acc_t *__restrict__ limit_x = limits.x.data(), *__restrict__ limit_y = limits.y.data();
  const int64_t *__restrict__ first = limits.first.data(), *__restrict__ row_step = limits.row_step.data();
  int64_t* __restrict__ top_left = r.top_left.data();
  const acc_t *__restrict__ xs = r.x.data(), *__restrict__ ys = r.y.data(), *__restrict__ ws = r.weight.data();
  acc_t *__restrict__ c0 = r.c0.data(), *__restrict__ c1 = r.c1.data(), *__restrict__ c2 = r.c2.data(),
        *__restrict__ c3 = r.c3.data();
  int32_t* __restrict__ interior = r.interior.data();
#pragma omp simd
  for (int64_t i = 0; i < row_points; ++i) {
    const acc_t x = xs[i], y = ys[i], w = ws[i];
    // False for NaN; floor(y) >= 0 and floor(y) + 1 < height, i.e. 0 <= y < height - 1, and likewise x.
    const bool inside = (y >= acc_t(0)) & (y < limit_y[i]) & (x >= acc_t(0)) & (x < limit_x[i]) &
                        (std::abs(w) <= std::numeric_limits<acc_t>::max());
    // An interior point's coordinates are >= 0 and below 2^24: truncation is its floor, exactly.
    const int32_t top = static_cast<int32_t>(inside ? y : acc_t(0)), left = static_cast<int32_t>(inside ? x : acc_t(0));
    const acc_t ly = y - static_cast<acc_t>(top), lx = x - static_cast<acc_t>(left);
    const acc_t hy = acc_t(1) - ly, hx = acc_t(1) - lx;
    c0[i] = w * (hy * hx);
    c1[i] = w * (hy * lx);
    c2[i] = w * (ly * hx);
    c3[i] = w * (ly * lx);
    interior[i] = inside;
    top_left[i] = first[i] + static_cast<int64_t>(top) * row_step[i] + static_cast<int64_t>(left) * pixel_stride;
  }
}

// Output rows (image, query) [begin, end).
template <typename scalar_t, typename Points>
void sum_rows_body(const SampledSumSizes& s, const SampledLevel* levels, const int64_t* level_of_point,
                   const InteriorLimits<at::opmath_type<scalar_t>>* interior, const scalar_t* value, Points points,
                   scalar_t* output, int64_t begin, int64_t end, RowScratch<at::opmath_type<scalar_t>>* scratch) {
  using acc_t = at::opmath_type<scalar_t>;
  RowScratch<acc_t>& r = *scratch;
  const InteriorLimits<acc_t>& limits = *interior;
  acc_t* __restrict__ sum = r.sum.data();
  acc_t* __restrict__ sample = r.sample.data();
  const int64_t channels = s.channels, pixel_stride = s.groups * s.channels;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t n = row / s.queries, q = row % s.queries;
    const scalar_t* image_n = value + s.value_index(n, 0, 0);
    points.read_row(row, r.x.data(), r.y.data(), r.weight.data());
    prepare_row(s.groups * s.points, limits, pixel_stride, r);
    for (int64_t g = 0; g < s.groups; ++g) {
      const int64_t first = g * s.points;
      int32_t all_interior = 1;
      for (int64_t k = 0; k < s.points; ++k) all_interior &= r.interior[first + k];
      if (all_interior) {
        sum_interior_group(r, first, s.points, limits.row_step.data(), image_n, pixel_stride, channels,
                           output + s.output_index(n, q, g));
        continue;
      }
      for (int64_t d = 0; d < channels; ++d) sum[d] = 0;
      for (int64_t k = 0; k < s.points; ++k) {
        const int64_t i = g * s.points + k;
        if (r.interior[i]) {
          // All four neighbours in the level, a finite weight: one pass, the weight folded into the bilinear
          // weights. (Elsewhere the sample is formed first, so that an infinite weight times a sample of 0 is NaN.)
          const scalar_t* __restrict__ v0 = image_n + r.top_left[i];
          const scalar_t* __restrict__ v1 = v0 + pixel_stride;
          const scalar_t* __restrict__ v2 = v0 + limits.row_step[i];
          const scalar_t* __restrict__ v3 = v2 + pixel_stride;
          const acc_t c0 = r.c0[i], c1 = r.c1[i], c2 = r.c2[i], c3 = r.c3[i];
          // sum is the task's scratch, never one of the value's pixels: no need to check that they overlap.
#pragma omp simd
          for (int64_t d = 0; d < channels; ++d) {
            sum[d] += interior_sample(c0, c1, c2, c3, v0[d], v1[d], v2[d], v3[d]);
          }
          continue;
        }
        const SampledLevel& level = levels[level_of_point[k]];
        const scalar_t* image = value + s.value_index(n, level.fits ? level.start : 0, g);
        const BilinearSample<acc_t> b = sample_of(r.x[i], r.y[i], level);
        const acc_t w = r.weight[i];
        if (b.count == 4 && std::isfinite(w)) {  // interior, in a level too large for the prepared path
          const acc_t c[4] = {w * b.weight[0], w * b.weight[1], w * b.weight[2], w * b.weight[3]};
          const scalar_t* __restrict__ v0 = image + b.pixel[0] * pixel_stride;
          const scalar_t* __restrict__ v1 = image + b.pixel[1] * pixel_stride;
          const scalar_t* __restrict__ v2 = image + b.pixel[2] * pixel_stride;
          const scalar_t* __restrict__ v3 = image + b.pixel[3] * pixel_stride;
          for (int64_t d = 0; d < channels; ++d) {
            sum[d] += c[0] * static_cast<acc_t>(v0[d]) + c[1] * static_cast<acc_t>(v1[d]) +
                      c[2] * static_cast<acc_t>(v2[d]) + c[3] * static_cast<acc_t>(v3[d]);
          }
          continue;
        }
        // Per channel: the sample from start and the neighbours in order, then times the weight, as a loop over
        // channels for each neighbour.
        const acc_t start = sum_start(b);
        for (int64_t d = 0; d < channels; ++d) sample[d] = start;
        for (int c = 0; c < b.count; ++c) {
          const scalar_t* __restrict__ v = image + b.pixel[c] * pixel_stride;
          const acc_t weight = b.weight[c];
#pragma omp simd
          for (int64_t d = 0; d < channels; ++d) sample[d] += weight * static_cast<acc_t>(v[d]);
        }
#pragma omp simd
        for (int64_t d = 0; d < channels; ++d) sum[d] += w * sample[d];
      }
      scalar_t* out = output + s.output_index(n, q, g);
      for (int64_t d = 0; d < channels; ++d) out[d] = static_cast<scalar_t>(sum[d]);
    }
  }
}
DC_CPU_KERNEL(sum_rows)

}  // namespace
}  // namespace cpu
}  // namespace deform_conv
