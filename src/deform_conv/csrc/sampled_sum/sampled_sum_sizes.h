// Sizes of one call of the family's shared kernels (sampled_sum.h), derived once from the tensors and passed to
// every kernel, and the flat index of each tensor's elements (all of them contiguous). No torch header: the CUDA
// kernels include it.
#pragma once

#include <cstdint>

#include "../ms_deform_attn/attention_sizes.h"  // level_fits: levels as multi-scale deformable attention's
#include "../sampling.h"

namespace deform_conv {

struct SampledSumSizes {
  int64_t batch, pixels, groups, channels;  // value        [batch, pixels, groups, channels]
  int64_t queries, points, levels;          // points       [batch, queries, groups, points, 3] (x, y, weight)
                                            // point_levels [points]
                                            // output       [batch, queries, groups, channels]

  // One (n, q, g, k): its x is at 3 * point, y and weight after it.
  DC_HOST_DEVICE int64_t point_index(int64_t n, int64_t q, int64_t g, int64_t k) const {
    return ((n * queries + q) * groups + g) * points + k;
  }
  // value[n, s, g, 0] (channels follow; the next pixel is groups * channels further).
  DC_HOST_DEVICE int64_t value_index(int64_t n, int64_t s, int64_t g) const {
    return ((n * pixels + s) * groups + g) * channels;
  }
  // output[n, q, g, 0] (= grad_output's).
  DC_HOST_DEVICE int64_t output_index(int64_t n, int64_t q, int64_t g) const {
    return ((n * queries + q) * groups + g) * channels;
  }
  DC_HOST_DEVICE int64_t total_points() const { return batch * queries * groups * points; }
};

}  // namespace deform_conv
