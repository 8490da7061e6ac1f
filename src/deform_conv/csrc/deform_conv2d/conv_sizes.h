// Sizes of one deformable convolution, derived once from the tensors (make_conv_params, conv_params.h) and passed
// to every kernel. No torch header: the CUDA kernels include it.
#pragma once

#include <cstdint>

#include "../sampling.h"

namespace deform_conv {

struct ConvParams {
  int64_t batch, in_channels, height, width;    // input   [batch, in_channels, height, width]
  int64_t out_channels, kernel_h, kernel_w;     // weight  [out_channels, in_channels / groups, kernel_h, kernel_w]
  int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  int64_t groups, offset_groups;                // inferred from the weight's and the offset's shapes
  int64_t out_h, out_w;                         // output  [batch, out_channels, out_h, out_w]
  bool has_mask;
  BorderGradient border_gradient;               // the op's border_gradient attribute

  DC_HOST_DEVICE int64_t taps() const { return kernel_h * kernel_w; }
  DC_HOST_DEVICE int64_t out_pixels() const { return out_h * out_w; }
  DC_HOST_DEVICE int64_t in_channels_per_group() const { return in_channels / groups; }
  DC_HOST_DEVICE int64_t out_channels_per_group() const { return out_channels / groups; }
  DC_HOST_DEVICE int64_t channels_per_offset_group() const { return in_channels / offset_groups; }
  // groups == in_channels == out_channels: each output channel is one input channel's samples weighted by kh*kw
  // numbers, so the backends skip the columns and the GEMMs.
  DC_HOST_DEVICE bool is_depthwise() const { return groups == in_channels && out_channels == in_channels; }

  // The columns of a chunk of images: [images, out_h, out_w, groups, taps, in_channels / groups], channels
  // innermost. Read as a channels-last tensor with groups * taps * C_in/groups channels, a 1x1 convolution with
  // `groups` groups turns them into the output. Index of (image n_local of the chunk, output pixel, weight
  // group g, tap, channel c of the group):
  DC_HOST_DEVICE int64_t column_index(int64_t n_local, int64_t pixel, int64_t g, int64_t tap, int64_t c) const {
    return (((n_local * out_pixels() + pixel) * groups + g) * taps() + tap) * in_channels_per_group() + c;
  }

  // Index of the dy value of (image n, offset group, tap, output pixel) in offset [B, 2*offset_groups*taps,
  // H_out, W_out] (and in its gradient); dx is out_pixels() further.
  DC_HOST_DEVICE int64_t offset_index(int64_t n, int64_t group, int64_t tap, int64_t pixel) const {
    return ((n * offset_groups + group) * taps() + tap) * 2 * out_pixels() + pixel;
  }
  // Index of (image n, offset group, tap, output pixel) in mask [B, offset_groups*taps, H_out, W_out].
  DC_HOST_DEVICE int64_t mask_index(int64_t n, int64_t group, int64_t tap, int64_t pixel) const {
    return ((n * offset_groups + group) * taps() + tap) * out_pixels() + pixel;
  }

  // Where kernel tap (i, j) of output pixel (oy, ox) samples before the learned offset is added.
  DC_HOST_DEVICE int64_t base_y(int64_t oy, int64_t i) const { return oy * stride_h - pad_h + i * dilation_h; }
  DC_HOST_DEVICE int64_t base_x(int64_t ox, int64_t j) const { return ox * stride_w - pad_w + j * dilation_w; }
};

}  // namespace deform_conv
