// Where the kernels read the points (stored, or in place from a grid's offsets or from normalised locations) and
// where the backward writes their gradients. Part of the family's CPU kernels: included by sampled_sum_cpu.cpp only
// (internal linkage), compiled in one unit with multi-scale deformable attention's CPU entry points, so its names
// differ from those.
//
// One PointSource type and one PointGrads type, which tell the ways apart at run time (once a row or a group of
// points), not a type for each way: every such type is a copy of the kernels that read through it, for each dtype
// and instruction set, and the copies cost seconds of every build.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../points.h"
#include "../sampled_sum.h"

namespace deform_conv {
namespace cpu {
namespace {

// A tensor's elements of type acc_t, or of the value's half type scalar_t (read widened, exactly): which, is known
// at run time. with_type calls f with the typed pointer, so that the loop inside f is compiled for each type.
template <typename scalar_t>
struct Elements {
  using acc_t = at::opmath_type<scalar_t>;
  const void* data;
  bool in_value_type;

  template <typename F>
  void with_type(int64_t offset, const F& f) const {
    if (in_value_type) {
      f(static_cast<const scalar_t*>(data) + offset);
    } else {
      f(static_cast<const acc_t*>(data) + offset);
    }
  }
};

template <typename scalar_t>
Elements<scalar_t> elements_of(const at::Tensor& t) {
  return {t.const_data_ptr(), t.scalar_type() != point_dtype(c10::CppTypeToScalarType<scalar_t>::value)};
}

// The points read by the forward (a row's G * K, point i = g * K + k, into x, y and weight) and the backward (the K
// points of one group of a row):
//  - stored: the points tensor [N, Q, G, K, 3];
//  - grid: in place from a grid's offsets and weights, computed as grid_points (points.cpp) computes them: base +
//    (tap + offset) * offset_scale in acc_t, the same operations in the same order (no contraction: the library is
//    compiled with -ffp-contract=off), so the same bits;
//  - levels: in place from normalised locations and weights, computed as level_points computes them: location *
//    size - 0.5 in acc_t, so the same bits. Point k's x and y are at 2 * k and 2 * k + 1 of its group's block of
//    `location_group` elements (a row holds G blocks); its weight at k of its group's K in `weights` [rows, G, K].
template <typename scalar_t>
struct PointSource {
  using acc_t = at::opmath_type<scalar_t>;
  enum class Kind { stored, grid, levels } kind;
  int64_t groups, points;
  const acc_t* stored;                                 // stored
  Elements<scalar_t> offsets, weights;                 // grid: offsets and weights; levels: locations and weights
  GridLayout layout;                                   // grid
  const acc_t *base_x, *base_y, *tap_x, *tap_y;        // grid; the taps [G * K], the K repeated for each group
  acc_t scale;                                         // grid
  int64_t out_height, out_width;                       // grid
  const acc_t *widths, *heights;                       // levels: of each point's level, [K]
  int64_t location_group;                              // levels

