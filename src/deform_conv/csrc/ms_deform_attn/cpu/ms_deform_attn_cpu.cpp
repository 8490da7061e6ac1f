// CPU backend of multi-scale deformable attention: every dtype computed natively, the half types accumulating in
// float32 (at::opmath_type) and rounded once.
//
// Each sampling location's neighbours and weights come from the shared math (sampling.h) once, for all D channels
// of its head; the loops over channels are plain contiguous loops (value's channels are innermost), which the
// compiler vectorises, for the widest instruction set the CPU has (DC_CPU_DISPATCH). A point whose four
// neighbours all lie in the image (most of them) takes one pass over the channels for all four.
//
// The forward is the family's (csrc/sampled_sum/: the same sums, reading the locations in place). The backward
// splits (image, head, level) between threads: one task owns its slice of value's gradient (that level's pixels
// of that head) and its points' location and weight gradients, and walks its queries and points in order, so
// every sum is taken in one fixed order: the gradients are bitwise the same for any thread count.
#include "../entry_points.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../../cpu_kernels.h"
#include "../attention_params.h"
#include "../float32_points.h"

namespace deform_conv {
namespace cpu {
namespace {

struct Level {
  int64_t height, width, start;  // spatial_shapes[l] and level_start_index[l]
};

std::vector<Level> read_levels(const AttentionParams& p, const at::Tensor& spatial_shapes,
                               const at::Tensor& level_start_index) {
  const at::Tensor shapes = spatial_shapes.contiguous(), starts = level_start_index.contiguous();
  const int64_t* hw = shapes.const_data_ptr<int64_t>();
  const int64_t* start = starts.const_data_ptr<int64_t>();
  std::vector<Level> levels(p.levels);
  for (int64_t l = 0; l < p.levels; ++l) levels[l] = {hw[2 * l], hw[2 * l + 1], start[l]};
  return levels;
}

// The neighbours and weights of the location (x, y) at `location` in `level`.
template <typename acc_t, typename scalar_t>
BilinearSample<acc_t> sample_at(const scalar_t* location, const Level& level) {
  const acc_t x = half_pixel_coordinate(static_cast<acc_t>(location[0]), level.width);
  const acc_t y = half_pixel_coordinate(static_cast<acc_t>(location[1]), level.height);
  return bilinear_sample(y, x, level.height, level.width);
}

// Tasks (image, head, level) [begin, end). A task sums its slice of value's gradient (that level's pixels of that
// head) in `grad_slice`, in the accumulation type, and writes it into grad_value once, rounded; the slices of all
// tasks tile grad_value (the levels tile S: checked by make_attention_params). So a half-type gradient needs no
// float32 copy of the whole of it. `grad` holds D values, `grad_slice` the largest level's pixels * D.
template <typename scalar_t>
void backward_tasks_body(const AttentionParams& p, const Level* levels, const scalar_t* value,
                                    const scalar_t* locations, const scalar_t* weights, const scalar_t* grad_output,
                                    scalar_t* grad_value, scalar_t* grad_locations, scalar_t* grad_weights,
                                    int64_t begin, int64_t end, at::opmath_type<scalar_t>* __restrict__ grad,
                                    at::opmath_type<scalar_t>* __restrict__ grad_slice) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t channels = p.channels, pixel_stride = p.heads * p.channels;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t l = task % p.levels, m = (task / p.levels) % p.heads, n = task / (p.levels * p.heads);
    const Level& level = levels[l];
    const scalar_t* image = value + p.value_index(n, level.start, m);
    const int64_t slice = level.height * level.width * channels;
    for (int64_t i = 0; i < slice; ++i) grad_slice[i] = 0;
    for (int64_t q = 0; q < p.queries; ++q) {
      const scalar_t* g = grad_output + p.output_index(n, q, m);
      for (int64_t d = 0; d < channels; ++d) grad[d] = static_cast<acc_t>(g[d]);
      for (int64_t pt = 0; pt < p.points; ++pt) {
        const int64_t point = p.point_index(n, q, m, l, pt);
        const BilinearSample<acc_t> s = sample_at<acc_t>(locations + 2 * point, level);
        const acc_t w = static_cast<acc_t>(weights[point]);
        // dot[k] = grad . neighbour k; then d loss / d (the sample), d x and d y are sums over the neighbours
        // of (its weight, or the weight's derivative) * dot[k].
        acc_t dot[4] = {0, 0, 0, 0};
        if (s.count == 4) {  // one pass over the channels for all four neighbours
          const scalar_t* __restrict__ v0 = image + s.pixel[0] * pixel_stride;
          const scalar_t* __restrict__ v1 = image + s.pixel[1] * pixel_stride;
          const scalar_t* __restrict__ v2 = image + s.pixel[2] * pixel_stride;
          const scalar_t* __restrict__ v3 = image + s.pixel[3] * pixel_stride;
          acc_t* __restrict__ gv0 = grad_slice + s.pixel[0] * channels;
          acc_t* __restrict__ gv1 = grad_slice + s.pixel[1] * channels;
          acc_t* __restrict__ gv2 = grad_slice + s.pixel[2] * channels;
          acc_t* __restrict__ gv3 = grad_slice + s.pixel[3] * channels;
          const acc_t c0 = w * s.weight[0], c1 = w * s.weight[1], c2 = w * s.weight[2], c3 = w * s.weight[3];
          acc_t dot0 = 0, dot1 = 0, dot2 = 0, dot3 = 0;
          // Vector partial sums, added in an order fixed for each instruction set: the same bits for any thread
          // count.
#pragma omp simd reduction(+ : dot0, dot1, dot2, dot3)
          for (int64_t d = 0; d < channels; ++d) {
            const acc_t gd = grad[d];
            dot0 += gd * static_cast<acc_t>(v0[d]);
            dot1 += gd * static_cast<acc_t>(v1[d]);
            dot2 += gd * static_cast<acc_t>(v2[d]);
            dot3 += gd * static_cast<acc_t>(v3[d]);
            gv0[d] += c0 * gd;
            gv1[d] += c1 * gd;
            gv2[d] += c2 * gd;
            gv3[d] += c3 * gd;
          }
          dot[0] = dot0, dot[1] = dot1, dot[2] = dot2, dot[3] = dot3;
        } else {
          for (int k = 0; k < s.count; ++k) {
            const scalar_t* __restrict__ v = image + s.pixel[k] * pixel_stride;
            acc_t* __restrict__ gv = grad_slice + s.pixel[k] * channels;
            const acc_t c = w * s.weight[k];
            acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
            for (int64_t d = 0; d < channels; ++d) {
              sum += grad[d] * static_cast<acc_t>(v[d]);
              gv[d] += c * grad[d];
            }
            dot[k] = sum;
          }
        }
        acc_t grad_w = sum_start(s), grad_x = sum_start(s), grad_y = sum_start(s);
        for (int k = 0; k < s.count; ++k) {
          grad_w += s.weight[k] * dot[k];
          grad_x += s.weight_dx[k] * dot[k];
          grad_y += s.weight_dy[k] * dot[k];
        }
        grad_weights[point] = static_cast<scalar_t>(grad_w);
        // The pixel coordinate is location * size - 0.5: its derivative is size.
        grad_locations[2 * point] = static_cast<scalar_t>(
            static_cast<acc_t>(level.width) * coordinate_grad(s, w, grad_x, BorderGradient::torchvision));
        grad_locations[2 * point + 1] = static_cast<scalar_t>(
            static_cast<acc_t>(level.height) * coordinate_grad(s, w, grad_y, BorderGradient::torchvision));
      }
    }
    for (int64_t pixel = 0; pixel < level.height * level.width; ++pixel) {
      scalar_t* out = grad_value + p.value_index(n, level.start + pixel, m);
      const acc_t* in = grad_slice + pixel * channels;
      for (int64_t d = 0; d < channels; ++d) out[d] = static_cast<scalar_t>(in[d]);
    }
  }
}
DC_CPU_KERNEL(backward_tasks)

template <typename scalar_t>
void backward_all(const AttentionParams& p, const std::vector<Level>& levels, const scalar_t* value,
                  const scalar_t* locations, const scalar_t* weights, const scalar_t* grad_output,
                  scalar_t* grad_value, scalar_t* grad_locations, scalar_t* grad_weights) {
  int64_t largest = 0;
  for (const Level& level : levels) largest = std::max(largest, level.height * level.width);
  at::parallel_for(0, p.batch * p.heads * p.levels, 1, [&](int64_t begin, int64_t end) {
    std::vector<at::opmath_type<scalar_t>> grad(p.channels), grad_slice(largest * p.channels);
    backward_tasks<scalar_t>(p, levels.data(), value, locations, weights, grad_output, grad_value, grad_locations,
                   grad_weights, begin, end, grad.data(), grad_slice.data());
  });
}

#define MS_DEFORM_ATTN_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)

}  // namespace

