// Multi-scale deformable attention's kernel launchers: what its host code (ms_deform_attn_cuda.cpp) calls to run a
// kernel, defined in ms_deform_attn_cuda.cu and instantiated there for every dtype and index type (index_t: int32_t
// or int64_t) the host code can choose. Plain pointers and sizes, so that the .cu sees no Tensor and the .cpp no
// kernel. Each launcher converts the sizes to index_t and launches one kernel with the config it is given; its host
// caller checks the launch (cuda/host.h's launch_and_check).
#pragma once

#include <cstdint>

#include "../../cuda/launch.h"
#include "../attention_sizes.h"

namespace deform_conv {
namespace cuda {

// The levels, as device pointers: spatial_shapes [levels, 2] (height, width) and level_start_index [levels].
struct AttentionLevels {
  const int64_t* spatial_shapes;
  const int64_t* level_start_index;
};

// value [N, S, M, D], locations [N, Lq, M, L, P, 2], weights [N, Lq, M, L, P], output and grad_output [N, Lq, M * D].
template <typename scalar_t, typename index_t>
struct AttentionLaunchers {
  using acc_t = opmath_type<scalar_t>;

  static void forward(const LaunchConfig&, const AttentionParams&, const AttentionLevels&, Split,
                      const scalar_t* value, const scalar_t* locations, const scalar_t* weights, scalar_t* output);
  // grad_locations and grad_weights, and with grad_value (the default mode; nullptr: deterministic) value's
  // gradient by atomics.
  static void backward(const LaunchConfig&, const AttentionParams&, const AttentionLevels&, Split,
                       const scalar_t* value, const scalar_t* locations, const scalar_t* weights,
                       const scalar_t* grad_output, acc_t* grad_value, scalar_t* grad_locations,
                       scalar_t* grad_weights);
  // entry_keys [4 * points]: the value pixel each (point, corner) of images [first, ...) reads, or `keys`.
  static void entry_keys(const LaunchConfig&, const AttentionParams&, const AttentionLevels&,
                         const scalar_t* locations, const scalar_t* weights, int64_t first, int64_t points,
                         int64_t keys, int64_t* entry_keys);
  // value's gradient at the `keys` pixels, from the entries sorted by key and each key's first entry.
  static void value_grad_gather(const LaunchConfig&, const AttentionParams&, const AttentionLevels&, Split,
                                const scalar_t* locations, const scalar_t* weights, const scalar_t* grad_output,
                                const int64_t* sorted_entries, const int64_t* key_starts, int64_t first,
                                int64_t keys, acc_t* grad_value);
};

}  // namespace cuda
}  // namespace deform_conv
