// Helpers shared by the CPU passes (sampling_passes.cpp, depthwise.cpp): where the sampling points are, a block of
// output pixels at a time (PointBlock, TapPoints), and the channel loops over their corners. All inline: they are
// the inner loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <c10/util/Exception.h>

#include "../../cpu_kernels.h"
#include "../../cpu_lanes.h"
#include "../conv_params.h"
#include "sampling_passes.h"

namespace deform_conv {
namespace cpu {

// (image, output pixel) rows per parallel task: enough work to amortise the task, small enough to balance.
constexpr int64_t kRowsPerTask = 8;

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
// interpolate_corners then sums the same terms in the same order as a sum that left such corners out (sampling.h's
// rule), and a non-finite pixel outside the image still adds nothing.
template <typename scalar_t, typename image_t = scalar_t>
struct Corners {
  const image_t* pixel[4];
  scalar_t weight[4];
};

// A point's value from its corners' values v0..v3 (of one channel, or a vector of channels), times m where
// `masked`: the sum each pass takes, in this order.
template <typename scalar_t, typename image_t, typename V>
inline V corner_value(const Corners<scalar_t, image_t>& k, const V& v0, const V& v1, const V& v2, const V& v3,
                      bool masked, scalar_t m) {
  V v = k.weight[0] * v0 + k.weight[1] * v1 + k.weight[2] * v2 + k.weight[3] * v3;
  if (masked) v = v * m;
  return v;
}

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
  const auto interpolate = [&](const auto& v0, const auto& v1, const auto& v2, const auto& v3) {
    return corner_value(k, v0, v1, v2, v3, masked, m);
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

// dot[q] = sum over c < len of grad[c] * pixel_q[channel + c], for the four corners, in cpu_lanes.h's
// order: the same bits on every instruction set.
template <typename scalar_t, typename image_t>
inline void corner_dots(const Corners<scalar_t, image_t>& k, int64_t channel, int64_t len,
                        const scalar_t* __restrict grad, scalar_t dot[4]) {
  const image_t* pixels[4] = {k.pixel[0] + channel, k.pixel[1] + channel, k.pixel[2] + channel,
                               k.pixel[3] + channel};
  lane_dots<4>(grad, pixels, len, dot);
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

  // Whether all four corners of point b lie in the image; if so, dst[q] = corner q's pixel in the source compute()
  // was given (of scalar_t), from channel `channel`, and k[q] = m * its weight.
  bool all_corners(int64_t b, int64_t channel, scalar_t m, scalar_t* dst[4], scalar_t k[4]) const {
    if (!(valid[0][b] && valid[1][b] && valid[2][b] && valid[3][b])) return false;
    for (int q = 0; q < 4; ++q) {
      dst[q] = reinterpret_cast<scalar_t*>(address[q][b]) + channel;
      k[q] = m * weight[q][b];
    }
    return true;
  }

  // For points b < len: d loss / d y and d x (grad_y[b], grad_x[b], with mask factor m[b]) and d loss / d value
  // before the mask's factor (grad_value[b]), from dots[q][b], the sum over the point's channels of the column's
  // gradient times corner q's values. The corners outside the image add nothing; a point outside it has 0 (its dots
  // unread), a NaN coordinate NaN; a coordinate's gradient follows sampling.h's coordinate_grad. Where each point
  // took a dozen branches after its dots, the block's points go through this together, in a loop the compiler
  // vectorises (the conditions are 32-bit masks, as in compute()): the coordinates' pass 3-16% faster, forward+
  // backward 2-4%, on the 2-core EPYC (H5, H8, G5, G6, S1; S4 and H6, depthwise, likewise). A corner left out adds
  // +0, which changes no sum that starts at +0: the same bits as adding its terms only where it lies in the image.
  void grads_of_block(int64_t len, const scalar_t* const dots[4], const scalar_t* __restrict m, BorderGradient border,
                      scalar_t* __restrict grad_y, scalar_t* __restrict grad_x,
                      scalar_t* __restrict grad_value) const {
    const int32_t mmcv = border == BorderGradient::mmcv ? -1 : 0;
    const scalar_t *__restrict d0 = dots[0], *__restrict d1 = dots[1], *__restrict d2 = dots[2];
    const scalar_t* __restrict d3 = dots[3];
    for (int64_t b = 0; b < len; ++b) {
      const scalar_t start = sum_start<scalar_t>(nan[b] != 0);
      const scalar_t hy = scalar_t(1) - ly[b], hx = scalar_t(1) - lx[b];
      // Corner q's weight and its derivatives along y and x, times its dot, added for q = 0, 1, 2, 3 in turn.
      const auto add = [](int32_t valid_q, scalar_t to, scalar_t factor, scalar_t dot) {
        return to + (valid_q ? factor * dot : scalar_t(0));
      };
      scalar_t value = start, dy = start, dx = start;
      value = add(valid[0][b], value, weight[0][b], d0[b]);
      dy = add(valid[0][b], dy, -hx, d0[b]);
      dx = add(valid[0][b], dx, -hy, d0[b]);
      value = add(valid[1][b], value, weight[1][b], d1[b]);
      dy = add(valid[1][b], dy, -lx[b], d1[b]);
      dx = add(valid[1][b], dx, hy, d1[b]);
      value = add(valid[2][b], value, weight[2][b], d2[b]);
      dy = add(valid[2][b], dy, hx, d2[b]);
      dx = add(valid[2][b], dx, -ly[b], d2[b]);
      value = add(valid[3][b], value, weight[3][b], d3[b]);
      dy = add(valid[3][b], dy, lx[b], d3[b]);
      dx = add(valid[3][b], dx, ly[b], d3[b]);
      // A point outside the image, or with BorderGradient::mmcv one at exactly y = -1 or x = -1, has no coordinate
      // gradient (sampling.h's coordinate_grad).
      const int32_t lower_y = (y0[b] == -1 ? -1 : 0) & (ly[b] == scalar_t(0) ? -1 : 0);
      const int32_t lower_x = (x0[b] == -1 ? -1 : 0) & (lx[b] == scalar_t(0) ? -1 : 0);
      const bool outside = ((~inside[b] & ~nan[b]) | (mmcv & inside[b] & (lower_y | lower_x))) != 0;
      grad_y[b] = coordinate_grad(outside, m[b], dy);
      grad_x[b] = coordinate_grad(outside, m[b], dx);
      grad_value[b] = value;
    }
  }
};

// The four corners' dots of each point of a block, tap by tap ([tap][corner][point]), kept for
// write_coordinate_grads.
template <typename scalar_t>
struct BlockDots {
  std::vector<scalar_t> dots;

  explicit BlockDots(int64_t taps) : dots(taps * 4 * kPointBlock) {}
  void set(int64_t tap, int64_t b, const scalar_t dot[4]) {
    for (int q = 0; q < 4; ++q) dots[(tap * 4 + q) * kPointBlock + b] = dot[q];
  }
  const scalar_t* of(int64_t tap, int q) const { return dots.data() + (tap * 4 + q) * kPointBlock; }
};

// `channels` zeros, kept per thread: the corners of a point that lie outside the image read them with weight 0,
// so that every point interpolates four corners in one pass, and a non-finite pixel outside the sum stays out.
template <typename scalar_t>
const scalar_t* zero_row(int64_t channels) {
  thread_local std::vector<scalar_t> zeros;
  if (static_cast<int64_t>(zeros.size()) < channels) zeros.assign(channels, scalar_t(0));
  return zeros.data();
}

// PointBlock's coordinates are 32-bit integers.
inline void check_coordinates_fit(const ConvParams& p) {
  TORCH_CHECK(std::max({p.height, p.width, p.base_y(p.out_h, p.kernel_h), p.base_x(p.out_w, p.kernel_w)}) <
                  (int64_t(1) << 30),
              "deform_conv2d: the CPU kernels take images of fewer than 2^30 rows and columns, got ", p.height, "x",
              p.width);
}

// Where tap (0, 0) of output pixels first .. first + len - 1 samples before its offset.
inline void block_origins(const ConvParams& p, int64_t first, int64_t len, int32_t* y_origin, int32_t* x_origin) {
  for (int64_t b = 0; b < len; ++b) {
    y_origin[b] = static_cast<int32_t>(p.base_y((first + b) / p.out_w, 0));
    x_origin[b] = static_cast<int32_t>(p.base_x((first + b) % p.out_w, 0));
  }
}

// How many blocks of output pixels ahead tap_points_of_group prefetches offsets and masks (one block ahead gained a
// quarter of what two did; four and eight, no more than two).
constexpr int64_t kPrefetchBlocks = 2;

// A hint to bring the cache line of values[ahead] in (it may lie past the array's end: the address is only
// computed, in integers, and a prefetch does not fault).
template <typename T>
inline void prefetch(const T* values, int64_t ahead) {
#if defined(__GNUC__)
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(values) + ahead * sizeof(T)));
#endif
}

// The points of offset group `group`, tap by tap, for output pixels first .. first + len - 1 of image n, their
// corners in `source`. The passes then visit them pixel by pixel, taps inner, so that they read and write the
// columns (and the image) nearly in order, as one point at a time did.
template <typename scalar_t>
inline void tap_points_of_group(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t n, int64_t group,
                                int64_t first, int64_t len, const int32_t* y_origin, const int32_t* x_origin,
                                const CornerSource& source, PointBlock<scalar_t>* tap_points) {
  int32_t y_base[kPointBlock], x_base[kPointBlock];
  for (int64_t i = 0, tap = 0; i < p.kernel_h; ++i) {
    for (int64_t j = 0; j < p.kernel_w; ++j, ++tap) {
      for (int64_t b = 0; b < len; ++b) {
        y_base[b] = y_origin[b] + static_cast<int32_t>(i * p.dilation_h);
        x_base[b] = x_origin[b] + static_cast<int32_t>(j * p.dilation_w);
      }
      const scalar_t* dy = in.offset + p.offset_index(n, group, tap, first);
      tap_points[tap].compute(len, y_base, x_base, dy, dy + p.out_pixels(), p.height, p.width, source);
      // Their offsets (and mask) kPrefetchBlocks blocks on: each channel is a stream of its own, too many for the
      // hardware's prefetchers (a layer of 16 channels in two offset groups, stride 2, 4 images of 113x97: forward
      // 12% faster so on an AVX2 EPYC).
      constexpr int64_t ahead = kPrefetchBlocks * kPointBlock;
      prefetch(dy, ahead);
      prefetch(dy + p.out_pixels(), ahead);
      if (in.mask != nullptr) prefetch(in.mask + p.mask_index(n, group, tap, first), ahead);
    }
  }
}

// One PointBlock per tap (kept per thread: the tiled forward fills the columns once per tile) and the block's
// origins: the passes walk their sampling points so, block by block.
template <typename scalar_t>
struct TapPoints {
  const ConvParams& p;
  const SamplingInputs<scalar_t> in;  // its offsets and mask (a copy: three pointers)
  PointBlock<scalar_t>* taps;
  int32_t y_origin[kPointBlock], x_origin[kPointBlock];