  // Points [first, end) of group g of `row` (all of them by default), at their indices k in x, y and weight.
  void read_group(int64_t row, int64_t g, acc_t* __restrict__ x, acc_t* __restrict__ y, acc_t* __restrict__ weight,
                  int64_t first = 0, int64_t end = -1) const {
    if (end < 0) end = points;
    switch (kind) {
      case Kind::stored: {
        const acc_t* p = stored + 3 * (row * groups + g) * points;
        for (int64_t k = first; k < end; ++k) {
          x[k] = p[3 * k];
          y[k] = p[3 * k + 1];
          weight[k] = p[3 * k + 2];
        }
        break;
      }
      case Kind::grid:
        read_grid(row, row * layout.offset_row + g * layout.offset_group,
                  row * layout.weight_row + layout.weight_start + g * layout.weight_group, first, end, x, y, weight);
        break;
      case Kind::levels: {
        offsets.with_type((row * groups + g) * location_group, [&](const auto* location) {
          for (int64_t k = first; k < end; ++k) {
            x[k] = static_cast<acc_t>(location[2 * k]) * widths[k] - acc_t(0.5);
            y[k] = static_cast<acc_t>(location[2 * k + 1]) * heights[k] - acc_t(0.5);
          }
        });
        weights.with_type((row * groups + g) * points, [&](const auto* w) {
          for (int64_t k = first; k < end; ++k) weight[k] = static_cast<acc_t>(w[k]);
        });
        break;
      }
    }
  }
  void read_row(int64_t row, acc_t* __restrict__ x, acc_t* __restrict__ y, acc_t* __restrict__ weight) const {
    if (kind == Kind::grid && layout.offset_group == 2 * points && layout.weight_group == points) {
      read_grid_row(row, x, y, weight);
      return;
    }
    for (int64_t g = 0; g < groups; ++g) read_group(row, g, x + g * points, y + g * points, weight + g * points);
  }
  // A grid whose groups' offsets and weights follow one another (DCNv3's layout): the row's G * K points in one
  // loop, vectorised across them (a group's K, 9 for 3x3, are too few for a vector).
  void read_grid_row(int64_t row, acc_t* __restrict__ x, acc_t* __restrict__ y, acc_t* __restrict__ weight) const {
    read_grid(row, row * layout.offset_row, row * layout.weight_row + layout.weight_start, 0, groups * points, x, y,
              weight);
  }
  // Points [first, end) of a grid row's block of offsets (from element offset_at) and weights (from weight_at):
  // base + (tap + offset) * offset_scale, as grid_points computes them. (The taps repeat for each group, so tap k
  // is point k's whether the block is a group's or the row's.)
  void read_grid(int64_t row, int64_t offset_at, int64_t weight_at, int64_t first, int64_t end,
                 acc_t* __restrict__ x, acc_t* __restrict__ y, acc_t* __restrict__ weight) const {
    const int64_t pixel = row % (out_height * out_width), oy = pixel / out_width, ox = pixel % out_width;
    const acc_t bx = base_x[ox], by = base_y[oy];
    offsets.with_type(offset_at, [&](const auto* offset) {
#pragma omp simd
      for (int64_t k = first; k < end; ++k) {
        x[k] = bx + (tap_x[k] + static_cast<acc_t>(offset[2 * k])) * scale;
        y[k] = by + (tap_y[k] + static_cast<acc_t>(offset[2 * k + 1])) * scale;
      }
    });
    weights.with_type(weight_at, [&](const auto* w) {
#pragma omp simd
      for (int64_t k = first; k < end; ++k) weight[k] = static_cast<acc_t>(w[k]);
    });
  }
};

// A PointSource that reads in place (grid, levels) from `offsets` (a grid's offsets, or locations) and `weights`,
// with its kind's other fields still to set.
template <typename scalar_t>
PointSource<scalar_t> in_place_points(typename PointSource<scalar_t>::Kind kind, const SampledSumSizes& s,
                                      const at::Tensor& offsets, const at::Tensor& weights) {
  PointSource<scalar_t> p{};
  p.kind = kind;
  p.groups = s.groups;
  p.points = s.points;
  p.offsets = elements_of<scalar_t>(offsets);
  p.weights = elements_of<scalar_t>(weights);
  return p;
}

template <typename scalar_t>
PointSource<scalar_t> stored_points(const at::Tensor& points, int64_t groups, int64_t count) {
  PointSource<scalar_t> p{};
  p.kind = PointSource<scalar_t>::Kind::stored;
  p.groups = groups;
  p.points = count;
  p.stored = points.const_data_ptr<at::opmath_type<scalar_t>>();
  return p;
}

// Where the backward writes a point's gradient (d x, d y, d weight):
//  - stored: into the points' gradient [N, Q, G, K, 3];
//  - grid: into the gradients of a grid's offsets and weights (in acc_t, laid out as the offsets and weights the
//    grid's PointSource reads): d x and d y times offset_scale, as grid_points_backward (points.cpp) computes them;
//  - levels: into the gradients of normalised locations [N, Q, G, K, 2] and weights [N, Q, G, K], each in acc_t or
//    in the value's half type (rounded once, as the locations and weights came): d x and d y times the size of the
//    point's level, as level_points_backward (points.cpp) computes them.
template <typename scalar_t>
struct PointGrads {
  using acc_t = at::opmath_type<scalar_t>;
  enum class Kind { stored, grid, levels } kind;
  int64_t groups, points;         // stored, levels
  acc_t* stored;                  // stored
  acc_t *offsets, *weights;       // grid
  GridLayout layout;              // grid
  acc_t scale;                    // grid
  const acc_t *widths, *heights;  // levels: of each point's level, [K]
  void *locations_out, *weights_out;                      // levels
  bool locations_in_value_type, weights_in_value_type;  // levels: scalar_t elements, else acc_t

  static void store(void* out, bool in_value_type, int64_t i, acc_t v) {
    if (in_value_type) {
      static_cast<scalar_t*>(out)[i] = static_cast<scalar_t>(v);
    } else {
      static_cast<acc_t*>(out)[i] = v;
    }
  }

  void write(int64_t row, int64_t g, int64_t k, acc_t dx, acc_t dy, acc_t dweight) const {
    switch (kind) {
      case Kind::stored: {
        acc_t* p = stored + 3 * ((row * groups + g) * points + k);
        p[0] = dx;
        p[1] = dy;
        p[2] = dweight;
        break;
      }
      case Kind::grid: {
        acc_t* offset = offsets + row * layout.offset_row + g * layout.offset_group + 2 * k;
        offset[0] = dx * scale;
        offset[1] = dy * scale;
        weights[row * layout.weight_row + layout.weight_start + g * layout.weight_group + k] = dweight;
        break;
      }
      case Kind::levels: {
        const int64_t point = (row * groups + g) * points + k;
        store(locations_out, locations_in_value_type, 2 * point, dx * widths[k]);
        store(locations_out, locations_in_value_type, 2 * point + 1, dy * heights[k]);
        store(weights_out, weights_in_value_type, point, dweight);
        break;
      }
    }
  }
};

}  // namespace
}  // namespace cpu
}  // namespace deform_conv
