// The family's shared CUDA kernels (sampled_sum.h; sampled_sum_cuda.cpp chooses how they are launched): the forward,
// the points' gradients (with value's gradient by atomics in the default mode), and value's gradient as a gather
// under torch.use_deterministic_algorithms(True). Device code only. The sampling math is sampling.h's, shared with
// the CPU kernels (cpu/sampled_sum_cpu.cpp); the layout and the launches follow multi-scale deformable attention's
// kernels (ms_deform_attn/cuda/attention_kernels.cuh).
//
// The points are in the accumulation type (opmath_type: float for float and the half types, double for double), as
// the ops' host code computes them; value, the output and grad_output are in value's dtype. Every kernel keeps a
// point in registers (BilinearPoint: a corner is a constant after unrolling, never an index into an array), so no
// kernel has a stack frame.
//
// The names below are this family's own: each op's kernels are a translation unit of their own in one library, so a
// template of the same name in namespace cuda (attention_kernels.cuh's Level, say) would break the one-definition
// rule.
#pragma once

#include "../../cuda/lanes.cuh"
#include "../../ms_deform_attn/attention_sizes.h"  // level_fits
#include "../../sampling.h"
#include "../sampled_sum_sizes.h"

namespace deform_conv {
namespace cuda {

// SampledSumSizes in the kernels' index type, with the point and level tables (device pointers).
template <typename index_t>
struct SampledSum {
  index_t batch, pixels, groups, channels, queries, points, levels;
  const int64_t* point_levels;       // [points]
  const int64_t* spatial_shapes;     // [levels, 2] (height, width)
  const int64_t* level_start_index;  // [levels]

  SampledSum(const SampledSumSizes& s, const int64_t* of_point, const int64_t* shapes, const int64_t* starts)
      : batch(s.batch), pixels(s.pixels), groups(s.groups), channels(s.channels), queries(s.queries),
        points(s.points), levels(s.levels), point_levels(of_point), spatial_shapes(shapes),
        level_start_index(starts) {}

  // = SampledSumSizes' indices.
  DC_HOST_DEVICE index_t point_index(index_t n, index_t q, index_t g, index_t k) const {
    return ((n * queries + q) * groups + g) * points + k;
  }
  DC_HOST_DEVICE index_t value_index(index_t n, index_t s, index_t g) const {
    return ((n * pixels + s) * groups + g) * channels;
  }
  DC_HOST_DEVICE index_t output_index(index_t n, index_t q, index_t g) const {
    return ((n * queries + q) * groups + g) * channels;
  }
  DC_HOST_DEVICE index_t points_per_image() const { return queries * groups * points; }
};

// A point's level as the kernels read it. The host never reads the tables on the GPU (it would synchronise), so
// each kernel checks a point's level before it reads it: a level that does not fit in value (level_fits), or a
// point level that names no level, reads nothing and samples NaN.
template <typename index_t>
struct SumLevel {
  index_t height = 1, width = 1, start = 0;
  bool fits = false;
};

template <typename index_t>
DC_DEVICE SumLevel<index_t> read_point_level(const SampledSum<index_t>& s, index_t k) {
  SumLevel<index_t> level;
  const int64_t l = s.point_levels[k];
  if (l < 0 || l >= static_cast<int64_t>(s.levels)) return level;
  const int64_t height = s.spatial_shapes[2 * l], width = s.spatial_shapes[2 * l + 1];
  const int64_t start = s.level_start_index[l];
  if (level_fits(start, height, width, s.pixels)) {
    level.height = static_cast<index_t>(height);
    level.width = static_cast<index_t>(width);
    level.start = static_cast<index_t>(start);
    level.fits = true;
  }
  return level;
}

// One point (x, y, weight): its neighbours and bilinear weights in its level, and its weight.
template <typename acc_t, typename index_t>
struct SumPoint {
  BilinearPoint<acc_t, index_t> b;
  acc_t weight;

