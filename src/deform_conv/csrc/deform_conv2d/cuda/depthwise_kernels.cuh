// A depthwise layer (groups == in_channels == out_channels) without columns or GEMMs, as on the CPU: output
// channel c is input channel c's samples weighted by weight[c, :, :], so the weighting is fused into the sampling.
// The offset's, mask's and input's gradients reuse sampling_kernels.cuh with DepthwiseGradColumns; the weight's
// gradient is summed here, in fixed-order row blocks (deterministic). Device code only.
#pragma once

#include "sampling_kernels.cuh"

namespace deform_conv {
namespace cuda {

// Item (row, offset group), row = n_local * H_out*W_out + pixel in a chunk of images starting at `first`:
// out_rows[row, c] = bias[c] + sum over taps of weight[tap, c] * mask * bilinear(input[first + n_local, c]);
// out_rows channels-last [images, H_out*W_out, C].
template <typename scalar_t, typename index_t, int V>
DC_KERNEL void depthwise_forward_kernel(Geometry<index_t> g, Split split, const scalar_t* __restrict__ input,
                                        const scalar_t* __restrict__ offset, const scalar_t* __restrict__ mask,
                                        const scalar_t* __restrict__ weight_tc, const scalar_t* __restrict__ bias,
                                        index_t first, index_t items, scalar_t* __restrict__ out_rows) {
  using acc_t = opmath_type<scalar_t>;
  const LaneGroup<index_t> lanes(split);
  for (index_t item = lanes.item; item < items; item += lanes.step) {
    const index_t group = item % g.offset_groups, row = item / g.offset_groups;
    const index_t n_local = row / g.out_pixels, pixel = row - n_local * g.out_pixels;
    const index_t end = (group + 1) * g.per_offset_group;
    for (index_t c = group * g.per_offset_group + lanes.lane * V; c < end; c += lanes.lanes * V) {
      acc_t sum[V] = {};
      for (index_t tap = 0; tap < g.taps; ++tap) {
        const Point<acc_t, index_t> s(g, offset, mask, first, PointIndex<index_t>(n_local, pixel, group, tap));
        acc_t value[V];
        column_value<V>(g, input, mask != nullptr, s, c, value);
        const Vector<scalar_t, V> w = load_vector<V>(weight_tc + tap * g.in_channels + c);
#pragma unroll
        for (int k = 0; k < V; ++k) sum[k] += static_cast<acc_t>(w.v[k]) * value[k];
      }
      Vector<scalar_t, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = static_cast<scalar_t>(bias != nullptr ? sum[k] + static_cast<acc_t>(bias[c + k]) : sum[k]);
      store_vector<V>(out_rows + row * g.in_channels + c, out);
    }
  }
}

// Item (row block, offset group, tap) of a chunk of images starting at `first`: partials[block, tap, c] = sum
// over the block's rows, in order, of grad_rows[row, c] * mask * bilinear(input[n, c]) (the column's value). The
// caller adds the blocks in order.
template <typename scalar_t, typename index_t, int V>
DC_KERNEL void depthwise_weight_partials_kernel(Geometry<index_t> g, Split split, const scalar_t* __restrict__ input,
                                                const scalar_t* __restrict__ offset, const scalar_t* __restrict__ mask,
                                                const scalar_t* __restrict__ grad_rows, index_t first, index_t rows,
                                                index_t rows_per_block, index_t items,
                                                opmath_type<scalar_t>* __restrict__ partials) {
  using acc_t = opmath_type<scalar_t>;
  const LaneGroup<index_t> lanes(split);
  for (index_t item = lanes.item; item < items; item += lanes.step) {
    const index_t tap = item % g.taps, rest = item / g.taps;
    const index_t group = rest % g.offset_groups, block = rest / g.offset_groups;
    const index_t row_end = rows - block * rows_per_block < rows_per_block ? rows : (block + 1) * rows_per_block;
    const index_t end = (group + 1) * g.per_offset_group;
    for (index_t c = group * g.per_offset_group + lanes.lane * V; c < end; c += lanes.lanes * V) {
      acc_t sum[V] = {};
      for (index_t row = block * rows_per_block; row < row_end; ++row) {
        const index_t n_local = row / g.out_pixels, pixel = row - n_local * g.out_pixels;
        const Point<acc_t, index_t> s(g, offset, mask, first, PointIndex<index_t>(n_local, pixel, group, tap));
        acc_t value[V];
        column_value<V>(g, input, mask != nullptr, s, c, value);
        const Vector<scalar_t, V> grad = load_vector<V>(grad_rows + row * g.in_channels + c);
#pragma unroll
        for (int k = 0; k < V; ++k) sum[k] += static_cast<acc_t>(grad.v[k]) * value[k];
      }
#pragma unroll
      for (int k = 0; k < V; ++k) partials[(block * g.taps + tap) * g.in_channels + c + k] = sum[k];
    }
  }
}

}  // namespace cuda
}  // namespace deform_conv
