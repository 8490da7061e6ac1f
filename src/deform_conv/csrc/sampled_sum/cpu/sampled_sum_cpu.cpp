// The family's shared kernels on the CPU (sampled_sum.h), multi-scale deformable attention's CPU backend too: every
// dtype computed natively, the half types read as they are and accumulated in float32 (at::opmath_type), the
// points in float32 (float64). Compiled in one unit with multi-scale deformable attention's CPU entry points
// (_jit/sources.py's UNIT_GROUPS), so their file-local names differ from those.
//
// Each point's neighbours and weights come from sampling.h once for all D channels of its group, the loops over
// channels are contiguous (channels are innermost) and compiled for the widest instruction set the CPU has
// (DC_CPU_DISPATCH). In the forward a point whose four neighbours lie in its level takes one pass over the
// channels for all four; the backward takes one for all four too (dots_and_scatter).
//
// The forward splits the rows (image, query) between threads; each output row is written once. The backward
// splits (image, group, level) between threads: a task owns that slice of value's gradient and the gradients of
// its level's points, and walks its queries and points in order, so every sum is taken in one fixed order: the
// gradients are bitwise the same for any thread count. No atomics.
//
// This file holds the entry points; the forward's kernel is in sum_rows.h, the backward's in sum_backward.h, where
// they read the points (and the backward writes their gradients) in point_access.h, the levels in levels.h.
#include "../sampled_sum.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../../cpu_kernels.h"
#include "levels.h"
#include "point_access.h"
#include "sum_backward.h"
#include "sum_rows.h"