  DC_DEVICE SumPoint(const acc_t* points, index_t point, const SumLevel<index_t>& level)
      : weight(points[3 * point + 2]) {
    if (!level.fits) {
      b.nan = true;
      return;
    }
    b = bilinear_point(points[3 * point + 1], points[3 * point], level.height, level.width);
  }
};

// An item (image, query, group) of the forward and backward launches: item = (n * queries + q) * groups + g.
template <typename index_t>
struct SumItem {
  index_t n, q, g;
  DC_DEVICE SumItem(const SampledSum<index_t>& s, index_t item) {
    g = item % s.groups;
    const index_t row = item / s.groups;
    q = row % s.queries;
    n = row / s.queries;
  }
};

// A point's image, query, group and number, decoded from its flat index (point_index).
template <typename index_t>
struct SumPointAt {
  index_t n, q, g, k;
  DC_DEVICE SumPointAt(const SampledSum<index_t>& s, index_t point) {
    k = point % s.points;
    index_t rest = point / s.points;
    g = rest % s.groups;
    rest /= s.groups;
    q = rest % s.queries;
    n = rest / s.queries;
  }
};

// One lane group an item; its lanes stride over the group's channels, each summing its channels' weighted samples
// over the points. Each output element is written once. A point's sample is formed before its weight multiplies
// it, so that an infinite weight times a sample of 0 is NaN (as on the CPU).
template <typename scalar_t, typename index_t>
DC_KERNEL void sampled_sum_forward_kernel(SampledSum<index_t> s, Split split, const scalar_t* __restrict__ value,
                                          const opmath_type<scalar_t>* __restrict__ points,
                                          scalar_t* __restrict__ output) {
  using acc_t = opmath_type<scalar_t>;
  const LaneGroup<index_t> lanes(split);
  const index_t items = s.batch * s.queries * s.groups, pixel_stride = s.groups * s.channels;
  for (index_t item = lanes.item; item < items; item += lanes.step) {
    const SumItem<index_t> at(s, item);
    const index_t first_point = s.point_index(at.n, at.q, at.g, 0);
    for (index_t d = lanes.lane; d < s.channels; d += lanes.lanes) {
      acc_t sum = 0;
      for (index_t k = 0; k < s.points; ++k) {
        const SumLevel<index_t> level = read_point_level(s, k);
        const SumPoint<acc_t, index_t> p(points, first_point + k, level);
        const index_t image = s.value_index(at.n, level.start, at.g) + d;
        acc_t sample = sum_start<acc_t>(p.b.nan);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (p.b.valid(c)) {
            sample += p.b.weight(c) * static_cast<acc_t>(value[image + p.b.pixel(c, level.width) * pixel_stride]);
          }
        }
        sum += p.weight * sample;
      }
      output[s.output_index(at.n, at.q, at.g) + d] = static_cast<scalar_t>(sum);
    }
  }
}

// The points' gradients (d x, d y, d weight): an item's lanes sum over its channels, then a fixed-order butterfly
// over the lanes (deterministic). The loops run the same number of times in every lane of a warp (items past the
// end take part with zeros), as a full-warp shuffle requires. The coordinates' derivatives follow `border`
// (sampling.h's coordinate_grad). With `grad_value` (the default mode) the lanes also add weight * bilinear weight
// * grad_output into value's gradient by atomics, whose order is not fixed; with nullptr (deterministic mode) the
// kernels below gather value's gradient instead. Each element of grad_points is written once.
template <typename scalar_t, typename index_t>
DC_KERNEL void sampled_sum_backward_kernel(SampledSum<index_t> s, Split split, BorderGradient border,
                                           const scalar_t* __restrict__ value,
                                           const opmath_type<scalar_t>* __restrict__ points,
                                           const scalar_t* __restrict__ grad_output,
                                           opmath_type<scalar_t>* __restrict__ grad_value,
                                           opmath_type<scalar_t>* __restrict__ grad_points) {
  using acc_t = opmath_type<scalar_t>;
  const index_t thread = blockIdx.x * index_t(blockDim.x) + threadIdx.x;
  const index_t lanes = index_t(1) << split.lanes_log2, lane = thread & (lanes - 1);
  const index_t per_warp = kWarp >> split.lanes_log2;  // items a warp takes at once
  const index_t warp_step = ((index_t(blockDim.x) * gridDim.x) / kWarp) * per_warp;
  const index_t items = s.batch * s.queries * s.groups, pixel_stride = s.groups * s.channels;
  for (index_t base = (thread / kWarp) * per_warp; base < items; base += warp_step) {
    const index_t item = base + (thread % kWarp) / lanes;
    const bool active = item < items;
    const SumItem<index_t> at(s, active ? item : items - 1);  // a lane past the end decodes the last item, adds nothing
    const index_t grad = s.output_index(at.n, at.q, at.g);
    const index_t first_point = s.point_index(at.n, at.q, at.g, 0);
    for (index_t k = 0; k < s.points; ++k) {
      const SumLevel<index_t> level = read_point_level(s, k);
      const index_t point = first_point + k;
      const SumPoint<acc_t, index_t> p(points, point, level);
      const index_t image = s.value_index(at.n, level.start, at.g);
      acc_t grad_weight = 0, grad_x = 0, grad_y = 0;
      if (active) {
        grad_weight = grad_x = grad_y = sum_start<acc_t>(p.b.nan);
        for (index_t d = lane; d < s.channels; d += lanes) {
          const acc_t g = static_cast<acc_t>(grad_output[grad + d]);
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            if (!p.b.valid(c)) continue;
            const index_t element = image + p.b.pixel(c, level.width) * pixel_stride + d;
            const acc_t dot = g * static_cast<acc_t>(value[element]);
            grad_weight += p.b.weight(c) * dot;
            grad_x += p.b.weight_dx(c) * dot;
            grad_y += p.b.weight_dy(c) * dot;
            if (grad_value != nullptr) atomic_add(grad_value + element, p.weight * p.b.weight(c) * g);
          }
        }
      }
      for (int delta = static_cast<int>(lanes) / 2; delta > 0; delta /= 2) {
        grad_weight += warp_xor(grad_weight, delta);
        grad_x += warp_xor(grad_x, delta);
        grad_y += warp_xor(grad_y, delta);
      }
      if (active && lane == 0) {
        grad_points[3 * point] = coordinate_grad(p.b, p.weight, grad_x, border);
        grad_points[3 * point + 1] = coordinate_grad(p.b, p.weight, grad_y, border);
        grad_points[3 * point + 2] = grad_weight;
      }
    }
  }
}

