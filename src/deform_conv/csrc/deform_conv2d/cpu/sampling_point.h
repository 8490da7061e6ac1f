// Helpers shared by the CPU passes (sampling_passes.cpp, depthwise.cpp): where one sampling point is, and the
// channel loops over its neighbours. All inline: they are the inner loops.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../../cpu_kernels.h"
#include "../../cpu_lanes.h"
#include "../conv_params.h"
#include "sampling_passes.h"

namespace deform_conv {
namespace cpu {

// (image, output pixel) rows per parallel task: enough work to amortise the task, small enough to balance.
constexpr int64_t kRowsPerTask = 8;


// The sampling points of one row, (image n, output pixel): the index arithmetic is done once per row, not
// once per point.
template <typename scalar_t>
struct RowPoints {
  const ConvParams& p;
  const SamplingInputs<scalar_t>& in;
  int64_t pixels;              // the stride between channels of offset and mask
  int64_t offset_row;          // index of offset[n, 0, pixel] (and of grad_offset's)
  int64_t mask_row;            // index of mask[n, 0, pixel] (and of grad_mask's)
  int64_t y_origin, x_origin;  // where tap (0, 0) samples before its offset

  RowPoints(const ConvParams& p_, const SamplingInputs<scalar_t>& in_, int64_t n, int64_t pixel)
      : p(p_),
        in(in_),
        pixels(p_.out_pixels()),
        offset_row(p_.offset_index(n, 0, 0, pixel)),
        mask_row(p_.mask_index(n, 0, 0, pixel)),
        y_origin(p_.base_y(pixel / p_.out_w, 0)),
        x_origin(p_.base_x(pixel % p_.out_w, 0)) {}

  // Index of the dy channel of (offset group, tap) in offset and grad_offset; dx is `pixels` further.
  int64_t offset_index(int64_t group, int64_t tap) const { return offset_row + 2 * (group * p.taps() + tap) * pixels; }
  int64_t mask_index(int64_t group, int64_t tap) const { return mask_row + (group * p.taps() + tap) * pixels; }

  // Kernel tap (i, j) of offset group `group`.
  BilinearSample<scalar_t> sample(int64_t group, int64_t i, int64_t j) const {
    const int64_t at = offset_index(group, i * p.kernel_w + j);
    const scalar_t y = static_cast<scalar_t>(y_origin + i * p.dilation_h) + in.offset[at];
    const scalar_t x = static_cast<scalar_t>(x_origin + j * p.dilation_w) + in.offset[at + pixels];
    return bilinear_sample(y, x, p.height, p.width);
  }

