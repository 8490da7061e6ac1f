// Multi-scale deformable attention's CUDA kernels (ms_deform_attn_cuda.cpp chooses how they are launched): the
// forward, the location and weight gradients (with value's gradient by atomics in the default mode), and value's
// gradient as a gather under torch.use_deterministic_algorithms(True). Device code only. The sampling math is
// sampling.h's, shared with the CPU kernels.
#pragma once

#include "../../cuda/lanes.cuh"
#include "../../sampling.h"
#include "../attention_sizes.h"

namespace deform_conv {
namespace cuda {

// AttentionParams' sizes in the kernels' index type, with the levels' sizes and starts (device pointers).
template <typename index_t>
struct Attention {
  index_t batch, pixels, heads, channels, queries, levels, points;
  const int64_t* spatial_shapes;     // [levels, 2] (height, width)
  const int64_t* level_start_index;  // [levels]

  Attention(const AttentionParams& p, const int64_t* shapes, const int64_t* starts)
      : batch(p.batch), pixels(p.pixels), heads(p.heads), channels(p.channels), queries(p.queries),
        levels(p.levels), points(p.points), spatial_shapes(shapes), level_start_index(starts) {}

  // = AttentionParams' indices.
  DC_HOST_DEVICE index_t point_index(index_t n, index_t q, index_t m, index_t l, index_t p) const {
    return (((n * queries + q) * heads + m) * levels + l) * points + p;
  }
  DC_HOST_DEVICE index_t value_index(index_t n, index_t s, index_t m) const {
    return ((n * pixels + s) * heads + m) * channels;
  }
  DC_HOST_DEVICE index_t output_index(index_t n, index_t q, index_t m) const {
    return ((n * queries + q) * heads + m) * channels;
  }
  DC_HOST_DEVICE index_t points_per_image() const { return queries * heads * levels * points; }
};

// One level as the kernels read it. The host never reads spatial_shapes on the GPU (it would synchronise), so
// each kernel checks the level before it reads it: one that does not fit in value (level_fits) reads nothing and
// samples NaN.
template <typename index_t>
struct Level {
  index_t height = 1, width = 1, start = 0;
  bool fits = false;
};

template <typename index_t>
DC_DEVICE Level<index_t> read_level(const Attention<index_t>& a, index_t l) {
  const int64_t height = a.spatial_shapes[2 * l], width = a.spatial_shapes[2 * l + 1];
  const int64_t start = a.level_start_index[l];
  Level<index_t> level;
  if (level_fits(start, height, width, a.pixels)) {
    level.height = static_cast<index_t>(height);
    level.width = static_cast<index_t>(width);
    level.start = static_cast<index_t>(start);
    level.fits = true;
  }
  return level;
}

// One sampling point: its location's neighbours and bilinear weights in its level, and its attention weight.
template <typename acc_t, typename index_t>
struct AttentionPoint {
  BilinearPoint<acc_t, index_t> b;
  acc_t weight;