// Value's gradient under torch.use_deterministic_algorithms(True), as a gather: every (point, corner) pair of the
// images [first, first + images) is an entry keyed by the value pixel it reads, ((n - first) * groups + g) * pixels
// + pixel, or by `keys` (past every real key) when the corner lies outside its level (or the level does not fit). A
// stable sort of the keys lists each pixel's entries in entry order; one lane group a pixel then sums its entries in
// that order and writes the sum once. No atomics, so the bits are the same in every run, whatever order the blocks
// run in.
template <typename scalar_t, typename index_t>
DC_KERNEL void sampled_sum_entry_keys_kernel(SampledSum<index_t> s, const opmath_type<scalar_t>* __restrict__ points,
                                             index_t first, index_t count, index_t keys,
                                             int64_t* __restrict__ entry_keys) {
  using acc_t = opmath_type<scalar_t>;
  const index_t step = index_t(blockDim.x) * gridDim.x;
  const index_t first_point = first * s.points_per_image();
  for (index_t local = blockIdx.x * index_t(blockDim.x) + threadIdx.x; local < count; local += step) {
    const SumPointAt<index_t> at(s, first_point + local);
    const SumLevel<index_t> level = read_point_level(s, at.k);
    const SumPoint<acc_t, index_t> p(points, first_point + local, level);
    const index_t pixels_before = ((at.n - first) * s.groups + at.g) * s.pixels + level.start;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      entry_keys[4 * local + c] = p.b.valid(c) ? pixels_before + p.b.pixel(c, level.width) : keys;
    }
  }
}

// Each key's lane group owns all of its channels, so its adds, in entry order, need no atomics.
template <typename scalar_t, typename index_t>
DC_KERNEL void sampled_sum_value_grad_gather_kernel(SampledSum<index_t> s, Split split,
                                                    const opmath_type<scalar_t>* __restrict__ points,
                                                    const scalar_t* __restrict__ grad_output,
                                                    const int64_t* __restrict__ sorted_entries,
                                                    const int64_t* __restrict__ key_starts, index_t first,
                                                    index_t keys, opmath_type<scalar_t>* __restrict__ grad_value) {
  using acc_t = opmath_type<scalar_t>;
  const LaneGroup<index_t> lanes(split);
  const index_t first_point = first * s.points_per_image();
  for (index_t key = lanes.item; key < keys; key += lanes.step) {
    const index_t begin = static_cast<index_t>(key_starts[key]), end = static_cast<index_t>(key_starts[key + 1]);
    if (begin == end) continue;  // no point reads this pixel: its gradient stays 0
    const index_t pixel = key % s.pixels, rest = key / s.pixels;
    const index_t g = rest % s.groups, n = first + rest / s.groups;
    const index_t target = s.value_index(n, pixel, g);
    for (index_t e = begin; e < end; ++e) {
      const index_t entry = static_cast<index_t>(sorted_entries[e]);
      const index_t point = first_point + entry / 4;
      const SumPointAt<index_t> at(s, point);
      const SumPoint<acc_t, index_t> p(points, point, read_point_level(s, at.k));
      const acc_t c = p.weight * p.b.weight(static_cast<int>(entry % 4));  // once an entry, for all its channels
      const index_t grad = s.output_index(at.n, at.q, at.g);
      for (index_t d = lanes.lane; d < s.channels; d += lanes.lanes) {
        grad_value[target + d] += c * static_cast<acc_t>(grad_output[grad + d]);
      }
    }
  }
}

}  // namespace cuda
}  // namespace deform_conv