  scalar_t mask(int64_t group, int64_t tap) const {
    return in.mask != nullptr ? in.mask[mask_index(group, tap)] : scalar_t(1);
  }
};

// Calls f(weight_group, c_begin, c_end) for each piece of the channel range [c_begin, c_end) that lies in
// one weight group: offset groups and weight groups need not nest, and each piece is contiguous in the
// columns.
template <typename F>
inline void for_each_weight_group_piece(const ConvParams& p, int64_t c_begin, int64_t c_end, F&& f) {
  if (p.groups == 1) {  // the common case, without the division below (this runs once per sampling point)
    f(0, c_begin, c_end);
    return;
  }
  const int64_t per_group = p.in_channels_per_group();
  for (int64_t c = c_begin; c < c_end;) {
    const int64_t g = c / per_group;
    const int64_t stop = std::min(c_end, (g + 1) * per_group);
    f(g, c, stop);
    c = stop;
  }
}

// A sampling point as four corners, each the channels of an image pixel with its bilinear weight. A corner
// outside the image reads `zeros` with weight 0, and a point with a NaN coordinate has NaN weights (on zeros):
// interpolate_corners then sums the same terms in the same order as interpolate, whose sum leaves such corners
// out, and a non-finite pixel outside the image still adds nothing.
template <typename scalar_t, typename image_t = scalar_t>
struct Corners {
  const image_t* pixel[4];
  scalar_t weight[4];
};

// dst[c] = (sum over the corners q of weight_q * pixel_q[channel + c]) (* m), c < len, each value rounded once
// to column_t: scalar_t, or for float a half type (the half types' columns, which their GEMM reads so; to nearest
// even as torch rounds, a NaN staying a NaN). The pixels are scalar_t's, or for float a half type's (the half
// types' images), widened exactly as they are loaded. In float, in vector registers to the last channel
// (for_float_blocks), 16 channels at a time widened and rounded there too (cpu_lanes.h): the same operations for
// every element, so the same bits as the plain loop. `in_pairs`: bfloat16 corners and columns 32 channels at a time
// where the library has AVX512-BF16 (widen_bfloat16_pairs, round_bfloat16_pairs), the same bits again.
template <bool in_pairs = false, typename scalar_t, typename column_t, typename image_t>
inline void interpolate_corners(const Corners<scalar_t, image_t>& k, int64_t channel, int64_t len, bool masked,
                                scalar_t m, column_t* __restrict__ dst) {
  const image_t *__restrict__ p0 = k.pixel[0] + channel, *__restrict__ p1 = k.pixel[1] + channel;
  const image_t *__restrict__ p2 = k.pixel[2] + channel, *__restrict__ p3 = k.pixel[3] + channel;
  const scalar_t w0 = k.weight[0], w1 = k.weight[1], w2 = k.weight[2], w3 = k.weight[3];
  // One value, or a vector of them, of each corner interpolated (and masked).
  const auto interpolate = [&](const auto& v0, const auto& v1, const auto& v2, const auto& v3) {
    auto v = w0 * v0 + w1 * v1 + w2 * v2 + w3 * v3;
    if (masked) v = v * m;
    return v;
  };
#if defined(__GNUC__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    int64_t first = 0;  // channels [0, first) done in pairs
#if defined(DC_CPU_AVX512_BF16)
    if constexpr (in_pairs && std::is_same_v<image_t, c10::BFloat16> && std::is_same_v<column_t, c10::BFloat16>) {
      for (; first + 2 * kSumLanes <= len; first += 2 * kSumLanes) {
        FloatLanes even[4], odd[4];
        widen_bfloat16_pairs(p0 + first, even[0], odd[0]);
        widen_bfloat16_pairs(p1 + first, even[1], odd[1]);
        widen_bfloat16_pairs(p2 + first, even[2], odd[2]);
        widen_bfloat16_pairs(p3 + first, even[3], odd[3]);
        round_bfloat16_pairs(interpolate(even[0], even[1], even[2], even[3]),
                             interpolate(odd[0], odd[1], odd[2], odd[3]), dst + first);
      }
    }
#endif
    for_float_blocks(len - first, [&, first](const auto& tag, int64_t block) {
      const int64_t c = first + block;
      using V = std::decay_t<decltype(tag)>;
      V v0, v1, v2, v3;
      load_block(p0 + c, v0);
      load_block(p1 + c, v1);
      load_block(p2 + c, v2);
      load_block(p3 + c, v3);
      store_block(V(interpolate(v0, v1, v2, v3)), dst + c);
    });
    return;
  }
#endif
  for (int64_t c = 0; c < len; ++c) {
    dst[c] = static_cast<column_t>(interpolate(static_cast<scalar_t>(p0[c]), static_cast<scalar_t>(p1[c]),
                                               static_cast<scalar_t>(p2[c]), static_cast<scalar_t>(p3[c])));
  }
}

// dot[q] = sum over c < len of grad[c] * pixel_q[channel + c], for the four corners (neighbour_dots' sums), in
// cpu_lanes.h's order: the same bits on every instruction set.
template <typename scalar_t, typename image_t>
inline void corner_dots(const Corners<scalar_t, image_t>& k, int64_t channel, int64_t len,
                        const scalar_t* __restrict grad, scalar_t dot[4]) {
  const image_t* pixels[4] = {k.pixel[0] + channel, k.pixel[1] + channel, k.pixel[2] + channel,
                               k.pixel[3] + channel};
  lane_dots<4>(grad, pixels, len, dot);
}

// The four neighbours of a sample with all of them in the image, as corners.
template <typename scalar_t>
inline Corners<scalar_t> four_corners(const BilinearSample<scalar_t>& s, const scalar_t* image, int64_t stride) {
  Corners<scalar_t> k;
  for (int q = 0; q < 4; ++q) {
    k.pixel[q] = image + s.pixel[q] * stride;
    k.weight[q] = s.weight[q];
  }
  return k;
}

// dst[c] = (sum over the in-image neighbours q of weight_q * image[pixel_q * stride + c]) (* m), c < len;
// NaN for a NaN coordinate.
// The mask multiplies the interpolated value (not the weights), so a non-finite mask propagates exactly as a
// multiplication would. Four neighbours (the common case) in one pass that the compiler vectorises.
template <typename scalar_t>
inline void interpolate(const BilinearSample<scalar_t>& s, const scalar_t* image, int64_t stride, int64_t len,
                        bool masked, scalar_t m, scalar_t* __restrict__ dst) {
  if (s.count == 4) {
    interpolate_corners(four_corners(s, image, stride), 0, len, masked, m, dst);
    return;
  }
  std::fill(dst, dst + len, sum_start(s));
  for (int q = 0; q < s.count; ++q) {
    const scalar_t* __restrict__ src = image + s.pixel[q] * stride;
    const scalar_t w = s.weight[q];
    for (int64_t c = 0; c < len; ++c) dst[c] += w * src[c];
  }
  if (masked) {
    for (int64_t c = 0; c < len; ++c) dst[c] *= m;
  }
}

// Output pixels whose sampling points are worked out together, one (offset group, tap) at a time.
constexpr int64_t kPointBlock = 16;

// Where a block's corners are read from: the address of pixel (0, 0) of a channels-last image, the bytes from one
// pixel to the next, and a row of zeros that the corners outside the image read.
struct CornerSource {
  uintptr_t image, zeros;
  int64_t pixel_bytes;
};

template <typename image_t>
CornerSource corner_source(const image_t* image, int64_t channels, const image_t* zeros) {
  return {reinterpret_cast<uintptr_t>(image), reinterpret_cast<uintptr_t>(zeros),
          channels * static_cast<int64_t>(sizeof(image_t))};
}

// The sampling points of up to kPointBlock output pixels for one (offset group, tap): bilinear_point's numbers
// (sampling.h), computed without branches so that the compiler vectorises the loop over the pixels. Between
// channel loops, one point at a time, that arithmetic took most of the sampling's time where an offset group has
// few channels (12, cut into pieces of 4 and 8 by the weight groups).
template <typename scalar_t>
struct PointBlock {
  int32_t y0[kPointBlock], x0[kPointBlock];  // the top-left corner
  int32_t valid[4][kPointBlock];             // whether corner q lies in the image
  scalar_t weight[4][kPointBlock];           // its weight: 0 outside the image, NaN for a NaN coordinate
  int32_t inside[kPointBlock], nan[kPointBlock];  // as in BilinearPoint
  scalar_t ly[kPointBlock], lx[kPointBlock];      // the distances to the top-left corner
  uintptr_t address[4][kPointBlock];              // corner q's pixel in the source, or its zeros outside

