// Sizes of one multi-scale deformable attention call, derived once from the tensors (make_attention_params,
// attention_params.h) and passed to every kernel, and the flat index of each tensor's elements (all tensors are made
// contiguous first). No torch header: the CUDA kernels include it.
#pragma once

#include <cstdint>

#include "../sampling.h"

namespace deform_conv {

struct AttentionParams {
  int64_t batch, pixels, heads, channels;  // value               [batch, pixels, heads, channels]
  int64_t queries, levels, points;         // sampling_locations  [batch, queries, heads, levels, points, 2]
                                           // attention_weights   [batch, queries, heads, levels, points]
                                           // output              [batch, queries, heads * channels]

  // One (n, q, m, l, p): the index of its attention weight; its location's x is at 2 * point, y next to it.
  DC_HOST_DEVICE int64_t point_index(int64_t n, int64_t q, int64_t m, int64_t l, int64_t p) const {
    return (((n * queries + q) * heads + m) * levels + l) * points + p;
  }
  // value[n, s, m, 0] (channels follow; the next pixel is heads * channels further).
  DC_HOST_DEVICE int64_t value_index(int64_t n, int64_t s, int64_t m) const {
    return ((n * pixels + s) * heads + m) * channels;
  }
  // output[n, q, m * channels] (= grad_output's).
  DC_HOST_DEVICE int64_t output_index(int64_t n, int64_t q, int64_t m) const {
    return ((n * queries + q) * heads + m) * channels;
  }
  DC_HOST_DEVICE int64_t total_points() const { return batch * queries * heads * levels * points; }
};

// Whether a level of height x width pixels starting at `start` lies inside value's `pixels`. The kernels sample
// NaN from a level that does not (it reads nothing): only CUDA calls can get that far, as make_attention_params
// (attention_params.h) rejects such levels on the CPU. An empty level (0 rows or columns: a DCNv3 or DCNv4 input
// without pixels, whose padding still gives output pixels) fits where it starts inside value: it has no pixel to
// read, and every point lies outside it, so its samples are 0, as the ops' definition has them.
DC_HOST_DEVICE inline bool level_fits(int64_t start, int64_t height, int64_t width, int64_t pixels) {
  if (height == 0 || width == 0) return start >= 0 && start <= pixels && height >= 0 && width >= 0;
  // width <= pixels / height: height * width cannot overflow.
  return start >= 0 && height >= 1 && width >= 1 && width <= pixels / height && start <= pixels - height * width;
}

}  // namespace deform_conv
