// The family's shared kernels on the CPU (sampled_sum.h): every dtype computed natively, the half types read as
// they are and accumulated in float32 (at::opmath_type), the points in float32 (float64). Compiled in one unit
// with multi-scale deformable attention's CPU kernels (_jit/sources.py's UNIT_GROUPS), so their file-local names
// differ from those.
//
// As multi-scale deformable attention's CPU kernels (csrc/ms_deform_attn/cpu/): each point's neighbours and
// weights come from sampling.h once for all D channels of its group, the loops over channels are contiguous
// (channels are innermost) and compiled for the widest instruction set the CPU has (DC_CPU_DISPATCH), and a point
// whose four neighbours lie in its level takes one pass over the channels for all four.
//
// The forward splits the rows (image, query) between threads; each output row is written once. The backward
// splits (image, group, level) between threads: a task owns that slice of value's gradient and the gradients of
// its level's points, and walks its queries and points in order, so every sum is taken in one fixed order: the
// gradients are bitwise the same for any thread count. No atomics.
#include "../sampled_sum.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../../cpu_kernels.h"

namespace deform_conv {
namespace cpu {
namespace {

struct SampledLevel {
  int64_t height, width, start;
  bool fits;  // inside value's pixels (else its points sample NaN and read nothing)
};

// The tables a kernel reads on the host: each point's level, and the levels.
struct SampledLevels {
  std::vector<SampledLevel> levels;
  std::vector<int64_t> of_point;  // [points]
};

std::vector<SampledLevel> read_levels(const SampledSumSizes& s, const at::Tensor& spatial_shapes,
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

SampledLevels read_sum_levels(const SampledSumSizes& s, const at::Tensor& point_levels,
                              const at::Tensor& spatial_shapes, const at::Tensor& level_start_index) {
  const at::Tensor of_point = point_levels.contiguous();
  SampledLevels t{read_levels(s, spatial_shapes, level_start_index), {}};
  const int64_t* level = of_point.const_data_ptr<int64_t>();
  for (int64_t k = 0; k < s.points; ++k) {
    TORCH_INTERNAL_ASSERT(level[k] >= 0 && level[k] < s.levels, "sampled_sum: a point's level out of range");
    t.of_point.push_back(level[k]);
  }
  return t;
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

// Where the forward reads a row's points (all G * K of one (image, query), point i = g * K + k) into x, y and
// weight: from the points tensor [N, Q, G, K, 3] ...
template <typename acc_t>
struct StoredPoints {
  const acc_t* data;
  int64_t groups, points;

  void read_row(int64_t row, acc_t* __restrict__ x, acc_t* __restrict__ y, acc_t* __restrict__ weight) const {
    const acc_t* p = data + 3 * row * groups * points;
    for (int64_t i = 0; i < groups * points; ++i) {
      x[i] = p[3 * i];
      y[i] = p[3 * i + 1];
      weight[i] = p[3 * i + 2];
    }
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

  void read_row(int64_t row, acc_t* __restrict__ x, acc_t* __restrict__ y, acc_t* __restrict__ weight) const {
    const int64_t pixel = row % (out_height * out_width), oy = pixel / out_width, ox = pixel % out_width;
    const acc_t bx = base_x[ox], by = base_y[oy];
    const offset_t* row_offsets = offsets + row * layout.offset_row;
    const offset_t* row_weights = weights + row * layout.weight_row + layout.weight_start;
    for (int64_t g = 0; g < groups; ++g) {
      const offset_t* offset = row_offsets + g * layout.offset_group;
      const offset_t* w = row_weights + g * layout.weight_group;
      acc_t *gx = x + g * points, *gy = y + g * points, *gw = weight + g * points;
      for (int64_t k = 0; k < points; ++k) {
        gx[k] = bx + (tap_x[k] + static_cast<acc_t>(offset[2 * k])) * scale;
        gy[k] = by + (tap_y[k] + static_cast<acc_t>(offset[2 * k + 1])) * scale;
        gw[k] = static_cast<acc_t>(w[k]);
      }
    }
  }
};

// ... or, in levels, from normalised locations (of type location_t: acc_t, or a half value's own type) and the
// weights in place, computed as level_points (points.cpp) computes them: location * size - 0.5 in acc_t, so the
// same bits. Point k's x and y are at 2 * k and 2 * k + 1 of its group's block of `location_group` elements (a
// row holds G blocks); its weight at k of its group's K in `weights` [rows, G, K].
template <typename acc_t, typename location_t>
struct LevelPointReader {
  const location_t* locations;
  const acc_t *weights, *widths, *heights;  // widths and heights: of each point's level, [K]
  int64_t groups, points, location_group;

  void read_row(int64_t row, acc_t* __restrict__ x, acc_t* __restrict__ y, acc_t* __restrict__ weight) const {
    const location_t* row_locations = locations + row * groups * location_group;
    const acc_t* row_weights = weights + row * groups * points;
    for (int64_t g = 0; g < groups; ++g) {
      const location_t* location = row_locations + g * location_group;
      acc_t *gx = x + g * points, *gy = y + g * points, *gw = weight + g * points;
      for (int64_t k = 0; k < points; ++k) {
        gx[k] = static_cast<acc_t>(location[2 * k]) * widths[k] - acc_t(0.5);
        gy[k] = static_cast<acc_t>(location[2 * k + 1]) * heights[k] - acc_t(0.5);
        gw[k] = row_weights[g * points + k];
      }
    }
  }
};

// About this many sampling points (times D channels) a task: enough to outweigh a task's cost.
constexpr int64_t kSumPointsPerTask = 2048;

// The forward's per-row scratch, over the row's G * K points: the points, and for each point whose four
// neighbours lie in its level and whose weight is finite (an interior point), its top-left neighbour and the
// weight times each neighbour's bilinear weight. Computed for all the row's points at once, in loops the compiler
// vectorises across points: a point's own arithmetic, not its D channels, is most of the forward's work when D is
// small (16 in every InternImage layer).
template <typename acc_t>
struct RowScratch {
  std::vector<acc_t> sum, sample, x, y, weight, c0, c1, c2, c3;
  std::vector<int32_t> x0, y0, interior;
  RowScratch(int64_t channels, int64_t row_points)
      : sum(channels), sample(channels), x(row_points), y(row_points), weight(row_points), c0(row_points),
        c1(row_points), c2(row_points), c3(row_points), x0(row_points), y0(row_points), interior(row_points) {}
};

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
struct InteriorLimits {
  std::vector<acc_t> x, y;
};

template <typename acc_t>
InteriorLimits<acc_t> interior_limits(const SampledSumSizes& s, const SampledLevel* levels,
                                      const int64_t* level_of_point) {
  InteriorLimits<acc_t> limits;
  for (int64_t g = 0; g < s.groups; ++g) {
    for (int64_t k = 0; k < s.points; ++k) {
      const LevelInteriorLimits<acc_t> level = interior_limits<acc_t>(levels[level_of_point[k]]);
      limits.x.push_back(level.x);
      limits.y.push_back(level.y);
    }
  }
  return limits;
}

// For every point of the row (read into r.x, r.y, r.weight): whether it is interior, and if so its neighbours'
// coefficients, computed as bilinear_point's weights times the point's weight: the same operations, the same bits.
template <typename acc_t>
void prepare_row(int64_t row_points, const acc_t* __restrict__ limit_x,
                 const acc_t* __restrict__ limit_y, RowScratch<acc_t>& r) {
  const acc_t *__restrict__ xs = r.x.data(), *__restrict__ ys = r.y.data(), *__restrict__ ws = r.weight.data();
  acc_t *__restrict__ c0 = r.c0.data(), *__restrict__ c1 = r.c1.data(), *__restrict__ c2 = r.c2.data(),
        *__restrict__ c3 = r.c3.data();
  int32_t *__restrict__ x0 = r.x0.data(), *__restrict__ y0 = r.y0.data(), *__restrict__ interior = r.interior.data();
#pragma omp simd
  for (int64_t i = 0; i < row_points; ++i) {
    const acc_t x = xs[i], y = ys[i], w = ws[i];
    // False for NaN; floor(y) >= 0 and floor(y) + 1 < height, i.e. 0 <= y < height - 1, and likewise x.
    const bool inside = (y >= acc_t(0)) & (y < limit_y[i]) & (x >= acc_t(0)) & (x < limit_x[i]) &
                        (std::abs(w) <= std::numeric_limits<acc_t>::max());
    // An interior point's coordinates are >= 0 and below 2^24: truncation is its floor, exactly.
    const int32_t top = static_cast<int32_t>(inside ? y : acc_t(0)), left = static_cast<int32_t>(inside ? x : acc_t(0));
    const acc_t ly = y - static_cast<acc_t>(top), lx = x - static_cast<acc_t>(left);
    const acc_t hy = acc_t(1) - ly, hx = acc_t(1) - lx;
    c0[i] = w * (hy * hx);
    c1[i] = w * (hy * lx);
    c2[i] = w * (ly * hx);
    c3[i] = w * (ly * lx);
    y0[i] = top;
    x0[i] = left;
    interior[i] = inside;
  }
}

// Output rows (image, query) [begin, end).
template <typename scalar_t, typename Points>
void sum_rows_body(const SampledSumSizes& s, const SampledLevel* levels, const int64_t* level_of_point,
                   const at::opmath_type<scalar_t>* limit_x, const at::opmath_type<scalar_t>* limit_y,
                   const scalar_t* value, Points points, scalar_t* output, int64_t begin, int64_t end,
                   RowScratch<at::opmath_type<scalar_t>>* scratch) {
  using acc_t = at::opmath_type<scalar_t>;
  RowScratch<acc_t>& r = *scratch;
  acc_t* __restrict__ sum = r.sum.data();
  acc_t* __restrict__ sample = r.sample.data();
  const int64_t channels = s.channels, pixel_stride = s.groups * s.channels;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t n = row / s.queries, q = row % s.queries;
    points.read_row(row, r.x.data(), r.y.data(), r.weight.data());
    prepare_row(s.groups * s.points, limit_x, limit_y, r);
    for (int64_t g = 0; g < s.groups; ++g) {
      for (int64_t d = 0; d < channels; ++d) sum[d] = 0;
      for (int64_t k = 0; k < s.points; ++k) {
        const int64_t i = g * s.points + k;
        const SampledLevel& level = levels[level_of_point[k]];
        const scalar_t* image = value + s.value_index(n, level.fits ? level.start : 0, g);
        if (r.interior[i]) {
          // All four neighbours in the level, a finite weight: one pass, the weight folded into the bilinear
          // weights. (Elsewhere the sample is formed first, so that an infinite weight times a sample of 0 is NaN.)
          const scalar_t* __restrict__ v0 = image + (int64_t(r.y0[i]) * level.width + r.x0[i]) * pixel_stride;
          const scalar_t* __restrict__ v1 = v0 + pixel_stride;
          const scalar_t* __restrict__ v2 = v0 + level.width * pixel_stride;
          const scalar_t* __restrict__ v3 = v2 + pixel_stride;
          const acc_t c0 = r.c0[i], c1 = r.c1[i], c2 = r.c2[i], c3 = r.c3[i];
          // sum is the task's scratch, never one of the value's pixels: no need to check that they overlap.
#pragma omp simd
          for (int64_t d = 0; d < channels; ++d) {
            sum[d] += c0 * static_cast<acc_t>(v0[d]) + c1 * static_cast<acc_t>(v1[d]) +
                      c2 * static_cast<acc_t>(v2[d]) + c3 * static_cast<acc_t>(v3[d]);
          }
          continue;
        }
        const BilinearSample<acc_t> b = sample_of(r.x[i], r.y[i], level);
        const acc_t w = r.weight[i];
        if (b.count == 4 && std::isfinite(w)) {  // interior, in a level too large for the prepared path
          const acc_t c[4] = {w * b.weight[0], w * b.weight[1], w * b.weight[2], w * b.weight[3]};
          const scalar_t* __restrict__ v0 = image + b.pixel[0] * pixel_stride;
          const scalar_t* __restrict__ v1 = image + b.pixel[1] * pixel_stride;
          const scalar_t* __restrict__ v2 = image + b.pixel[2] * pixel_stride;
          const scalar_t* __restrict__ v3 = image + b.pixel[3] * pixel_stride;
          for (int64_t d = 0; d < channels; ++d) {
            sum[d] += c[0] * static_cast<acc_t>(v0[d]) + c[1] * static_cast<acc_t>(v1[d]) +
                      c[2] * static_cast<acc_t>(v2[d]) + c[3] * static_cast<acc_t>(v3[d]);
          }
          continue;
        }
        // Per channel: the sample from start and the neighbours in order, then times the weight, as a loop over
        // channels for each neighbour.
        const acc_t start = sum_start(b);
        for (int64_t d = 0; d < channels; ++d) sample[d] = start;
        for (int c = 0; c < b.count; ++c) {
          const scalar_t* __restrict__ v = image + b.pixel[c] * pixel_stride;
          const acc_t weight = b.weight[c];
#pragma omp simd
          for (int64_t d = 0; d < channels; ++d) sample[d] += weight * static_cast<acc_t>(v[d]);
        }
#pragma omp simd
        for (int64_t d = 0; d < channels; ++d) sum[d] += w * sample[d];
      }
      scalar_t* out = output + s.output_index(n, q, g);
      for (int64_t d = 0; d < channels; ++d) out[d] = static_cast<scalar_t>(sum[d]);
    }
  }
}
DC_CPU_KERNEL(sum_rows)

// grad . v over D channels, returned, and gv += weight * grad. The products are summed in vector partial sums,
// added in an order fixed for each instruction set: the same bits for any thread count.
template <typename scalar_t, typename acc_t>
inline acc_t dot_and_scatter(const acc_t* __restrict__ grad, const scalar_t* __restrict__ v, acc_t* __restrict__ gv,
                             acc_t weight, int64_t channels) {
  acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < channels; ++d) {
    sum += grad[d] * static_cast<acc_t>(v[d]);
    gv[d] += weight * grad[d];
  }
  return sum;
}

// The backward of a point whose four neighbours lie in its level (interior_limits), as the general path below
// computes it for such a point (bilinear_point's weights and derivatives, the neighbours in order), without
// forming its BilinearSample.
template <typename scalar_t, typename acc_t>
inline void sum_backward_interior(acc_t x, acc_t y, acc_t w, int64_t width, const scalar_t* image,
                                  int64_t pixel_stride, int64_t channels, const acc_t* __restrict__ grad,
                                  acc_t* __restrict__ grad_slice, acc_t* grad_point) {
  const int64_t top = static_cast<int64_t>(y), left = static_cast<int64_t>(x);  // floor: both are >= 0
  const acc_t ly = y - static_cast<acc_t>(top), lx = x - static_cast<acc_t>(left);
  const acc_t hy = acc_t(1) - ly, hx = acc_t(1) - lx;
  const int64_t first = top * width + left;
  const int64_t pixel[4] = {first, first + 1, first + width, first + width + 1};
  const acc_t weight[4] = {hy * hx, hy * lx, ly * hx, ly * lx};
  const acc_t weight_dy[4] = {-hx, -lx, hx, lx};
  const acc_t weight_dx[4] = {-hy, hy, -ly, ly};
  acc_t grad_w = 0, grad_x = 0, grad_y = 0;
  for (int c = 0; c < 4; ++c) {
    const acc_t dot = dot_and_scatter(grad, image + pixel[c] * pixel_stride, grad_slice + pixel[c] * channels,
                                      w * weight[c], channels);
    grad_w += weight[c] * dot;
    grad_x += weight_dx[c] * dot;
    grad_y += weight_dy[c] * dot;
  }
  grad_point[0] = w * grad_x;
  grad_point[1] = w * grad_y;
  grad_point[2] = grad_w;
}

// Tasks (image, group, level) [begin, end): the task's slice of value's gradient is summed in `grad_slice` (the
// accumulation type) and written once, rounded. `grad` holds D values, `grad_slice` the largest level's pixels * D.
template <typename scalar_t>
void sum_backward_tasks_body(const SampledSumSizes& s, const SampledLevel* levels, const int64_t* level_of_point,
                         const scalar_t* value, const at::opmath_type<scalar_t>* points, const scalar_t* grad_output,
                         scalar_t* grad_value, at::opmath_type<scalar_t>* grad_points, BorderGradient border,
                         int64_t begin, int64_t end, at::opmath_type<scalar_t>* __restrict__ grad,
                         at::opmath_type<scalar_t>* __restrict__ grad_slice) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t channels = s.channels, pixel_stride = s.groups * s.channels;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t l = task % s.levels, g = (task / s.levels) % s.groups, n = task / (s.levels * s.groups);
    const SampledLevel& level = levels[l];
    const scalar_t* image = value + s.value_index(n, level.fits ? level.start : 0, g);
    const int64_t slice = level.fits ? level.height * level.width * channels : 0;
    for (int64_t i = 0; i < slice; ++i) grad_slice[i] = 0;
    const LevelInteriorLimits<acc_t> limits = interior_limits<acc_t>(level);
    for (int64_t q = 0; q < s.queries; ++q) {
      const scalar_t* go = grad_output + s.output_index(n, q, g);
      for (int64_t d = 0; d < channels; ++d) grad[d] = static_cast<acc_t>(go[d]);
      for (int64_t k = 0; k < s.points; ++k) {
        if (level_of_point[k] != l) continue;
        const int64_t point = s.point_index(n, q, g, k);
        const acc_t x = points[3 * point], y = points[3 * point + 1], w = points[3 * point + 2];
        if ((y >= acc_t(0)) & (y < limits.y) & (x >= acc_t(0)) & (x < limits.x)) {
          sum_backward_interior(x, y, w, level.width, image, pixel_stride, channels, grad, grad_slice,
                                grad_points + 3 * point);
          continue;
        }
        const BilinearSample<acc_t> b = sample_of(x, y, level);
        // dot[c] = grad . neighbour c; d loss / d (the sample), d x and d y are sums over the neighbours of (its
        // weight, or the weight's derivative) * dot[c].
        acc_t dot[4] = {0, 0, 0, 0};
        for (int c = 0; c < b.count; ++c) {
          dot[c] = dot_and_scatter(grad, image + b.pixel[c] * pixel_stride, grad_slice + b.pixel[c] * channels,
                                   w * b.weight[c], channels);
        }
        acc_t grad_w = sum_start(b), grad_x = sum_start(b), grad_y = sum_start(b);
        for (int c = 0; c < b.count; ++c) {
          grad_w += b.weight[c] * dot[c];
          grad_x += b.weight_dx[c] * dot[c];
          grad_y += b.weight_dy[c] * dot[c];
        }
        grad_points[3 * point] = coordinate_grad(b, w, grad_x, border);
        grad_points[3 * point + 1] = coordinate_grad(b, w, grad_y, border);
        grad_points[3 * point + 2] = grad_w;
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

#define SAMPLED_SUM_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)

at::Tensor forward(const at::Tensor& value, const at::Tensor& points, const at::Tensor& point_levels,
                   const at::Tensor& spatial_shapes, const at::Tensor& level_start_index) {
  follow_torch_thread_count();
  const SampledSumSizes s = make_sampled_sum_sizes(value, points, point_levels, spatial_shapes, level_start_index);
  const SampledLevels t = read_sum_levels(s, point_levels, spatial_shapes, level_start_index);
  const at::Tensor v = value.contiguous(), pts = points.contiguous();
  at::Tensor output = at::empty({s.batch, s.queries, s.groups, s.channels}, value.options());
  const int64_t grain = std::max<int64_t>(1, kSumPointsPerTask / std::max<int64_t>(1, s.groups * s.points));
  SAMPLED_SUM_DISPATCH(value.scalar_type(), "sampled_sum_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* value_data = v.const_data_ptr<scalar_t>();
    const acc_t* point_data = pts.const_data_ptr<acc_t>();
    scalar_t* out = output.mutable_data_ptr<scalar_t>();
    const StoredPoints<acc_t> stored{point_data, s.groups, s.points};
    const InteriorLimits<acc_t> limits = interior_limits<acc_t>(s, t.levels.data(), t.of_point.data());
    at::parallel_for(0, s.batch * s.queries, grain, [&](int64_t begin, int64_t end) {
      RowScratch<acc_t> scratch(s.channels, s.groups * s.points);
      sum_rows<scalar_t>(s, t.levels.data(), t.of_point.data(), limits.x.data(), limits.y.data(), value_data,
                         stored, out, begin, end, &scratch);
    });
  });
  return output;
}

at::Tensor grid_forward(const at::Tensor& value, const ConvGrid& grid, const GridLayout& layout,
                        const at::Tensor& offsets, const at::Tensor& weights) {
  follow_torch_thread_count();
  TORCH_INTERNAL_ASSERT(value.dim() == 4 && value.size(1) == grid.height * grid.width && offsets.is_contiguous() &&
                            weights.is_contiguous() && weights.scalar_type() == offsets.scalar_type() &&
                            (offsets.scalar_type() == point_dtype(value.scalar_type()) ||
                             offsets.scalar_type() == value.scalar_type()),
                        "sampled_sum grid_forward: bad arguments");
  SampledSumSizes s{};
  s.batch = value.size(0);
  s.pixels = value.size(1);
  s.groups = value.size(2);
  s.channels = value.size(3);
  s.queries = grid.out_height() * grid.out_width();
  s.points = grid.points();
  s.levels = 1;
  const std::vector<SampledLevel> levels{{grid.height, grid.width, 0, true}};
  const std::vector<int64_t> level_of_point(s.points, 0);
  const GridTables tables = grid_tables(grid);
  const at::Tensor v = value.contiguous();
  at::Tensor output = at::empty({s.batch, s.queries, s.groups, s.channels}, value.options());
  const int64_t grain = std::max<int64_t>(1, kSumPointsPerTask / std::max<int64_t>(1, s.groups * s.points));
  SAMPLED_SUM_DISPATCH(value.scalar_type(), "sampled_sum_grid_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto in_acc = [](const std::vector<double>& table) {
      return std::vector<acc_t>(table.begin(), table.end());  // rounded once, as grid_points' tables
    };
    const std::vector<acc_t> base_x = in_acc(tables.base_x), base_y = in_acc(tables.base_y);
    const std::vector<acc_t> tap_x = in_acc(tables.tap_x), tap_y = in_acc(tables.tap_y);
    const InteriorLimits<acc_t> limits = interior_limits<acc_t>(s, levels.data(), level_of_point.data());
    const scalar_t* value_data = v.const_data_ptr<scalar_t>();
    scalar_t* out = output.mutable_data_ptr<scalar_t>();
    const auto run = [&](auto offsets_of_type) {
      using offset_t = decltype(offsets_of_type);
      const GridPointReader<acc_t, offset_t> reader{
          offsets.const_data_ptr<offset_t>(), weights.const_data_ptr<offset_t>(), base_x.data(), base_y.data(),
          tap_x.data(), tap_y.data(), layout, static_cast<acc_t>(grid.offset_scale), s.groups, s.points,
          grid.out_height(), grid.out_width()};
      at::parallel_for(0, s.batch * s.queries, grain, [&](int64_t begin, int64_t end) {
        RowScratch<acc_t> scratch(s.channels, s.groups * s.points);
        sum_rows<scalar_t>(s, levels.data(), level_of_point.data(), limits.x.data(), limits.y.data(), value_data,
                           reader, out, begin, end, &scratch);
      });
    };
    if (offsets.scalar_type() == point_dtype(value.scalar_type())) {
      run(acc_t(0));
    } else if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      run(scalar_t(0));  // a half value's offsets in its own type, widened exactly as they are read
    }
  });
  return output;
}

at::Tensor level_forward(const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                         const at::Tensor& locations, const at::Tensor& weights, int64_t points_per_level) {
  follow_torch_thread_count();
  TORCH_INTERNAL_ASSERT(value.dim() == 4 && locations.dim() == 4 && weights.dim() == 4 && locations.is_contiguous() &&
                            weights.is_contiguous() && weights.scalar_type() == point_dtype(value.scalar_type()) &&
                            (locations.scalar_type() == weights.scalar_type() ||
                             locations.scalar_type() == value.scalar_type()) &&
                            points_per_level >= 1 && weights.size(3) == spatial_shapes.size(0) * points_per_level &&
                            locations.size(3) >= 2 * weights.size(3),
                        "sampled_sum level_forward: bad arguments");
  SampledSumSizes s{};
  s.batch = value.size(0);
  s.pixels = value.size(1);
  s.groups = value.size(2);
  s.channels = value.size(3);
  s.queries = weights.size(1);
  s.points = weights.size(3);
  s.levels = spatial_shapes.size(0);
  const std::vector<SampledLevel> levels = read_levels(s, spatial_shapes, level_start_index);
  std::vector<int64_t> level_of_point;
  for (int64_t k = 0; k < s.points; ++k) level_of_point.push_back(k / points_per_level);
  const at::Tensor v = value.contiguous();
  at::Tensor output = at::empty({s.batch, s.queries, s.groups, s.channels}, value.options());
  const int64_t grain = std::max<int64_t>(1, kSumPointsPerTask / std::max<int64_t>(1, s.groups * s.points));
  SAMPLED_SUM_DISPATCH(value.scalar_type(), "sampled_sum_level_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    std::vector<acc_t> widths, heights;  // as level_points' per-point sizes: the int64 sizes rounded to acc_t
    for (int64_t k = 0; k < s.points; ++k) {
      widths.push_back(static_cast<acc_t>(levels[level_of_point[k]].width));
      heights.push_back(static_cast<acc_t>(levels[level_of_point[k]].height));
    }
    const InteriorLimits<acc_t> limits = interior_limits<acc_t>(s, levels.data(), level_of_point.data());
    const scalar_t* value_data = v.const_data_ptr<scalar_t>();
    scalar_t* out = output.mutable_data_ptr<scalar_t>();
    const auto run = [&](auto locations_of_type) {
      using location_t = decltype(locations_of_type);
      const LevelPointReader<acc_t, location_t> reader{locations.const_data_ptr<location_t>(),
                                                       weights.const_data_ptr<acc_t>(), widths.data(),
                                                       heights.data(), s.groups, s.points, locations.size(3)};
      at::parallel_for(0, s.batch * s.queries, grain, [&](int64_t begin, int64_t end) {
        RowScratch<acc_t> scratch(s.channels, s.groups * s.points);
        sum_rows<scalar_t>(s, levels.data(), level_of_point.data(), limits.x.data(), limits.y.data(), value_data,
                           reader, out, begin, end, &scratch);
      });
    };
    if (locations.scalar_type() == weights.scalar_type()) {
      run(acc_t(0));
    } else if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      run(scalar_t(0));  // a half value's locations in its own type, widened exactly as they are read
    }
  });
  return output;
}

