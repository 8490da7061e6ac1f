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

SampledLevels read_sum_levels(const SampledSumSizes& s, const at::Tensor& point_levels,
                              const at::Tensor& spatial_shapes, const at::Tensor& level_start_index) {
  const at::Tensor shapes = spatial_shapes.contiguous(), starts = level_start_index.contiguous();
  const at::Tensor of_point = point_levels.contiguous();
  SampledLevels t;
  const int64_t* hw = shapes.const_data_ptr<int64_t>();
  const int64_t* start = starts.const_data_ptr<int64_t>();
  for (int64_t l = 0; l < s.levels; ++l) {
    t.levels.push_back({hw[2 * l], hw[2 * l + 1], start[l], level_fits(start[l], hw[2 * l], hw[2 * l + 1], s.pixels)});
  }
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

template <typename acc_t>
struct PointXYW {
  acc_t x, y, weight;
};

// Where the forward reads a point: from the points tensor [N, Q, G, K, 3] ...
template <typename acc_t>
struct StoredPoints {
  const acc_t* data;
  int64_t groups, points;

  struct Row {
    const acc_t* base;  // [G, K, 3]
    int64_t points;
    PointXYW<acc_t> at(int64_t g, int64_t k) const {
      const acc_t* p = base + 3 * (g * points + k);
      return {p[0], p[1], p[2]};
    }
  };
  Row row(int64_t row) const { return {data + 3 * row * groups * points, points}; }
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
  int64_t out_height, out_width;

  struct Row {
    const offset_t *offsets, *weights;
    const acc_t *tap_x, *tap_y;
    acc_t base_x, base_y, scale;
    int64_t offset_group, weight_group;
    PointXYW<acc_t> at(int64_t g, int64_t k) const {
      const offset_t* offset = offsets + g * offset_group + 2 * k;
      return {base_x + (tap_x[k] + static_cast<acc_t>(offset[0])) * scale,
              base_y + (tap_y[k] + static_cast<acc_t>(offset[1])) * scale,
              static_cast<acc_t>(weights[g * weight_group + k])};
    }
  };
  Row row(int64_t row) const {  // row = n * H_out * W_out + output pixel
    const int64_t pixel = row % (out_height * out_width), oy = pixel / out_width, ox = pixel % out_width;
    return {offsets + row * layout.offset_row, weights + row * layout.weight_row + layout.weight_start, tap_x, tap_y,
            base_x[ox], base_y[oy], scale, layout.offset_group, layout.weight_group};
  }
};

// About this many sampling points (times D channels) a task: enough to outweigh a task's cost.
constexpr int64_t kSumPointsPerTask = 2048;

// Output rows (image, query) [begin, end). `sum` holds D values.
template <typename scalar_t, typename Points>
void sum_rows_body(const SampledSumSizes& s, const SampledLevel* levels, const int64_t* level_of_point,
                   const scalar_t* value, Points points, scalar_t* output, int64_t begin, int64_t end,
                   at::opmath_type<scalar_t>* __restrict__ sum) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t channels = s.channels, pixel_stride = s.groups * s.channels;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t n = row / s.queries, q = row % s.queries;
    const typename Points::Row points_of_row = points.row(row);
    for (int64_t g = 0; g < s.groups; ++g) {
      for (int64_t d = 0; d < channels; ++d) sum[d] = 0;
      for (int64_t k = 0; k < s.points; ++k) {
        const PointXYW<acc_t> point = points_of_row.at(g, k);
        const SampledLevel& level = levels[level_of_point[k]];
        const BilinearSample<acc_t> b = sample_of(point.x, point.y, level);
        const acc_t w = point.weight;
        const scalar_t* image = value + s.value_index(n, level.fits ? level.start : 0, g);
        if (b.count == 4 && std::isfinite(w)) {
          // All four neighbours in the level, a finite weight: one pass, the weight folded into the bilinear
          // weights. (Elsewhere the sample is formed first, so that an infinite weight times a sample of 0 is NaN.)
          const scalar_t* __restrict__ v0 = image + b.pixel[0] * pixel_stride;
          const scalar_t* __restrict__ v1 = image + b.pixel[1] * pixel_stride;
          const scalar_t* __restrict__ v2 = image + b.pixel[2] * pixel_stride;
          const scalar_t* __restrict__ v3 = image + b.pixel[3] * pixel_stride;
          const acc_t c0 = w * b.weight[0], c1 = w * b.weight[1], c2 = w * b.weight[2], c3 = w * b.weight[3];
          for (int64_t d = 0; d < channels; ++d) {
            sum[d] += c0 * static_cast<acc_t>(v0[d]) + c1 * static_cast<acc_t>(v1[d]) +
                      c2 * static_cast<acc_t>(v2[d]) + c3 * static_cast<acc_t>(v3[d]);
          }
          continue;
        }
        const acc_t start = sum_start(b);
        for (int64_t d = 0; d < channels; ++d) {
          acc_t sample = start;
          for (int c = 0; c < b.count; ++c) {
            sample += b.weight[c] * static_cast<acc_t>(image[b.pixel[c] * pixel_stride + d]);
          }
          sum[d] += w * sample;
        }
      }
      scalar_t* out = output + s.output_index(n, q, g);
      for (int64_t d = 0; d < channels; ++d) out[d] = static_cast<scalar_t>(sum[d]);
    }
  }
}
DC_CPU_KERNEL(sum_rows)

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
    for (int64_t q = 0; q < s.queries; ++q) {
      const scalar_t* go = grad_output + s.output_index(n, q, g);
      for (int64_t d = 0; d < channels; ++d) grad[d] = static_cast<acc_t>(go[d]);
      for (int64_t k = 0; k < s.points; ++k) {
        if (level_of_point[k] != l) continue;
        const int64_t point = s.point_index(n, q, g, k);
        const BilinearSample<acc_t> b = sample_of(points[3 * point], points[3 * point + 1], level);
        const acc_t w = points[3 * point + 2];
        // dot[c] = grad . neighbour c; d loss / d (the sample), d x and d y are sums over the neighbours of (its
        // weight, or the weight's derivative) * dot[c].
        acc_t dot[4] = {0, 0, 0, 0};
        for (int c = 0; c < b.count; ++c) {
          const scalar_t* __restrict__ v = image + b.pixel[c] * pixel_stride;
          acc_t* __restrict__ gv = grad_slice + b.pixel[c] * channels;
          const acc_t weight = w * b.weight[c];
          acc_t sum = 0;
          // Vector partial sums, added in an order fixed for each instruction set: the same bits for any thread
          // count.
#pragma omp simd reduction(+ : sum)
          for (int64_t d = 0; d < channels; ++d) {
            sum += grad[d] * static_cast<acc_t>(v[d]);
            gv[d] += weight * grad[d];
          }
          dot[c] = sum;
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
    at::parallel_for(0, s.batch * s.queries, grain, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> sum(s.channels);
      sum_rows<scalar_t>(s, t.levels.data(), t.of_point.data(), value_data, stored, out, begin, end, sum.data());
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
    const scalar_t* value_data = v.const_data_ptr<scalar_t>();
    scalar_t* out = output.mutable_data_ptr<scalar_t>();
    const auto run = [&](auto offsets_of_type) {
      using offset_t = decltype(offsets_of_type);
      const GridPointReader<acc_t, offset_t> reader{
          offsets.const_data_ptr<offset_t>(), weights.const_data_ptr<offset_t>(), base_x.data(), base_y.data(),
          tap_x.data(), tap_y.data(), layout, static_cast<acc_t>(grid.offset_scale), grid.out_height(),
          grid.out_width()};
      at::parallel_for(0, s.batch * s.queries, grain, [&](int64_t begin, int64_t end) {
        std::vector<acc_t> sum(s.channels);
        sum_rows<scalar_t>(s, levels.data(), level_of_point.data(), value_data, reader, out, begin, end, sum.data());
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
  static const SampledSumKernels kernels{forward, backward, grid_forward};
  return kernels;
}

}  // namespace cpu
}  // namespace deform_conv
