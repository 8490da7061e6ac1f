// The three sampling passes as kernels (deform_conv_cuda.cpp chooses how they are launched): fill the columns,
// the offset's and mask's gradients, and the input's gradient, by atomics or, deterministically, by a gather.
// Device code only. The columns' gradient comes from a policy: the buffer the backward's GEMM wrote, or, for a
// depthwise layer (no columns), weight * grad_output computed on the fly.
#pragma once

#include "geometry.cuh"

namespace deform_conv {
namespace cuda {

// value[k] = the bilinear interpolation of channel c + k at point s (unmasked; NaN for a NaN coordinate).
template <int V, typename scalar_t, typename acc_t, typename index_t>
DC_DEVICE void interpolate(const Geometry<index_t>& g, const scalar_t* __restrict__ input,
                           const Point<acc_t, index_t>& s, index_t c, acc_t (&value)[V]) {
#pragma unroll
  for (int k = 0; k < V; ++k) value[k] = sum_start<acc_t>(s.b.nan);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (!s.b.valid(q)) continue;
    const Vector<scalar_t, V> v = load_vector<V>(input + g.input_index(s.n, s.b.pixel(q, g.width), c));
    const acc_t w = s.b.weight(q);
#pragma unroll
    for (int k = 0; k < V; ++k) value[k] += w * static_cast<acc_t>(v.v[k]);
  }
}

// value[k] = the column's value of channel c + k at point s: the interpolation times the mask (alone without one).
// The mask multiplies the interpolated value, so a non-finite mask propagates as a multiplication would.
template <int V, typename scalar_t, typename acc_t, typename index_t>
DC_DEVICE void column_value(const Geometry<index_t>& g, const scalar_t* __restrict__ input, bool has_mask,
                            const Point<acc_t, index_t>& s, index_t c, acc_t (&value)[V]) {
  interpolate<V>(g, input, s, c, value);
  if (has_mask) {
#pragma unroll
    for (int k = 0; k < V; ++k) value[k] *= s.mask;
  }
}

// The columns' gradient where the backward's GEMM wrote it (ConvParams::column_index layout).
template <typename scalar_t, typename index_t>
struct GradColumnsBuffer {
  const scalar_t* grad_columns;

  template <int V, typename acc_t>
  DC_DEVICE void load(const Geometry<index_t>& g, const Point<acc_t, index_t>& s, index_t c, acc_t (&out)[V]) const {
    const Vector<scalar_t, V> v = load_vector<V>(grad_columns + g.column_index(s.n_local, s.pixel, s.tap, c));
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = static_cast<acc_t>(v.v[k]);
  }
};

// A depthwise layer's: the column of (point, channel c) is weighted by weight[c, tap] alone, so its gradient is
// weight[c, tap] * grad_output[n, c, pixel]; both read channels-last, grad_output as the rows of the chunk.
template <typename scalar_t, typename index_t>
struct DepthwiseGradColumns {
  const scalar_t* weight_tc;  // [taps, C]
  const scalar_t* grad_rows;  // [images of the chunk, H_out * W_out, C]