at::Tensor ms_deform_attn_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                  const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                                  const at::Tensor& attention_weights) {
  follow_torch_thread_count();
  const AttentionParams p =
      make_attention_params(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                            /*check_level_values=*/true);
  if (has_float32_points(value, sampling_locations, attention_weights)) {
    return ms_deform_attn_on_float32_points(sampled_sum_kernels(), p, value, spatial_shapes, level_start_index,
                                            sampling_locations, attention_weights);
  }
  // The family's forward on the locations read in place (sampled_sum's level_forward): the same points (location
  // * size - 0.5) and the same sums in the same order (levels, then points) as this op's own kernel took them.
  const int64_t points = p.levels * p.points;
  const at::Tensor locations = sampling_locations.contiguous().view({p.batch, p.queries, p.heads, 2 * points});
  const at::Tensor weights = attention_weights.contiguous().view({p.batch, p.queries, p.heads, points});
  const at::Tensor output =
      sampled_sum_kernels().level_forward(value, spatial_shapes, level_start_index, locations, weights, p.points);
  return output.view({p.batch, p.queries, p.heads * p.channels});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations, const at::Tensor& attention_weights) {
  follow_torch_thread_count();
  const AttentionParams p =
      make_attention_params(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                            /*check_level_values=*/true);
  check_attention_grad_output(p, grad_output, value);
  if (has_float32_points(value, sampling_locations, attention_weights)) {
    return ms_deform_attn_backward_on_float32_points(sampled_sum_kernels(), p, grad_output, value, spatial_shapes,
                                                     level_start_index, sampling_locations, attention_weights);
  }
  const std::vector<Level> levels = read_levels(p, spatial_shapes, level_start_index);
  const at::Tensor v = value.contiguous(), loc = sampling_locations.contiguous(), w = attention_weights.contiguous();
  const at::Tensor g = grad_output.contiguous();
  // Every element of these three is written once (backward_tasks).
  at::Tensor grad_value = at::empty(value.sizes(), value.options());
  at::Tensor grad_locations = at::empty(loc.sizes(), loc.options());
  at::Tensor grad_weights = at::empty(w.sizes(), w.options());
  MS_DEFORM_ATTN_DISPATCH(value.scalar_type(), "ms_deform_attn_backward_cpu", [&] {
    backward_all<scalar_t>(p, levels, v.const_data_ptr<scalar_t>(), loc.const_data_ptr<scalar_t>(),
                           w.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(),
                             grad_value.mutable_data_ptr<scalar_t>(),
                             grad_locations.mutable_data_ptr<scalar_t>(), grad_weights.mutable_data_ptr<scalar_t>());
  });
  return {grad_value, grad_locations, grad_weights};
}

}  // namespace cpu
}  // namespace deform_conv
