// Helpers shared by the CPU passes (sampling_passes.cpp, depthwise.cpp): where one sampling point is, and the
// channel loops over its neighbours. All inline: they are the inner loops.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../../cpu_kernels.h"
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

// dst[c] = (sum over the in-image neighbours q of weight_q * image[pixel_q * stride + c]) (* m), c < len;
// NaN for a NaN coordinate.
// The mask multiplies the interpolated value (not the weights), so a non-finite mask propagates exactly as a
// multiplication would. Four neighbours (the common case) in one pass that the compiler vectorises.
template <typename scalar_t>
inline void interpolate(const BilinearSample<scalar_t>& s, const scalar_t* image, int64_t stride, int64_t len,
                        bool masked, scalar_t m, scalar_t* __restrict__ dst) {
  if (s.count == 4) {
    const scalar_t *__restrict__ p0 = image + s.pixel[0] * stride, *__restrict__ p1 = image + s.pixel[1] * stride;
    const scalar_t *__restrict__ p2 = image + s.pixel[2] * stride, *__restrict__ p3 = image + s.pixel[3] * stride;
    const scalar_t w0 = s.weight[0], w1 = s.weight[1], w2 = s.weight[2], w3 = s.weight[3];
    if (masked) {
      for (int64_t c = 0; c < len; ++c) dst[c] = (w0 * p0[c] + w1 * p1[c] + w2 * p2[c] + w3 * p3[c]) * m;
    } else {
      for (int64_t c = 0; c < len; ++c) dst[c] = w0 * p0[c] + w1 * p1[c] + w2 * p2[c] + w3 * p3[c];
    }
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

// dot[q] = sum over c < len of grad[c] * image[pixel_q * stride + c], for each in-image neighbour q.
// `omp simd reduction` lets the compiler reorder the sums into vector lanes: the order is fixed by the
// code, so the result is still reproducible run to run.
template <typename scalar_t>
inline void neighbour_dots(const BilinearSample<scalar_t>& s, const scalar_t* image, int64_t stride, int64_t len,
                           const scalar_t* __restrict__ grad, scalar_t dot[4]) {
  const scalar_t* p[4];
  for (int q = 0; q < 4; ++q) p[q] = image + (q < s.count ? s.pixel[q] : s.pixel[0]) * stride;
  const scalar_t *__restrict__ p0 = p[0], *__restrict__ p1 = p[1], *__restrict__ p2 = p[2], *__restrict__ p3 = p[3];
  scalar_t d0 = 0, d1 = 0, d2 = 0, d3 = 0;
  if (s.count == 4) {
#pragma omp simd reduction(+ : d0, d1, d2, d3)
    for (int64_t c = 0; c < len; ++c) {
      d0 += grad[c] * p0[c];
      d1 += grad[c] * p1[c];
      d2 += grad[c] * p2[c];
      d3 += grad[c] * p3[c];
    }
  } else {
    for (int q = 0; q < s.count; ++q) {
      const scalar_t* __restrict__ src = p[q];
      scalar_t d = 0;
#pragma omp simd reduction(+ : d)
      for (int64_t c = 0; c < len; ++c) d += grad[c] * src[c];
      (q == 0 ? d0 : q == 1 ? d1 : q == 2 ? d2 : d3) = d;
    }
  }
  dot[0] = d0, dot[1] = d1, dot[2] = d2, dot[3] = d3;
}

}  // namespace cpu
}  // namespace deform_conv
