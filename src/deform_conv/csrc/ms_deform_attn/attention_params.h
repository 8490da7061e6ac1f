// Sizes of one multi-scale deformable attention call, derived once from the tensors and passed to every kernel,
// and the flat index of each tensor's elements (all tensors are made contiguous first).
#pragma once

#include <ATen/core/Tensor.h>

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

// Checks every tensor against the others (the backstop behind the Python checks, for direct torch.ops calls)
// and returns the sizes. With `check_level_values` (the CPU backend) the values of spatial_shapes and
// level_start_index too: levels at least 1x1, one after another, filling value's pixels. The CUDA backend does not
// read them (on a GPU that would cost a device synchronisation a call): its kernels check each level before they
// read it (level_fits).
AttentionParams make_attention_params(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                      const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                                      const at::Tensor& attention_weights, bool check_level_values);

void check_attention_grad_output(const AttentionParams& p, const at::Tensor& grad_output, const at::Tensor& value);

// Whether a level of height x width pixels starting at `start` lies inside value's `pixels`. The kernels sample
// NaN from a level that does not (it reads nothing): only CUDA calls can get that far, as the checks above
// reject such levels on the CPU.
DC_HOST_DEVICE inline bool level_fits(int64_t start, int64_t height, int64_t width, int64_t pixels) {
  // width <= pixels / height: height * width cannot overflow.
  return start >= 0 && height >= 1 && width >= 1 && width <= pixels / height && start <= pixels - height * width;
}

}  // namespace deform_conv