  // Point b at (y_base[b] + dy[b], x_base[b] + dx[b]), b < len, its corners in `source`. (The conditions are
  // 32-bit masks, not bools, and the library is compiled without trapping math, _jit/sources.py: GCC vectorises
  // the loop only then.)
  void compute(int64_t len, const int32_t* __restrict y_base, const int32_t* __restrict x_base,
               const scalar_t* __restrict dy, const scalar_t* __restrict dx, int64_t height, int64_t width,
               const CornerSource& source) {
    const int32_t h = static_cast<int32_t>(height), w = static_cast<int32_t>(width);
    const scalar_t hf = static_cast<scalar_t>(height), wf = static_cast<scalar_t>(width);
    int32_t *__restrict ys = y0, *__restrict xs = x0;
    int32_t *__restrict v0 = valid[0], *__restrict v1 = valid[1], *__restrict v2 = valid[2], *__restrict v3 = valid[3];
    scalar_t *__restrict w0 = weight[0], *__restrict w1 = weight[1], *__restrict w2 = weight[2];
    scalar_t* __restrict w3 = weight[3];
    int32_t *__restrict ins = inside, *__restrict nans = nan;
    scalar_t *__restrict lys = ly, *__restrict lxs = lx;
    for (int64_t b = 0; b < len; ++b) {
      const scalar_t y = static_cast<scalar_t>(y_base[b]) + dy[b], x = static_cast<scalar_t>(x_base[b]) + dx[b];
      const int32_t is_nan = (y != y || x != x) ? -1 : 0;
      const int32_t inside = ((y >= scalar_t(-1) && y < hf) ? -1 : 0) & ((x >= scalar_t(-1) && x < wf) ? -1 : 0);
      // (Outside, the coordinates may be huge: they are replaced before any conversion to an integer.)
      const scalar_t yc = inside ? y : scalar_t(0), xc = inside ? x : scalar_t(0);
      const scalar_t yf = floor_of(yc), xf = floor_of(xc);
      const int32_t yi = static_cast<int32_t>(yf), xi = static_cast<int32_t>(xf);
      const scalar_t ly = yc - yf, lx = xc - xf, hy = scalar_t(1) - ly, hx = scalar_t(1) - lx;
      const int32_t top = inside & (yi >= 0 ? -1 : 0), bottom = inside & (yi + 1 < h ? -1 : 0);
      const int32_t left = inside & (xi >= 0 ? -1 : 0), right = inside & (xi + 1 < w ? -1 : 0);
      ys[b] = yi;
      xs[b] = xi;
      v0[b] = top & left;
      v1[b] = top & right;
      v2[b] = bottom & left;
      v3[b] = bottom & right;
      ins[b] = inside;
      nans[b] = is_nan;
      lys[b] = ly;
      lxs[b] = lx;
      w0[b] = is_nan ? scalar_t(NAN) : (top & left) ? hy * hx : scalar_t(0);
      w1[b] = is_nan ? scalar_t(NAN) : (top & right) ? hy * lx : scalar_t(0);
      w2[b] = is_nan ? scalar_t(NAN) : (bottom & left) ? ly * hx : scalar_t(0);
      w3[b] = is_nan ? scalar_t(NAN) : (bottom & right) ? ly * lx : scalar_t(0);
    }
    // The corners' addresses in a loop of their own, in 64 bits: worked out here 16 points at a time, where
    // each point's channel loops took a dozen instructions to find them one by one.
    const int64_t step = source.pixel_bytes, row = width * step;
    const uintptr_t image = source.image, zeros = source.zeros;
    uintptr_t *__restrict a0 = address[0], *__restrict a1 = address[1], *__restrict a2 = address[2];
    uintptr_t* __restrict a3 = address[3];
    for (int64_t b = 0; b < len; ++b) {
      const uintptr_t at = image + static_cast<uintptr_t>(static_cast<int64_t>(ys[b]) * row +
                                                          static_cast<int64_t>(xs[b]) * step);
      a0[b] = v0[b] ? at : zeros;
      a1[b] = v1[b] ? at + step : zeros;
      a2[b] = v2[b] ? at + row : zeros;
      a3[b] = v3[b] ? at + row + step : zeros;
    }
  }