  template <int V, typename acc_t>
  DC_DEVICE void load(const Geometry<index_t>& g, const Point<acc_t, index_t>& s, index_t c, acc_t (&out)[V]) const {
    const Vector<scalar_t, V> w = load_vector<V>(weight_tc + s.tap * g.in_channels + c);
    const Vector<scalar_t, V> grad = load_vector<V>(grad_rows + (s.n_local * g.out_pixels + s.pixel) * g.in_channels + c);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = static_cast<acc_t>(w.v[k]) * static_cast<acc_t>(grad.v[k]);
  }
};

template <typename scalar_t, typename index_t, int V>
DC_KERNEL void fill_columns_kernel(Geometry<index_t> g, Split split, const scalar_t* __restrict__ input,
                                   const scalar_t* __restrict__ offset, const scalar_t* __restrict__ mask,
                                   index_t first, index_t points, scalar_t* __restrict__ columns) {
  using acc_t = opmath_type<scalar_t>;
  const LaneGroup<index_t> lanes(split);
  for (index_t point = lanes.item; point < points; point += lanes.step) {
    const Point<acc_t, index_t> s(g, offset, mask, first, point);
    const index_t end = s.first_channel(g) + g.per_offset_group;
    for (index_t c = s.first_channel(g) + lanes.lane * V; c < end; c += lanes.lanes * V) {
      acc_t value[V];
      column_value<V>(g, input, mask != nullptr, s, c, value);
      Vector<scalar_t, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = static_cast<scalar_t>(value[k]);
      store_vector<V>(columns + g.column_index(s.n_local, s.pixel, s.tap, c), out);
    }
  }
}

// d loss / d value, d y and d x of each point: its lanes sum over the point's channels, then a fixed-order
// butterfly over the lanes (deterministic). The loop runs the same number of times in every lane of a warp
// (points past the end take part with zeros), as a full-warp shuffle requires.
template <typename scalar_t, typename index_t, int V, typename GradColumns>
DC_KERNEL void coordinate_grads_kernel(Geometry<index_t> g, Split split, const scalar_t* __restrict__ input,
                                       const scalar_t* __restrict__ offset, const scalar_t* __restrict__ mask,
                                       GradColumns grad_columns, index_t first, index_t points,
                                       scalar_t* __restrict__ grad_offset, scalar_t* __restrict__ grad_mask) {
  using acc_t = opmath_type<scalar_t>;
  const index_t thread = blockIdx.x * index_t(blockDim.x) + threadIdx.x;
  const index_t lanes = index_t(1) << split.lanes_log2, lane = thread & (lanes - 1);
  const index_t per_warp = kWarp >> split.lanes_log2;  // points a warp takes at once
  const index_t warp_step = ((index_t(blockDim.x) * gridDim.x) / kWarp) * per_warp;
  for (index_t base = (thread / kWarp) * per_warp; base < points; base += warp_step) {
    const index_t point = base + (thread % kWarp) / lanes;
    const bool active = point < points;
    // A lane past the end decodes the last point (valid addresses) and adds nothing.
    const Point<acc_t, index_t> s(g, offset, mask, first, active ? point : points - 1);
    acc_t grad_value = 0, grad_y = 0, grad_x = 0;
    if (active) {
      grad_value = grad_y = grad_x = sum_start<acc_t>(s.b.nan);
      const index_t end = s.first_channel(g) + g.per_offset_group;
      for (index_t c = s.first_channel(g) + lane * V; c < end; c += lanes * V) {
        acc_t grad[V];
        grad_columns.template load<V>(g, s, c, grad);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (!s.b.valid(q)) continue;
          const Vector<scalar_t, V> v = load_vector<V>(input + g.input_index(s.n, s.b.pixel(q, g.width), c));
          acc_t dot = 0;
#pragma unroll
          for (int k = 0; k < V; ++k) dot += grad[k] * static_cast<acc_t>(v.v[k]);
          grad_value += s.b.weight(q) * dot;
          grad_y += s.b.weight_dy(q) * dot;
          grad_x += s.b.weight_dx(q) * dot;
        }
      }
    }
    for (int delta = static_cast<int>(lanes) / 2; delta > 0; delta /= 2) {
      grad_value += warp_xor(grad_value, delta);
      grad_y += warp_xor(grad_y, delta);
      grad_x += warp_xor(grad_x, delta);
    }
    if (active && lane == 0) {
      if (mask != nullptr) grad_mask[g.mask_index(s.n, s.group, s.tap, s.pixel)] = static_cast<scalar_t>(grad_value);
      scalar_t* g_dy = grad_offset + g.offset_index(s.n, s.group, s.tap, s.pixel);
      g_dy[0] = static_cast<scalar_t>(coordinate_grad(s.b, s.mask, grad_y, g.border_gradient));
      g_dy[g.out_pixels] = static_cast<scalar_t>(coordinate_grad(s.b, s.mask, grad_x, g.border_gradient));
    }
  }
}

