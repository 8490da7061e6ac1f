// The family's kernel launchers: what its CUDA host code (sampled_sum_cuda.cpp) calls to run a kernel, defined in
// sampled_sum_cuda.cu and instantiated there for every dtype and index type (index_t: int32_t or int64_t) the host
// code can choose. Plain pointers and sizes, so that the .cu sees no Tensor and the .cpp no kernel. Each launcher
// converts the sizes to index_t and launches one kernel with the config it is given; its host caller checks the
// launch (cuda/host.h's launch_and_check).
#pragma once

#include <cstdint>

#include "../../cuda/launch.h"
#include "../sampled_sum_sizes.h"

namespace deform_conv {
namespace cuda {

// The point and level tables, as device pointers: point_levels [points], spatial_shapes [levels, 2] (height, width)
// and level_start_index [levels].
struct SampledSumLevels {
  const int64_t* point_levels;
  const int64_t* spatial_shapes;
  const int64_t* level_start_index;
};

// value [N, S, G, D] and output, grad_output [N, Q, G, D] in scalar_t; points and grad_points [N, Q, G, K, 3]
// (x, y, weight) and value's gradient in the accumulation type acc_t.
template <typename scalar_t, typename index_t>
struct SampledSumLaunchers {
  using acc_t = opmath_type<scalar_t>;

  static void forward(const LaunchConfig&, const SampledSumSizes&, const SampledSumLevels&, Split,
                      const scalar_t* value, const acc_t* points, scalar_t* output);
  // grad_points, and with grad_value (the default mode; nullptr: deterministic) value's gradient by atomics.
  static void backward(const LaunchConfig&, const SampledSumSizes&, const SampledSumLevels&, Split, BorderGradient,
                       const scalar_t* value, const acc_t* points, const scalar_t* grad_output, acc_t* grad_value,
                       acc_t* grad_points);
  // entry_keys [4 * count]: the value pixel each (point, corner) of the `count` points of images [first, ...)
  // reads, or `keys`.
  static void entry_keys(const LaunchConfig&, const SampledSumSizes&, const SampledSumLevels&, const acc_t* points,
                         int64_t first, int64_t count, int64_t keys, int64_t* entry_keys);
  // value's gradient at the `keys` pixels, from the entries sorted by key and each key's first entry.
  static void value_grad_gather(const LaunchConfig&, const SampledSumSizes&, const SampledSumLevels&, Split,
                                const acc_t* points, const scalar_t* grad_output, const int64_t* sorted_entries,
                                const int64_t* key_starts, int64_t first, int64_t keys, acc_t* grad_value);
};

}  // namespace cuda
}  // namespace deform_conv