  // Point b's corners in the source compute() was given, an image of image_t.
  template <typename image_t>
  Corners<scalar_t, image_t> corners(int64_t b) const {
    Corners<scalar_t, image_t> k;
    for (int q = 0; q < 4; ++q) {
      k.pixel[q] = reinterpret_cast<const image_t*>(address[q][b]);
      k.weight[q] = weight[q][b];
    }
    return k;
  }

  // d loss / d y (x) of point b with mask factor m, given the derivative of its unmasked value (coordinate_grad).
  scalar_t coordinate_grad(int64_t b, scalar_t m, scalar_t grad, BorderGradient border) const {
    const bool on_lower_border = inside[b] && ((y0[b] == -1 && ly[b] == scalar_t(0)) ||
                                               (x0[b] == -1 && lx[b] == scalar_t(0)));
    return deform_conv::coordinate_grad((!inside[b] && !nan[b]) || (border == BorderGradient::mmcv && on_lower_border),
                                        m, grad);
  }
};

// dot[q] = sum over c < len of grad[c] * image[pixel_q * stride + c], for each in-image neighbour q, in
// cpu_lanes.h's order.
template <typename scalar_t>
inline void neighbour_dots(const BilinearSample<scalar_t>& s, const scalar_t* image, int64_t stride, int64_t len,
                           const scalar_t* __restrict__ grad, scalar_t dot[4]) {
  if (s.count == 4) {
    corner_dots(four_corners(s, image, stride), 0, len, grad, dot);
    return;
  }
  for (int q = 0; q < 4; ++q) {
    dot[q] = 0;
    if (q < s.count) {
      const scalar_t* src = image + s.pixel[q] * stride;
      lane_dots<1>(grad, &src, len, &dot[q]);
    }
  }
}

}  // namespace cpu
}  // namespace deform_conv
