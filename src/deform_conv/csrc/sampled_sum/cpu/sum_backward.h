// The backward: value's gradient by (image, group, level) task, and the points'. Part of the family's CPU kernels:
// included by sampled_sum_cpu.cpp only (internal linkage), compiled in one unit with multi-scale deformable attention's
// CPU entry points, so its names differ from those.
#pragma once

#include <ATen/OpMathType.h>

#include <algorithm>
#include <cstdint>

#include "../../cpu_kernels.h"
#include "../../cpu_lanes.h"
#include "levels.h"

namespace deform_conv {
namespace cpu {
namespace {

// For each of `corners` neighbours c: dot[c] = grad . v[c] over D channels, summed in cpu_lanes.h's fixed lanes
// (the same bits for any thread count and instruction set), and gv[c] += weight[c] * grad. The neighbours are
// distinct pixels (their gv do not overlap).
template <int corners, typename scalar_t, typename acc_t>
inline void dots_and_scatter(const acc_t* __restrict__ grad, const scalar_t* const* v, acc_t* const* gv,
                             const acc_t* weight, int64_t channels, acc_t* dot) {
  lane_dots<corners>(grad, v, channels, dot);
#pragma GCC unroll 4
  for (int c = 0; c < corners; ++c) add_scaled(weight[c], grad, channels, gv[c]);
}

// The backward of a point whose four neighbours lie in its level (interior_limits), as the general path below
// computes it for such a point (bilinear_point's weights and derivatives, the neighbours in order), without
// forming its BilinearSample.
template <typename scalar_t, typename acc_t>
inline void sum_backward_interior(acc_t x, acc_t y, acc_t w, int64_t width, const scalar_t* image,
                                  int64_t pixel_stride, int64_t channels, const acc_t* __restrict__ grad,
                                  acc_t* __restrict__ grad_slice, acc_t* grad_point /* d x, d y, d weight */) {
  const int64_t top = static_cast<int64_t>(y), left = static_cast<int64_t>(x);  // floor: both are >= 0
  const acc_t ly = y - static_cast<acc_t>(top), lx = x - static_cast<acc_t>(left);
  const acc_t hy = acc_t(1) - ly, hx = acc_t(1) - lx;
  const int64_t first = top * width + left;
  const int64_t pixel[4] = {first, first + 1, first + width, first + width + 1};
  const acc_t weight[4] = {hy * hx, hy * lx, ly * hx, ly * lx};
  const acc_t weight_dy[4] = {-hx, -lx, hx, lx};
  const acc_t weight_dx[4] = {-hy, hy, -ly, ly};
  const scalar_t* v[4];
  acc_t* gv[4];
  acc_t scatter_weight[4], dot[4];
  for (int c = 0; c < 4; ++c) {
    v[c] = image + pixel[c] * pixel_stride;
    gv[c] = grad_slice + pixel[c] * channels;
    scatter_weight[c] = w * weight[c];
  }
  dots_and_scatter<4>(grad, v, gv, scatter_weight, channels, dot);
  acc_t grad_w = 0, grad_x = 0, grad_y = 0;
  for (int c = 0; c < 4; ++c) {
    grad_w += weight[c] * dot[c];
    grad_x += weight_dx[c] * dot[c];
    grad_y += weight_dy[c] * dot[c];
  }
  grad_point[0] = w * grad_x;
  grad_point[1] = w * grad_y;
  grad_point[2] = grad_w;
}

// Tasks (image, group, level) [begin, end): the task's slice of value's gradient is summed in `grad_slice` (the
// accumulation type) and written once, rounded. `grad` holds D values, `grad_slice` the largest level's pixels * D,
// `x`, `y` and `weight` K points.
template <typename scalar_t, typename Points, typename Grads>
void sum_backward_tasks_body(const SampledSumSizes& s, const SampledLevel* levels, const int64_t* level_of_point,
                             const scalar_t* value, Points points, const scalar_t* grad_output, scalar_t* grad_value,
                             Grads point_grads, BorderGradient border, int64_t begin, int64_t end,
                             at::opmath_type<scalar_t>* __restrict__ grad,
                             at::opmath_type<scalar_t>* __restrict__ grad_slice, at::opmath_type<scalar_t>* x,
                             at::opmath_type<scalar_t>* y, at::opmath_type<scalar_t>* weight) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t channels = s.channels, pixel_stride = s.groups * s.channels;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t l = task % s.levels, g = (task / s.levels) % s.groups, n = task / (s.levels * s.groups);
    const SampledLevel& level = levels[l];
    const scalar_t* image = value + s.value_index(n, level.fits ? level.start : 0, g);
    const int64_t slice = level.fits ? level.height * level.width * channels : 0;
    for (int64_t i = 0; i < slice; ++i) grad_slice[i] = 0;
    const LevelInteriorLimits<acc_t> limits = interior_limits<acc_t>(level);
    // Only the span of points holding this level's is read (a level's points are consecutive where the points
    // come from locations or a grid: one read each, not one per level).
    int64_t first = s.points, last = 0;
    for (int64_t k = 0; k < s.points; ++k) {
      if (level_of_point[k] == l) first = std::min(first, k), last = k + 1;
    }
    for (int64_t q = 0; q < s.queries && first < last; ++q) {
      const int64_t row = n * s.queries + q;
      const scalar_t* go = grad_output + s.output_index(n, q, g);
      for (int64_t d = 0; d < channels; ++d) grad[d] = static_cast<acc_t>(go[d]);
      points.read_group(row, g, x, y, weight, first, last);
      for (int64_t k = first; k < last; ++k) {
        if (level_of_point[k] != l) continue;
        const acc_t w = weight[k];
        if ((y[k] >= acc_t(0)) & (y[k] < limits.y) & (x[k] >= acc_t(0)) & (x[k] < limits.x)) {
          acc_t grad_point[3];
          sum_backward_interior(x[k], y[k], w, level.width, image, pixel_stride, channels, grad, grad_slice,
                                grad_point);
          point_grads.write(row, g, k, grad_point[0], grad_point[1], grad_point[2]);
          continue;
        }
        const BilinearSample<acc_t> b = sample_of(x[k], y[k], level);
        // dot[c] = grad . neighbour c; d loss / d (the sample), d x and d y are sums over the neighbours of (its
        // weight, or the weight's derivative) * dot[c].
        acc_t dot[4] = {0, 0, 0, 0};
        for (int c = 0; c < b.count; ++c) {
          const scalar_t* v = image + b.pixel[c] * pixel_stride;
          acc_t* gv = grad_slice + b.pixel[c] * channels;
          const acc_t scatter_weight = w * b.weight[c];
          dots_and_scatter<1>(grad, &v, &gv, &scatter_weight, channels, &dot[c]);
        }
        acc_t grad_w = sum_start(b), grad_x = sum_start(b), grad_y = sum_start(b);
        for (int c = 0; c < b.count; ++c) {
          grad_w += b.weight[c] * dot[c];
          grad_x += b.weight_dx[c] * dot[c];
          grad_y += b.weight_dy[c] * dot[c];
        }
        point_grads.write(row, g, k, coordinate_grad(b, w, grad_x, border), coordinate_grad(b, w, grad_y, border),
                          grad_w);
      }
    }
    for (int64_t pixel = 0; pixel < slice / std::max<int64_t>(channels, 1); ++pixel) {
      scalar_t* out = grad_value + s.value_index(n, level.start + pixel, g);
      const acc_t* in = grad_slice + pixel * channels;
      for (int64_t d = 0; d < channels; ++d) out[d] = static_cast<scalar_t>(in[d]);
    }
  }
}
DC_CPU_KERNEL(sum_backward_tasks)

}  // namespace
}  // namespace cpu
}  // namespace deform_conv
