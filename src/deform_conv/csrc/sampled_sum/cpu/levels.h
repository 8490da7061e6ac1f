// The levels as the kernels read them on the host, and which of a level's points are interior (all four neighbours
// inside it). Part of the family's CPU kernels: included by sampled_sum_cpu.cpp only (internal linkage), compiled in
// one unit with multi-scale deformable attention's CPU entry points, so its names differ from those.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../sampled_sum.h"

namespace deform_conv {
namespace cpu {
namespace {

struct SampledLevel {
  int64_t height, width, start;
  bool fits;  // inside value's pixels (else its points sample NaN and read nothing)
};

// One call of the kernels as they read it on the host: its sizes, its levels, each point's level.
struct SampledCall {
  SampledSumSizes s;
  std::vector<SampledLevel> levels;
  std::vector<int64_t> level_of_point;  // [points]
};

std::vector<SampledLevel> read_sampled_levels(const SampledSumSizes& s, const at::Tensor& spatial_shapes,
                                              const at::Tensor& level_start_index) {
  const at::Tensor shapes = spatial_shapes.contiguous(), starts = level_start_index.contiguous();
  const int64_t* hw = shapes.const_data_ptr<int64_t>();
  const int64_t* start = starts.const_data_ptr<int64_t>();
  std::vector<SampledLevel> levels;
  for (int64_t l = 0; l < s.levels; ++l) {
    levels.push_back({hw[2 * l], hw[2 * l + 1], start[l], level_fits(start[l], hw[2 * l], hw[2 * l + 1], s.pixels)});
  }
  return levels;
}

// A call on stored points (forward, backward): each point's level from point_levels.
SampledCall stored_call(const at::Tensor& value, const at::Tensor& points, const at::Tensor& point_levels,
                        const at::Tensor& spatial_shapes, const at::Tensor& level_start_index) {
  SampledCall c;
  c.s = make_sampled_sum_sizes(value, points, point_levels, spatial_shapes, level_start_index);
  c.levels = read_sampled_levels(c.s, spatial_shapes, level_start_index);
  const at::Tensor of_point = point_levels.contiguous();
  const int64_t* level = of_point.const_data_ptr<int64_t>();
  for (int64_t k = 0; k < c.s.points; ++k) {
    TORCH_INTERNAL_ASSERT(level[k] >= 0 && level[k] < c.s.levels, "sampled_sum: a point's level out of range");
    c.level_of_point.push_back(level[k]);
  }
  return c;
}

// Whether the levels that fit lie one after another from pixel 0, without overlap, to `pixels`: then every pixel
// of value belongs to exactly one level.
bool levels_tile_pixels(std::vector<SampledLevel> levels, int64_t pixels) {
  std::sort(levels.begin(), levels.end(),
            [](const SampledLevel& a, const SampledLevel& b) { return a.start < b.start; });
  int64_t next = 0;
  for (const SampledLevel& level : levels) {
    if (!level.fits) continue;
    if (level.start != next) return false;
    next += level.height * level.width;
  }
  return next == pixels;
}

template <typename acc_t>
BilinearSample<acc_t> sample_of(acc_t x, acc_t y, const SampledLevel& level) {
  if (!level.fits) {
    BilinearSample<acc_t> nan;
    nan.nan = true;
    return nan;
  }
  return bilinear_sample(y, x, level.height, level.width);
}

// The largest x (y) of an interior point is below width - 1 (height - 1) of its level. A level that does not fit,
// or whose sides are too long to be exact in acc_t and int32, has no interior points (limit 0): its points take
// the general path.
template <typename acc_t>
struct LevelInteriorLimits {
  acc_t x, y;
};

template <typename acc_t>
LevelInteriorLimits<acc_t> interior_limits(const SampledLevel& level) {
  constexpr int64_t exact = int64_t(1) << 24;
  const bool usable = level.fits && level.height < exact && level.width < exact;
  return {usable ? static_cast<acc_t>(level.width - 1) : acc_t(0),
          usable ? static_cast<acc_t>(level.height - 1) : acc_t(0)};
}

// The same for each point i = g * K + k of a row (the forward's).
template <typename acc_t>
// With, for an interior point's reads, the element of value (of image 0) where its level and group start, and the
// elements from one row of its level to the next.
struct InteriorLimits {
  std::vector<acc_t> x, y;
  std::vector<int64_t> first, row_step;
};

template <typename acc_t>
InteriorLimits<acc_t> interior_limits(const SampledSumSizes& s, const SampledLevel* levels,
                                      const int64_t* level_of_point) {
  InteriorLimits<acc_t> limits;
  for (int64_t g = 0; g < s.groups; ++g) {
    for (int64_t k = 0; k < s.points; ++k) {
      const SampledLevel& level = levels[level_of_point[k]];
      const LevelInteriorLimits<acc_t> interior = interior_limits<acc_t>(level);
      limits.x.push_back(interior.x);
      limits.y.push_back(interior.y);
      limits.first.push_back(s.value_index(0, level.fits ? level.start : 0, g));
      limits.row_step.push_back(level.width * s.groups * s.channels);
    }
  }
  return limits;
}

}  // namespace
}  // namespace cpu
}  // namespace deform_conv
