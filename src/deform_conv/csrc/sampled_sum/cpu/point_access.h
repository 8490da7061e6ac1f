// Where the kernels read the points (stored, or in place from a grid's offsets or from normalised locations) and where
// the backward writes their gradients. Part of the family's CPU kernels: included by sampled_sum_cpu.cpp only (internal
// linkage), compiled in one unit with multi-scale deformable attention's CPU kernels, so its names differ from those.
#pragma once

#include <cstdint>

#include "../points.h"

namespace deform_conv {
namespace cpu {
namespace {

// Where the forward reads a row's points (all G * K of one (image, query), point i = g * K + k) into x, y and
// weight: from the points tensor [N, Q, G, K, 3] ...
template <typename acc_t>
struct StoredPoints {
  const acc_t* data;
  int64_t groups, points;

  // The K points of group g of a row.
  void read_group(int64_t row, int64_t g, acc_t* __restrict__ x, acc_t* __restrict__ y,
                  acc_t* __restrict__ weight) const {
    const acc_t* p = data + 3 * (row * groups + g) * points;
    for (int64_t k = 0; k < points; ++k) {
      x[k] = p[3 * k];
      y[k] = p[3 * k + 1];
      weight[k] = p[3 * k + 2];
    }
  }
  void read_row(int64_t row, acc_t* x, acc_t* y, acc_t* weight) const {
    for (int64_t g = 0; g < groups; ++g) read_group(row, g, x + g * points, y + g * points, weight + g * points);
  }
};

// ... or, on a grid, from its offsets and weights (of type offset_t: acc_t, or a half value's own type) in place,
// computed as grid_points (points.cpp) computes them: base + (tap + offset) * offset_scale in acc_t, the same
// operations in the same order (no contraction: the library is compiled with -ffp-contract=off), so the same bits.
template <typename acc_t, typename offset_t>
struct GridPointReader {
  const offset_t *offsets, *weights;
  const acc_t *base_x, *base_y, *tap_x, *tap_y;
  GridLayout layout;
  acc_t scale;
  int64_t groups, points, out_height, out_width;

  void read_group(int64_t row, int64_t g, acc_t* __restrict__ x, acc_t* __restrict__ y,
                  acc_t* __restrict__ weight) const {
    const int64_t pixel = row % (out_height * out_width), oy = pixel / out_width, ox = pixel % out_width;
    const acc_t bx = base_x[ox], by = base_y[oy];
    const offset_t* offset = offsets + row * layout.offset_row + g * layout.offset_group;
    const offset_t* w = weights + row * layout.weight_row + layout.weight_start + g * layout.weight_group;
    for (int64_t k = 0; k < points; ++k) {
      x[k] = bx + (tap_x[k] + static_cast<acc_t>(offset[2 * k])) * scale;
      y[k] = by + (tap_y[k] + static_cast<acc_t>(offset[2 * k + 1])) * scale;
      weight[k] = static_cast<acc_t>(w[k]);
    }
  }
  void read_row(int64_t row, acc_t* x, acc_t* y, acc_t* weight) const {
    for (int64_t g = 0; g < groups; ++g) read_group(row, g, x + g * points, y + g * points, weight + g * points);
  }
};

// Where the backward writes a point's gradient (d x, d y, d weight): into the points' gradient [N, Q, G, K, 3] ...
template <typename acc_t>
struct StoredPointGrads {
  acc_t* data;
  int64_t groups, points;

  void write(int64_t row, int64_t g, int64_t k, acc_t dx, acc_t dy, acc_t dweight) const {
    acc_t* p = data + 3 * ((row * groups + g) * points + k);
    p[0] = dx;
    p[1] = dy;
    p[2] = dweight;
  }
};

// ... or, on a grid, into the gradients of its offsets and weights (in acc_t, laid out as the offsets and weights
// a GridPointReader reads): d x and d y times offset_scale, as grid_points_backward (points.cpp) computes them.
template <typename acc_t>
struct GridGrads {
  acc_t *offsets, *weights;
  GridLayout layout;
  acc_t scale;

  void write(int64_t row, int64_t g, int64_t k, acc_t dx, acc_t dy, acc_t dweight) const {
    acc_t* offset = offsets + row * layout.offset_row + g * layout.offset_group + 2 * k;
    offset[0] = dx * scale;
    offset[1] = dy * scale;
    weights[row * layout.weight_row + layout.weight_start + g * layout.weight_group + k] = dweight;
  }
};

// ... or, in levels, from normalised locations and weights in place (each of type acc_t, or a half value's own
// type, widened exactly as they are read), computed as level_points (points.cpp) computes them: location * size -
// 0.5 in acc_t, so the same bits. Point k's x and y are at 2 * k and 2 * k + 1 of its group's block of
// `location_group` elements (a row holds G blocks); its weight at k of its group's K in `weights` [rows, G, K].
template <typename acc_t, typename location_t, typename weight_t>
struct LevelPointReader {
  const location_t* locations;
  const weight_t* weights;
  const acc_t *widths, *heights;  // of each point's level, [K]
  int64_t groups, points, location_group;

  void read_row(int64_t row, acc_t* __restrict__ x, acc_t* __restrict__ y, acc_t* __restrict__ weight) const {
    const location_t* row_locations = locations + row * groups * location_group;
    const weight_t* row_weights = weights + row * groups * points;
    for (int64_t g = 0; g < groups; ++g) {
      const location_t* location = row_locations + g * location_group;
      acc_t *gx = x + g * points, *gy = y + g * points, *gw = weight + g * points;
      for (int64_t k = 0; k < points; ++k) {
        gx[k] = static_cast<acc_t>(location[2 * k]) * widths[k] - acc_t(0.5);
        gy[k] = static_cast<acc_t>(location[2 * k + 1]) * heights[k] - acc_t(0.5);
        gw[k] = static_cast<acc_t>(row_weights[g * points + k]);
      }
    }
  }
};

}  // namespace
}  // namespace cpu
}  // namespace deform_conv