std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& grad_output, const at::Tensor& value,
                                            const at::Tensor& points, const at::Tensor& point_levels,
                                            const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                                            BorderGradient border) {
  follow_torch_thread_count();
  const SampledSumSizes s = make_sampled_sum_sizes(value, points, point_levels, spatial_shapes, level_start_index);
  const SampledLevels t = read_sum_levels(s, point_levels, spatial_shapes, level_start_index);
  const at::Tensor v = value.contiguous(), pts = points.contiguous(), g = grad_output.contiguous();
  // Each task writes its level's pixels of value's gradient once; where the levels do not tile value's pixels
  // (never, where the ops' checks hold), the pixels outside every level keep a zero gradient.
  at::Tensor grad_value =
      levels_tile_pixels(t.levels, s.pixels) ? at::empty(value.sizes(), value.options())
                                             : at::zeros(value.sizes(), value.options());
  // Every element is written once (sum_backward_tasks): each point belongs to one level.
  at::Tensor grad_points = at::empty(pts.sizes(), pts.options());
  int64_t largest = 0;
  for (const SampledLevel& level : t.levels) {
    if (level.fits) largest = std::max(largest, level.height * level.width);
  }
  SAMPLED_SUM_DISPATCH(value.scalar_type(), "sampled_sum_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* value_data = v.const_data_ptr<scalar_t>();
    const acc_t* point_data = pts.const_data_ptr<acc_t>();
    const scalar_t* grad_data = g.const_data_ptr<scalar_t>();
    scalar_t* grad_value_data = grad_value.mutable_data_ptr<scalar_t>();
    acc_t* grad_point_data = grad_points.mutable_data_ptr<acc_t>();
    at::parallel_for(0, s.batch * s.groups * s.levels, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> grad(s.channels), grad_slice(largest * s.channels);
      sum_backward_tasks<scalar_t>(s, t.levels.data(), t.of_point.data(), value_data, point_data, grad_data,
                               grad_value_data, grad_point_data, border, begin, end, grad.data(), grad_slice.data());
    });
  });
  return {grad_value, grad_points};
}

}  // namespace

const SampledSumKernels& sampled_sum_kernels() {
  static const SampledSumKernels kernels{forward, backward, grid_forward, level_forward};
  return kernels;
}

}  // namespace cpu
}  // namespace deform_conv