namespace deform_conv {
namespace cpu {
namespace {

#define SAMPLED_SUM_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)

// The forward of a call: its output, each row summed once (sum_rows), the rows split between threads.
template <typename scalar_t>
at::Tensor sum_all_rows(const SampledCall& c, const at::Tensor& value, const PointSource<scalar_t>& points) {
  using acc_t = at::opmath_type<scalar_t>;
  const SampledSumSizes& s = c.s;
  const at::Tensor v = value.contiguous();
  at::Tensor output = value.new_empty({s.batch, s.queries, s.groups, s.channels});
  const InteriorLimits<acc_t> limits = interior_limits<acc_t>(s, c.levels.data(), c.level_of_point.data());
  const scalar_t* value_data = v.const_data_ptr<scalar_t>();
  scalar_t* out = output.mutable_data_ptr<scalar_t>();
  const int64_t grain = std::max<int64_t>(1, kSumPointsPerTask / std::max<int64_t>(1, s.groups * s.points));
  at::parallel_for(0, s.batch * s.queries, grain, [&](int64_t begin, int64_t end) {
    RowScratch<acc_t> scratch(s.channels, s.groups * s.points);
    sum_rows<scalar_t>(s, c.levels.data(), c.level_of_point.data(), &limits, value_data, points, out, begin, end,
                       &scratch);
  });
  return output;
}

at::Tensor forward(const at::Tensor& value, const at::Tensor& points, const at::Tensor& point_levels,
                   const at::Tensor& spatial_shapes, const at::Tensor& level_start_index) {
  begin_cpu_call();
  const SampledCall c = stored_call(value, points, point_levels, spatial_shapes, level_start_index);
  const at::Tensor pts = points.contiguous();
  at::Tensor output;
  SAMPLED_SUM_DISPATCH(value.scalar_type(), "sampled_sum_cpu", [&] {
    output = sum_all_rows<scalar_t>(c, value, stored_points<scalar_t>(pts, c.s.groups, c.s.points));
  });
  return output;
}

// A grid's call: its one level, and its tables (in float64, as grid_points' are).
struct GridCall : SampledCall {
  GridTables tables;
};

GridCall grid_call(const at::Tensor& value, const ConvGrid& grid, const at::Tensor& offsets,
                              const at::Tensor& weights) {
  TORCH_INTERNAL_ASSERT(value.dim() == 4 && value.size(1) == grid.height * grid.width && offsets.is_contiguous() &&
                            weights.is_contiguous() && weights.scalar_type() == offsets.scalar_type() &&
                            (offsets.scalar_type() == point_dtype(value.scalar_type()) ||
                             offsets.scalar_type() == value.scalar_type()),
                        "sampled_sum on a grid: bad arguments");
  GridCall c;
  c.s = sampled_sum_sizes(value, grid.out_height() * grid.out_width(), grid.points(), 1);
  c.levels = {{grid.height, grid.width, 0, level_fits(0, grid.height, grid.width, c.s.pixels)}};
  c.level_of_point = std::vector<int64_t>(c.s.points, 0);
  c.tables = grid_tables(grid);
  return c;
}

// The PointSource of a grid's offsets and weights (in the points' dtype, or a half value's offsets in its own
// type); `tables` holds its tables in acc_t, rounded once, as grid_points' are, the taps repeated for each group
// (so that a row's G * K points find theirs at their own index: PointSource::read_grid_row).
template <typename scalar_t>
PointSource<scalar_t> grid_source(const GridCall& c, const ConvGrid& grid, const GridLayout& layout,
                                  const at::Tensor& offsets, const at::Tensor& weights,
                                  std::vector<at::opmath_type<scalar_t>> (&tables)[4]) {
  using acc_t = at::opmath_type<scalar_t>;
  const std::vector<double>* from[4] = {&c.tables.base_x, &c.tables.base_y, &c.tables.tap_x, &c.tables.tap_y};
  for (int i = 0; i < 4; ++i) {
    const int64_t copies = i < 2 ? 1 : c.s.groups;  // the bases once, the taps for each group
    tables[i].clear();
    for (int64_t g = 0; g < copies; ++g) tables[i].insert(tables[i].end(), from[i]->begin(), from[i]->end());
  }
  PointSource<scalar_t> p = in_place_points<scalar_t>(PointSource<scalar_t>::Kind::grid, c.s, offsets, weights);
  p.layout = layout;
  p.base_x = tables[0].data();
  p.base_y = tables[1].data();
  p.tap_x = tables[2].data();
  p.tap_y = tables[3].data();
  p.scale = static_cast<acc_t>(grid.offset_scale);
  p.out_height = grid.out_height();
  p.out_width = grid.out_width();
  return p;
}

at::Tensor grid_forward(const at::Tensor& value, const ConvGrid& grid, const GridLayout& layout,
                        const at::Tensor& offsets, const at::Tensor& weights) {
  begin_cpu_call();
  const GridCall c = grid_call(value, grid, offsets, weights);
  at::Tensor output;
  SAMPLED_SUM_DISPATCH(value.scalar_type(), "sampled_sum_grid_cpu", [&] {
    std::vector<at::opmath_type<scalar_t>> tables[4];
    output = sum_all_rows<scalar_t>(c, value, grid_source<scalar_t>(c, grid, layout, offsets, weights, tables));
  });
  return output;
}

// A call on points in levels read in place from normalised locations.
SampledCall level_call(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                const at::Tensor& level_start_index, const at::Tensor& locations,
                                const at::Tensor& weights, int64_t points_per_level) {
  TORCH_INTERNAL_ASSERT(value.dim() == 4 && locations.dim() == 4 && weights.dim() == 4 && locations.is_contiguous() &&
                            weights.is_contiguous() &&
                            (locations.scalar_type() == point_dtype(value.scalar_type()) ||
                             locations.scalar_type() == value.scalar_type()) &&
                            (weights.scalar_type() == point_dtype(value.scalar_type()) ||
                             weights.scalar_type() == value.scalar_type()) &&
                            points_per_level >= 0 && weights.size(3) == spatial_shapes.size(0) * points_per_level &&
                            locations.size(3) >= 2 * weights.size(3) && weights.size(0) == value.size(0) &&
                            weights.size(2) == value.size(2) && locations.size(0) == value.size(0) &&
                            locations.size(1) == weights.size(1) && locations.size(2) == value.size(2),
                        "sampled_sum on levels: bad arguments");
  SampledCall c;
  c.s = sampled_sum_sizes(value, weights.size(1), weights.size(3), spatial_shapes.size(0));
  c.levels = read_sampled_levels(c.s, spatial_shapes, level_start_index);
  for (int64_t k = 0; k < c.s.points; ++k) c.level_of_point.push_back(k / points_per_level);
  return c;
}

// The sizes of each point's level in acc_t, as level_points' per-point sizes: the int64 sizes rounded to acc_t.
template <typename acc_t>
struct PointLevelSizes {
  std::vector<acc_t> widths, heights;
  explicit PointLevelSizes(const SampledCall& c) {
    for (const int64_t level : c.level_of_point) {
      widths.push_back(static_cast<acc_t>(c.levels[level].width));
      heights.push_back(static_cast<acc_t>(c.levels[level].height));
    }
  }
};

// The PointSource of normalised locations and weights (in the points' dtype, or the value's half type).
template <typename scalar_t>
PointSource<scalar_t> level_source(const SampledCall& c, const at::Tensor& locations, const at::Tensor& weights,
                                   const PointLevelSizes<at::opmath_type<scalar_t>>& sizes) {
  PointSource<scalar_t> p = in_place_points<scalar_t>(PointSource<scalar_t>::Kind::levels, c.s, locations, weights);
  p.widths = sizes.widths.data();
  p.heights = sizes.heights.data();
  p.location_group = locations.size(3);
  return p;
}

at::Tensor level_forward(const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                         const at::Tensor& locations, const at::Tensor& weights, int64_t points_per_level) {
  begin_cpu_call();
  const SampledCall c = level_call(value, spatial_shapes, level_start_index, locations, weights, points_per_level);
  at::Tensor output;
  SAMPLED_SUM_DISPATCH(value.scalar_type(), "sampled_sum_level_cpu", [&] {
    const PointLevelSizes<at::opmath_type<scalar_t>> sizes(c);
    output = sum_all_rows<scalar_t>(c, value, level_source<scalar_t>(c, locations, weights, sizes));
  });
  return output;
}

// Value's gradient, for sampled_backward_tasks to fill: each task writes its level's pixels once; where the levels
// do not tile value's pixels (never, where the ops' checks hold), the pixels outside every level keep a zero.
at::Tensor new_value_grad(const SampledCall& c, const at::Tensor& value) {
  return levels_tile_pixels(c.levels, c.s.pixels) ? value.new_empty(value.sizes()) : value.new_zeros(value.sizes());
}

// Value's gradient into grad_value (every element of the levels' pixels written once) and the points' through
// point_grads: tasks (image, group, level) split between threads.
template <typename scalar_t>
void sampled_backward_tasks(const SampledCall& c, const scalar_t* value, const PointSource<scalar_t>& points,
                            const scalar_t* grad_output, scalar_t* grad_value, const PointGrads<scalar_t>& point_grads,
                            BorderGradient border) {
  using acc_t = at::opmath_type<scalar_t>;
  const SampledSumSizes& s = c.s;
  int64_t largest = 0;
  for (const SampledLevel& level : c.levels) {
    if (level.fits) largest = std::max(largest, level.height * level.width);
  }
  at::parallel_for(0, s.batch * s.groups * s.levels, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> grad(s.channels), grad_slice(largest * s.channels), x(s.points), y(s.points), w(s.points);
    sum_backward_tasks<scalar_t>(s, c.levels.data(), c.level_of_point.data(), value, points, grad_output, grad_value,
                                 point_grads, border, begin, end, grad.data(), grad_slice.data(), x.data(), y.data(),
                                 w.data());
  });
}

std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& grad_output, const at::Tensor& value,
                                            const at::Tensor& points, const at::Tensor& point_levels,
                                            const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                                            BorderGradient border) {
  begin_cpu_call();
  const SampledCall c = stored_call(value, points, point_levels, spatial_shapes, level_start_index);
  const SampledSumSizes& s = c.s;
  const at::Tensor v = value.contiguous(), pts = points.contiguous(), g = grad_output.contiguous();
  at::Tensor grad_value = new_value_grad(c, value);
  // Every element is written once (sum_backward_tasks): each point belongs to one level.
  at::Tensor grad_points = pts.new_empty(pts.sizes());
  SAMPLED_SUM_DISPATCH(value.scalar_type(), "sampled_sum_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    sampled_backward_tasks<scalar_t>(c, v.const_data_ptr<scalar_t>(),
                                     stored_points<scalar_t>(pts, s.groups, s.points), g.const_data_ptr<scalar_t>(),
                                     grad_value.mutable_data_ptr<scalar_t>(),
                                     PointGrads<scalar_t>{PointGrads<scalar_t>::Kind::stored, s.groups, s.points,
                                                          grad_points.mutable_data_ptr<acc_t>()},
                                     border);
  });
  return {grad_value, grad_points};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grid_backward(const at::Tensor& grad_output, const at::Tensor& value,
                                                             const ConvGrid& grid, const GridLayout& layout,
                                                             const at::Tensor& offsets, const at::Tensor& weights,
                                                             BorderGradient border) {
  begin_cpu_call();
  const GridCall c = grid_call(value, grid, offsets, weights);
  const SampledSumSizes& s = c.s;
  const at::Tensor v = value.contiguous(), g = grad_output.contiguous();
  at::Tensor grad_value = new_value_grad(c, value);
  // Every offset and weight is written once; one tensor holding both (DCNv4's) may hold more, which stays 0.
  const at::TensorOptions options = offsets.options().dtype(point_dtype(value.scalar_type()));
  const bool one_tensor = offsets.is_same(weights);
  at::Tensor grad_offsets =
      one_tensor ? offsets.new_zeros(offsets.sizes(), options) : offsets.new_empty(offsets.sizes(), options);
  at::Tensor grad_weights = one_tensor ? grad_offsets : weights.new_empty(weights.sizes(), options);
  SAMPLED_SUM_DISPATCH(value.scalar_type(), "sampled_sum_grid_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const PointGrads<scalar_t> grads{PointGrads<scalar_t>::Kind::grid, 0, 0, nullptr,
                                     grad_offsets.mutable_data_ptr<acc_t>(), grad_weights.mutable_data_ptr<acc_t>(),
                                     layout, static_cast<acc_t>(grid.offset_scale)};
    std::vector<acc_t> tables[4];
    sampled_backward_tasks<scalar_t>(c, v.const_data_ptr<scalar_t>(),
                                     grid_source<scalar_t>(c, grid, layout, offsets, weights, tables),
                                     g.const_data_ptr<scalar_t>(), grad_value.mutable_data_ptr<scalar_t>(), grads,
                                     border);
  });
  return {grad_value, grad_offsets, grad_weights};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> level_backward(const at::Tensor& grad_output, const at::Tensor& value,
                                                              const at::Tensor& spatial_shapes,
                                                              const at::Tensor& level_start_index,
                                                              const at::Tensor& locations, const at::Tensor& weights,
                                                              int64_t points_per_level, BorderGradient border) {
  begin_cpu_call();
  const SampledCall c = level_call(value, spatial_shapes, level_start_index, locations, weights, points_per_level);
  const SampledSumSizes& s = c.s;
  TORCH_INTERNAL_ASSERT(grad_output.sizes() == at::IntArrayRef({s.batch, s.queries, s.groups, s.channels}) &&
                            grad_output.scalar_type() == value.scalar_type(),
                        "sampled_sum level_backward: bad grad_output");
  const at::Tensor v = value.contiguous(), g = grad_output.contiguous();
  at::Tensor grad_value = new_value_grad(c, value);
  // Each in its argument's dtype (no widened copy of a half type's); every element written once: each point
  // belongs to one level.
  at::Tensor grad_locations = locations.new_empty({s.batch, s.queries, s.groups, 2 * s.points});
  at::Tensor grad_weights = weights.new_empty(weights.sizes());
  SAMPLED_SUM_DISPATCH(value.scalar_type(), "sampled_sum_level_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const PointLevelSizes<acc_t> sizes(c);
    PointGrads<scalar_t> grads{};
    grads.kind = PointGrads<scalar_t>::Kind::levels;
    grads.groups = s.groups;
    grads.points = s.points;
    grads.widths = sizes.widths.data();
    grads.heights = sizes.heights.data();
    grads.locations_out = grad_locations.mutable_data_ptr();
    grads.weights_out = grad_weights.mutable_data_ptr();
    grads.locations_in_value_type = elements_of<scalar_t>(locations).in_value_type;
    grads.weights_in_value_type = elements_of<scalar_t>(weights).in_value_type;
    sampled_backward_tasks<scalar_t>(c, v.const_data_ptr<scalar_t>(),
                                     level_source<scalar_t>(c, locations, weights, sizes),
                                     g.const_data_ptr<scalar_t>(), grad_value.mutable_data_ptr<scalar_t>(), grads,
                                     border);
  });
  return {grad_value, grad_locations, grad_weights};
}

}  // namespace

const SampledSumKernels& sampled_sum_kernels() {
  static const SampledSumKernels kernels{forward, backward, grid_forward, grid_backward, level_forward,
                                                level_backward};
  return kernels;
}

}  // namespace cpu
}  // namespace deform_conv
