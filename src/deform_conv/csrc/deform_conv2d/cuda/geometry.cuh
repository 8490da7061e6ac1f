// What deform_conv2d's CUDA kernels share: the sizes in the kernels' index type and one sampling point decoded
// from its flat index. Device code only; included by the kernel headers.
#pragma once

#include <cstdint>

#include "../conv_sizes.h"
#include "../../sampling.h"
#include "../../cuda/lanes.cuh"

namespace deform_conv {
namespace cuda {

// ConvParams' sizes in the kernels' index type, so that their arithmetic runs in it.
template <typename index_t>
struct Geometry {
  index_t in_channels, height, width, image_pixels, kernel_w, taps, out_w, out_pixels;
  index_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  index_t groups, offset_groups, per_offset_group, per_group;
  BorderGradient border_gradient;

  explicit Geometry(const ConvParams& p)
      : in_channels(p.in_channels), height(p.height), width(p.width), image_pixels(p.height * p.width),
        kernel_w(p.kernel_w), taps(p.taps()), out_w(p.out_w), out_pixels(p.out_pixels()), stride_h(p.stride_h),
        stride_w(p.stride_w), pad_h(p.pad_h), pad_w(p.pad_w), dilation_h(p.dilation_h), dilation_w(p.dilation_w),
        groups(p.groups), offset_groups(p.offset_groups), per_offset_group(p.channels_per_offset_group()),
        per_group(p.in_channels_per_group()), border_gradient(p.border_gradient) {}

  // = ConvParams::offset_index and mask_index.
  DC_HOST_DEVICE index_t offset_index(index_t n, index_t group, index_t tap, index_t pixel) const {
    return ((n * offset_groups + group) * taps + tap) * 2 * out_pixels + pixel;
  }
  DC_HOST_DEVICE index_t mask_index(index_t n, index_t group, index_t tap, index_t pixel) const {
    return ((n * offset_groups + group) * taps + tap) * out_pixels + pixel;
  }
  // = ConvParams::column_index for input channel `channel`, whichever weight group holds it.
  DC_HOST_DEVICE index_t column_index(index_t n_local, index_t pixel, index_t tap, index_t channel) const {
    const index_t g = channel / per_group;
    return (((n_local * out_pixels + pixel) * groups + g) * taps + tap) * per_group +
           (channel - g * per_group);
  }
  // Of the channels-last input [B, H, W, C_in] and its gradient.
  DC_HOST_DEVICE index_t input_index(index_t n, index_t image_pixel, index_t channel) const {
    return (n * image_pixels + image_pixel) * in_channels + channel;
  }
};

// Where a sampling point is: image n_local of the chunk, output pixel, offset group, kernel tap. Its flat index
// is ((n_local * out_pixels + pixel) * offset_groups + group) * taps + tap.
template <typename index_t>
struct PointIndex {
  index_t n_local, pixel, group, tap;

  DC_HOST_DEVICE PointIndex(index_t n_local_, index_t pixel_, index_t group_, index_t tap_)
      : n_local(n_local_), pixel(pixel_), group(group_), tap(tap_) {}
  DC_HOST_DEVICE PointIndex(const Geometry<index_t>& g, index_t point) {
    tap = point % g.taps;
    index_t rest = point / g.taps;
    group = rest % g.offset_groups;
    rest /= g.offset_groups;
    pixel = rest % g.out_pixels;
    n_local = rest / g.out_pixels;
  }
};

// One sampling point with its coordinates read from the offset, its neighbours and weights, and its mask factor
// (1 without a mask).
template <typename acc_t, typename index_t>
struct Point : PointIndex<index_t> {
  index_t n;  // first + n_local: the image in the whole batch
  BilinearPoint<acc_t, index_t> b;
  acc_t mask;

  template <typename scalar_t>
  DC_HOST_DEVICE Point(const Geometry<index_t>& g, const scalar_t* offset, const scalar_t* mask_or_null, index_t first,
                       const PointIndex<index_t>& at)
      : PointIndex<index_t>(at), n(first + at.n_local) {
    const index_t oy = at.pixel / g.out_w, i = at.tap / g.kernel_w;
    const index_t ox = at.pixel - oy * g.out_w, j = at.tap - i * g.kernel_w;
    const scalar_t* dy = offset + g.offset_index(n, at.group, at.tap, at.pixel);
    const acc_t y = static_cast<acc_t>(oy * g.stride_h - g.pad_h + i * g.dilation_h) + static_cast<acc_t>(dy[0]);
    const acc_t x = static_cast<acc_t>(ox * g.stride_w - g.pad_w + j * g.dilation_w) +
                    static_cast<acc_t>(dy[g.out_pixels]);
    b = bilinear_point(y, x, g.height, g.width);
    mask = mask_or_null != nullptr ? static_cast<acc_t>(mask_or_null[g.mask_index(n, at.group, at.tap, at.pixel)])
                                   : acc_t(1);
  }
  template <typename scalar_t>
  DC_HOST_DEVICE Point(const Geometry<index_t>& g, const scalar_t* offset, const scalar_t* mask_or_null, index_t first,
                       index_t point)
      : Point(g, offset, mask_or_null, first, PointIndex<index_t>(g, point)) {}

  DC_HOST_DEVICE index_t first_channel(const Geometry<index_t>& g) const { return this->group * g.per_offset_group; }
};

}  // namespace cuda
}  // namespace deform_conv
