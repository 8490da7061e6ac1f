// deform_conv2d's kernel launchers: what its host code (deform_conv_cuda.cpp) calls to run a kernel, defined in
// deform_conv_cuda.cu and instantiated there for every dtype, index type (index_t: int32_t or int64_t) and vector
// width (V: 1 or kWideVector) the host code can choose. Plain pointers and sizes, so that the .cu sees no
// Tensor and the .cpp no kernel. Each launcher converts the sizes to index_t and launches one kernel with the
// config it is given; its host caller checks the launch (cuda/host.h's launch_and_check).
#pragma once

#include <cstdint>

#include "../../cuda/launch.h"
#include "../conv_sizes.h"

namespace deform_conv {
namespace cuda {

// 16 bytes a load where the channel counts and the addresses allow it, else one element.
template <typename scalar_t>
constexpr int kWideVector = 16 / sizeof(scalar_t);

// Where a backward pass reads the columns' gradient from: the buffer the backward's GEMM wrote or, for a depthwise
// layer (no columns), weight * grad_output, computed on the fly.
template <typename scalar_t>
struct GradColumnsSource {
  const scalar_t* grad_columns;  // the GEMM's buffer (ConvParams::column_index layout); nullptr: a depthwise layer's
  const scalar_t* weight_tc;     // depthwise: the weight by tap [taps, C]
  const scalar_t* grad_rows;     // depthwise: grad_output channels-last [images of the chunk, H_out*W_out, C]
};

// The passes over sampling points (or output rows) that load and store V channels at a time. `first`: the chunk's
// first image; `points`, `items`: how many the launch covers; mask and bias may be nullptr.
template <typename scalar_t, typename index_t, int V>
struct VectorLaunchers {
  using acc_t = opmath_type<scalar_t>;

  // columns [images, out_h, out_w, groups, taps, C_in/groups] of the chunk.
  static void fill_columns(const LaunchConfig&, const ConvParams&, Split, const scalar_t* input,
                           const scalar_t* offset, const scalar_t* mask, int64_t first, int64_t points,
                           scalar_t* columns);
  // grad_offset [B, 2*offset_groups*taps, H_out, W_out] and grad_mask (nullptr without a mask) of the chunk.
  static void coordinate_grads(const LaunchConfig&, const ConvParams&, Split, const scalar_t* input,
                               const scalar_t* offset, const scalar_t* mask, const GradColumnsSource<scalar_t>&,
                               int64_t first, int64_t points, scalar_t* grad_offset, scalar_t* grad_mask);
  // Adds the chunk's input gradient into grad_input [B, H, W, C_in] by atomics.
  static void input_grad_atomic(const LaunchConfig&, const ConvParams&, Split, const scalar_t* offset,
                                const scalar_t* mask, const GradColumnsSource<scalar_t>&, int64_t first,
                                int64_t points, acc_t* grad_input);
  // out_rows [images, H_out*W_out, C] of a depthwise layer's chunk; weight_tc [taps, C].
  static void depthwise_forward(const LaunchConfig&, const ConvParams&, Split, const scalar_t* input,
                                const scalar_t* offset, const scalar_t* mask, const scalar_t* weight_tc,
                                const scalar_t* bias, int64_t first, int64_t items, scalar_t* out_rows);
  // partials [blocks, taps, C] of a depthwise layer's weight gradient over the chunk's `rows` output rows.
  static void depthwise_weight_partials(const LaunchConfig&, const ConvParams&, Split, const scalar_t* input,
                                        const scalar_t* offset, const scalar_t* mask, const scalar_t* grad_rows,
                                        int64_t first, int64_t rows, int64_t rows_per_block, int64_t items,
                                        acc_t* partials);
};

// The deterministic input gradient (a gather), one channel a lane.
template <typename scalar_t, typename index_t>
struct GatherLaunchers {
  using acc_t = opmath_type<scalar_t>;

  // entry_keys [4 * points]: the input pixel each (point, corner) of images [first, ...) reads, or `keys`.
  static void entry_keys(const LaunchConfig&, const ConvParams&, const scalar_t* offset, const scalar_t* mask,
                         int64_t first, int64_t points, int64_t keys, int64_t* entry_keys);
  // grad_input [B, H, W, C_in] of the `keys` pixels, from the entries sorted by key and each key's first entry.
  static void input_grad_gather(const LaunchConfig&, const ConvParams&, Split, const scalar_t* offset,
                                const scalar_t* mask, const GradColumnsSource<scalar_t>&,
                                const int64_t* sorted_entries, const int64_t* key_starts, int64_t first,
                                int64_t keys, acc_t* grad_input);
};

}  // namespace cuda
}  // namespace deform_conv