  template <typename scalar_t>
  DC_DEVICE AttentionPoint(const scalar_t* locations, const scalar_t* weights, index_t point,
                           const Level<index_t>& level)
      : weight(static_cast<acc_t>(weights[point])) {
    if (!level.fits) {
      b.nan = true;
      return;
    }
    const acc_t x = half_pixel_coordinate(static_cast<acc_t>(locations[2 * point]), level.width);
    const acc_t y = half_pixel_coordinate(static_cast<acc_t>(locations[2 * point + 1]), level.height);
    b = bilinear_point(y, x, level.height, level.width);
  }
};

// An item (image, query, head) of the forward and backward launches: item = (n * queries + q) * heads + m.
template <typename index_t>
struct Item {
  index_t n, q, m;
  DC_DEVICE Item(const Attention<index_t>& a, index_t item) {
    m = item % a.heads;
    const index_t row = item / a.heads;
    q = row % a.queries;
    n = row / a.queries;
  }
};

// A point's image, query, head and level, decoded from its flat index (point_index).
template <typename index_t>
struct PointAt {
  index_t n, q, m, l;
  DC_DEVICE PointAt(const Attention<index_t>& a, index_t point) {
    index_t rest = point / a.points;
    l = rest % a.levels;
    rest /= a.levels;
    m = rest % a.heads;
    rest /= a.heads;
    q = rest % a.queries;
    n = rest / a.queries;
  }
};

// One lane group an item; its lanes stride over the head's channels, each summing its channels' samples over
// levels and points. Each output element is written once.
template <typename scalar_t, typename index_t>
DC_KERNEL void attention_forward_kernel(Attention<index_t> a, Split split, const scalar_t* __restrict__ value,
                                        const scalar_t* __restrict__ locations,
                                        const scalar_t* __restrict__ weights, scalar_t* __restrict__ output) {
  using acc_t = opmath_type<scalar_t>;
  const LaneGroup<index_t> lanes(split);
  const index_t items = a.batch * a.queries * a.heads, pixel_stride = a.heads * a.channels;
  for (index_t item = lanes.item; item < items; item += lanes.step) {
    const Item<index_t> at(a, item);
    for (index_t d = lanes.lane; d < a.channels; d += lanes.lanes) {
      acc_t sum = 0;
      for (index_t l = 0; l < a.levels; ++l) {
        const Level<index_t> level = read_level(a, l);
        const scalar_t* image = value + a.value_index(at.n, level.start, at.m) + d;
        for (index_t pt = 0; pt < a.points; ++pt) {
          const AttentionPoint<acc_t, index_t> s(locations, weights, a.point_index(at.n, at.q, at.m, l, pt), level);
          acc_t sample = sum_start<acc_t>(s.b.nan);
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            if (s.b.valid(c)) {
              sample += s.b.weight(c) * static_cast<acc_t>(image[s.b.pixel(c, level.width) * pixel_stride]);
            }
          }
          sum += s.weight * sample;
        }
      }
      output[a.output_index(at.n, at.q, at.m) + d] = static_cast<scalar_t>(sum);
    }
  }
}

// d loss / d attention weight and d location of every point: an item's lanes sum over its channels, then a
// fixed-order butterfly over the lanes (deterministic). The loops run the same number of times in every lane of a
// warp (items past the end take part with zeros), as a full-warp shuffle requires. With `grad_value` (the default
// mode) the lanes also add weight * bilinear weight * grad_output into value's gradient by atomics, whose order
// is not fixed; with nullptr (deterministic mode) the kernels below gather value's gradient instead.
template <typename scalar_t, typename index_t>
DC_KERNEL void attention_backward_kernel(Attention<index_t> a, Split split, const scalar_t* __restrict__ value,
                                         const scalar_t* __restrict__ locations,
                                         const scalar_t* __restrict__ weights,
                                         const scalar_t* __restrict__ grad_output,
                                         opmath_type<scalar_t>* __restrict__ grad_value,
                                         scalar_t* __restrict__ grad_locations, scalar_t* __restrict__ grad_weights) {
  using acc_t = opmath_type<scalar_t>;
  const index_t thread = blockIdx.x * index_t(blockDim.x) + threadIdx.x;
  const index_t lanes = index_t(1) << split.lanes_log2, lane = thread & (lanes - 1);
  const index_t per_warp = kWarp >> split.lanes_log2;  // items a warp takes at once
  const index_t warp_step = ((index_t(blockDim.x) * gridDim.x) / kWarp) * per_warp;
  const index_t items = a.batch * a.queries * a.heads, pixel_stride = a.heads * a.channels;
  for (index_t base = (thread / kWarp) * per_warp; base < items; base += warp_step) {
    const index_t item = base + (thread % kWarp) / lanes;
    const bool active = item < items;
    const Item<index_t> at(a, active ? item : items - 1);  // a lane past the end decodes the last item, adds nothing
    const scalar_t* grad = grad_output + a.output_index(at.n, at.q, at.m);
    for (index_t l = 0; l < a.levels; ++l) {
      const Level<index_t> level = read_level(a, l);
      const index_t image = a.value_index(at.n, level.start, at.m);
      for (index_t pt = 0; pt < a.points; ++pt) {
        const index_t point = a.point_index(at.n, at.q, at.m, l, pt);
        const AttentionPoint<acc_t, index_t> s(locations, weights, point, level);
        acc_t grad_weight = 0, grad_x = 0, grad_y = 0;
        if (active) {
          grad_weight = grad_x = grad_y = sum_start<acc_t>(s.b.nan);
          for (index_t d = lane; d < a.channels; d += lanes) {
            const acc_t g = static_cast<acc_t>(grad[d]);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              if (!s.b.valid(c)) continue;
              const index_t element = image + s.b.pixel(c, level.width) * pixel_stride + d;
              const acc_t dot = g * static_cast<acc_t>(value[element]);
              grad_weight += s.b.weight(c) * dot;
              grad_x += s.b.weight_dx(c) * dot;
              grad_y += s.b.weight_dy(c) * dot;
              if (grad_value != nullptr) atomic_add(grad_value + element, s.weight * s.b.weight(c) * g);
            }
          }
        }
        for (int delta = static_cast<int>(lanes) / 2; delta > 0; delta /= 2) {
          grad_weight += warp_xor(grad_weight, delta);
          grad_x += warp_xor(grad_x, delta);
          grad_y += warp_xor(grad_y, delta);
        }
        if (active && lane == 0) {
          grad_weights[point] = static_cast<scalar_t>(grad_weight);
          // The pixel coordinate is location * size - 0.5: its derivative is size.
          grad_locations[2 * point] = static_cast<scalar_t>(
              static_cast<acc_t>(level.width) * coordinate_grad(s.b, s.weight, grad_x, BorderGradient::torchvision));
          grad_locations[2 * point + 1] = static_cast<scalar_t>(
              static_cast<acc_t>(level.height) * coordinate_grad(s.b, s.weight, grad_y, BorderGradient::torchvision));
        }
      }
    }
  }
}