  TapPoints(const ConvParams& p_, const SamplingInputs<scalar_t>& in_) : p(p_), in(in_) {
    check_coordinates_fit(p);
    thread_local std::vector<PointBlock<scalar_t>> kept;
    if (static_cast<int64_t>(kept.size()) < p.taps()) kept.resize(p.taps());
    taps = kept.data();
  }

  // The next block: output pixels first .. first + len - 1.
  void start_block(int64_t first, int64_t len) { block_origins(p, first, len, y_origin, x_origin); }
  // taps[tap] for offset group `group` of image n in the block, their corners in `source`.
  void compute_group(int64_t n, int64_t group, int64_t first, int64_t len, const CornerSource& source) {
    tap_points_of_group(p, in, n, group, first, len, y_origin, x_origin, source, taps);
  }
  // The entries of grad_offset and grad_mask (if not null) of the block's points in compute_group's offset group
  // `group` of image n, from their dots, tap by tap (PointBlock::grads_of_block).
  void write_coordinate_grads(int64_t n, int64_t group, int64_t first, int64_t len, const BlockDots<scalar_t>& dots,
                              scalar_t* grad_offset, scalar_t* grad_mask) const {
    scalar_t ones[kPointBlock], unused[kPointBlock];
    std::fill(ones, ones + kPointBlock, scalar_t(1));
    for (int64_t tap = 0; tap < p.taps(); ++tap) {
      const scalar_t* tap_dots[4] = {dots.of(tap, 0), dots.of(tap, 1), dots.of(tap, 2), dots.of(tap, 3)};
      const int64_t at = p.offset_index(n, group, tap, first), mask_at = p.mask_index(n, group, tap, first);
      taps[tap].grads_of_block(len, tap_dots, in.mask != nullptr ? in.mask + mask_at : ones, p.border_gradient,
                               grad_offset + at, grad_offset + at + p.out_pixels(),
                               grad_mask != nullptr ? grad_mask + mask_at : unused);
    }
  }
};

}  // namespace cpu
}  // namespace deform_conv