// The input gradient, default mode: each point's lanes scatter (weight * mask * grad_column) into its in-image
// neighbours with atomics in the accumulation type. The order of the additions is not fixed.
template <typename scalar_t, typename index_t, int V, typename GradColumns>
DC_KERNEL void input_grad_atomic_kernel(Geometry<index_t> g, Split split, const scalar_t* __restrict__ offset,
                                        const scalar_t* __restrict__ mask, GradColumns grad_columns, index_t first,
                                        index_t points, opmath_type<scalar_t>* __restrict__ grad_input) {
  using acc_t = opmath_type<scalar_t>;
  const LaneGroup<index_t> lanes(split);
  for (index_t point = lanes.item; point < points; point += lanes.step) {
    const Point<acc_t, index_t> s(g, offset, mask, first, point);
    if (!s.b.inside) continue;  // outside the image, or NaN: reads no pixel, so adds nothing
    const index_t end = s.first_channel(g) + g.per_offset_group;
    for (index_t c = s.first_channel(g) + lanes.lane * V; c < end; c += lanes.lanes * V) {
      acc_t grad[V];
      grad_columns.template load<V>(g, s, c, grad);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (!s.b.valid(q)) continue;
        acc_t* target = grad_input + g.input_index(s.n, s.b.pixel(q, g.width), c);
        const acc_t w = s.b.weight(q);
#pragma unroll
        for (int k = 0; k < V; ++k) atomic_add(target + k, w * (grad[k] * s.mask));
      }
    }
  }
}

// The input gradient under torch.use_deterministic_algorithms(True), as a gather: every (point, corner) pair is an
// entry keyed by the input pixel it reads, ((n_local * offset_groups + group) * H*W + pixel), or by `keys` (past
// every real key) when the corner lies outside the image. A stable sort of the keys lists each pixel's entries in
// entry order; one lane group a pixel then sums its entries in that order and writes the sum once. No atomics, so
// the bits are the same in every run, whatever order the blocks run in.
template <typename scalar_t, typename index_t>
DC_KERNEL void entry_keys_kernel(Geometry<index_t> g, const scalar_t* __restrict__ offset,
                                 const scalar_t* __restrict__ mask, index_t first, index_t points, index_t keys,
                                 int64_t* __restrict__ entry_keys) {
  using acc_t = opmath_type<scalar_t>;
  const index_t step = index_t(blockDim.x) * gridDim.x;
  for (index_t point = blockIdx.x * index_t(blockDim.x) + threadIdx.x; point < points; point += step) {
    const Point<acc_t, index_t> s(g, offset, mask, first, point);
    const index_t pixels_before = (s.n_local * g.offset_groups + s.group) * g.image_pixels;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      entry_keys[4 * point + q] = s.b.valid(q) ? pixels_before + s.b.pixel(q, g.width) : keys;
    }
  }
}

// Each key's lane group owns all of its (pixel, channel) elements, so its adds, in entry order, need no atomics.
template <typename scalar_t, typename index_t, typename GradColumns>
DC_KERNEL void input_grad_gather_kernel(Geometry<index_t> g, Split split, const scalar_t* __restrict__ offset,
                                        const scalar_t* __restrict__ mask, GradColumns grad_columns,
                                        const int64_t* __restrict__ sorted_entries,
                                        const int64_t* __restrict__ key_starts, index_t first, index_t keys,
                                        opmath_type<scalar_t>* __restrict__ grad_input) {
  using acc_t = opmath_type<scalar_t>;
  const LaneGroup<index_t> lanes(split);
  for (index_t key = lanes.item; key < keys; key += lanes.step) {
    const index_t begin = static_cast<index_t>(key_starts[key]), end = static_cast<index_t>(key_starts[key + 1]);
    if (begin == end) continue;  // no point reads this pixel: its gradient stays 0
    const index_t image_pixel = key % g.image_pixels, rest = key / g.image_pixels;
    const index_t group = rest % g.offset_groups, n = first + rest / g.offset_groups;
    const index_t channels_end = (group + 1) * g.per_offset_group;
    acc_t* target = grad_input + g.input_index(n, image_pixel, 0);
    for (index_t e = begin; e < end; ++e) {
      const index_t entry = static_cast<index_t>(sorted_entries[e]);
      const Point<acc_t, index_t> s(g, offset, mask, first, entry / 4);  // once an entry, for all its channels
      const acc_t w = s.b.weight(static_cast<int>(entry % 4));
      for (index_t c = group * g.per_offset_group + lanes.lane; c < channels_end; c += lanes.lanes) {
        acc_t grad[1];
        grad_columns.template load<1>(g, s, c, grad);
        target[c] += w * (grad[0] * s.mask);
      }
    }
  }
}

}  // namespace cuda
}  // namespace deform_conv