// Value's gradient under torch.use_deterministic_algorithms(True), as a gather: every (point, corner) pair of the
// images [first, first + images) is an entry keyed by the value pixel it reads, ((n - first) * heads + m) * pixels
// + pixel, or by `keys` (past every real key) when the corner lies outside its level. A stable sort of the keys
// lists each pixel's entries in entry order; one lane group a pixel then sums its entries in that order and writes
// the sum once. No atomics, so the bits are the same in every run, whatever order the blocks run in.
template <typename scalar_t, typename index_t>
DC_KERNEL void attention_entry_keys_kernel(Attention<index_t> a, const scalar_t* __restrict__ locations,
                                           const scalar_t* __restrict__ weights, index_t first, index_t points,
                                           index_t keys, int64_t* __restrict__ entry_keys) {
  using acc_t = opmath_type<scalar_t>;
  const index_t step = index_t(blockDim.x) * gridDim.x;
  const index_t first_point = first * a.points_per_image();
  for (index_t local = blockIdx.x * index_t(blockDim.x) + threadIdx.x; local < points; local += step) {
    const PointAt<index_t> at(a, first_point + local);
    const Level<index_t> level = read_level(a, at.l);
    const AttentionPoint<acc_t, index_t> s(locations, weights, first_point + local, level);
    const index_t pixels_before = ((at.n - first) * a.heads + at.m) * a.pixels + level.start;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      entry_keys[4 * local + c] = s.b.valid(c) ? pixels_before + s.b.pixel(c, level.width) : keys;
    }
  }
}

// Each key's lane group owns all of its channels, so its adds, in entry order, need no atomics.
template <typename scalar_t, typename index_t>
DC_KERNEL void attention_value_grad_gather_kernel(Attention<index_t> a, Split split,
                                                  const scalar_t* __restrict__ locations,
                                                  const scalar_t* __restrict__ weights,
                                                  const scalar_t* __restrict__ grad_output,
                                                  const int64_t* __restrict__ sorted_entries,
                                                  const int64_t* __restrict__ key_starts, index_t first, index_t keys,
                                                  opmath_type<scalar_t>* __restrict__ grad_value) {
  using acc_t = opmath_type<scalar_t>;
  const LaneGroup<index_t> lanes(split);
  const index_t first_point = first * a.points_per_image();
  for (index_t key = lanes.item; key < keys; key += lanes.step) {
    const index_t begin = static_cast<index_t>(key_starts[key]), end = static_cast<index_t>(key_starts[key + 1]);
    if (begin == end) continue;  // no point reads this pixel: its gradient stays 0
    const index_t pixel = key % a.pixels, rest = key / a.pixels;
    const index_t m = rest % a.heads, n = first + rest / a.heads;
    acc_t* target = grad_value + a.value_index(n, pixel, m);
    for (index_t e = begin; e < end; ++e) {
      const index_t entry = static_cast<index_t>(sorted_entries[e]);
      const index_t point = first_point + entry / 4;
      const PointAt<index_t> at(a, point);
      const AttentionPoint<acc_t, index_t> s(locations, weights, point, read_level(a, at.l));
      const acc_t c = s.weight * s.b.weight(static_cast<int>(entry % 4));  // once an entry, for all its channels
      const scalar_t* grad = grad_output + a.output_index(at.n, at.q, at.m);
      for (index_t d = lanes.lane; d < a.channels; d += lanes.lanes) target[d] += c * static_cast<acc_t>(grad[d]);
    }
  }
}

}  // namespace cuda
}  // namespace deform_conv
