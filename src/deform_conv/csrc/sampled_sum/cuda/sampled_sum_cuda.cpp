// CUDA backend of the family's shared kernels (sampled_sum.h), host side (kernels in sampled_sum_kernels.cuh): this
// file chooses every launch -- dtype, index width, lanes, blocks -- and reaches the kernels through their launchers
// (launchers.h, defined in sampled_sum_cuda.cu), so that it is compiled by the host compiler and nvcc never parses
// ATen. The sampling math is sampling.h, shared with the CPU; the same file runs in the CUDA simulation
// (cuda/host.h). It follows multi-scale deformable attention's CUDA backend (ms_deform_attn_cuda.cpp).
//
// Work is split by item (image, query, group): a group of `lanes` adjacent threads (the smallest power of two that
// covers the group's channels, at most a warp) takes one item, and each lane strides over its channels, so the
// loads of one corner are contiguous across the lanes. Every point (x, y, weight) and its level are read once per
// channel lane; they are a few bytes against the D channels read at each corner.
//
// Every entry point: check (devices included) -> device guard -> allocate -> launch on the current stream -> launch
// check (cuda/host.h's launch_and_check). Only the ops' host code calls these, so a failed check is a bug of ours.
#include "../sampled_sum.h"

#include <ATen/Context.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <initializer_list>

#include "../../cuda/host.h"
#include "launchers.h"

namespace deform_conv {
namespace cuda {
namespace {

// The deterministic gradient's keys of a run of images stay within this budget (as the other ops').
constexpr int64_t kSampledSumBudgetBytes = int64_t(256) << 20;

// The kernels' index arithmetic runs in 32 bits when every flat index of every tensor they touch stays below 2^30
// (int32_index_limit): value and its gradient, the points and their gradient (3 per point), the output, the
// deterministic path's entries (4 per point) and keys (groups * pixels per image); the grid-stride loops step by at
// most 2^28, so index + step cannot overflow either. A level is read only when it fits in value's pixels
// (level_fits), so its sizes, its start and the pixel coordinates inside it fit too.
bool fits_int32(const SampledSumSizes& s) {
  const int64_t limit = int32_index_limit();
  const int64_t value = s.batch * s.pixels * s.groups * std::max<int64_t>(s.channels, 1);
  const int64_t points = 3 * s.total_points(), entries = 4 * s.total_points();
  const int64_t output = s.batch * s.queries * s.groups * std::max<int64_t>(s.channels, 1);
  const int64_t keys = s.batch * s.groups * s.pixels + 1;
  return value < limit && points < limit && entries < limit && output < limit && keys < limit;
}

// Every tensor a kernel reads must be on value's device (the kernels take raw pointers).
void check_sampled_sum_devices(std::initializer_list<const at::Tensor*> tensors, const at::Tensor& value) {
  for (const at::Tensor* t : tensors) {
    TORCH_INTERNAL_ASSERT(t->device() == value.device(), "sampled_sum: tensors on different devices");
  }
}

struct SampledSumTensors {  // the inputs, contiguous
  at::Tensor value, points, point_levels, spatial_shapes, level_start_index;

  SampledSumTensors(const at::Tensor& v, const at::Tensor& pts, const at::Tensor& of_point, const at::Tensor& shapes,
                    const at::Tensor& starts)
      : value(v.contiguous()), points(pts.contiguous()), point_levels(of_point.contiguous()),
        spatial_shapes(shapes.contiguous()), level_start_index(starts.contiguous()) {}

  SampledSumLevels levels() const {
    return {point_levels.const_data_ptr<int64_t>(), spatial_shapes.const_data_ptr<int64_t>(),
            level_start_index.const_data_ptr<int64_t>()};
  }
};

// Deterministic: in runs of images whose keys fit the budget: 4 entries a point, each a key, its sorted copy, the
// sort's permutation and what the sort itself keeps (about as much again), 8 bytes each; 16 bytes a key for the key
// starts and the searched keys.
void sampled_sum_value_grad_gathered(const SampledSumSizes& s, const SampledSumTensors& t,
                                     const at::Tensor& grad_output, at::Tensor& grad_value) {
  const int64_t points_per_image = s.queries * s.groups * s.points;
  const int64_t per_image = std::max<int64_t>(1, 4 * points_per_image * 6 * 8 + s.groups * s.pixels * 16);
  const int64_t run = std::clamp<int64_t>(budget_bytes(kSampledSumBudgetBytes) / per_image, 1, s.batch);
  for (int64_t first = 0; first < s.batch; first += run) {
    const int64_t images = std::min(run, s.batch - first);
    const int64_t count = images * points_per_image, keys = images * s.groups * s.pixels;
    at::Tensor entry_keys = at::empty({4 * count}, t.value.options().dtype(at::kLong));
    DC_DISPATCH(t.value.scalar_type(), "sampled_sum_backward_cuda", [&] {
      using acc_t = opmath_type<scalar_t>;
      with_index_width(fits_int32(s), [&](auto index) {
        launch_and_check(&SampledSumLaunchers<scalar_t, decltype(index)>::entry_keys, blocks_for(count), s,
                         t.levels(), t.points.const_data_ptr<acc_t>(), first, count, keys,
                         entry_keys.mutable_data_ptr<int64_t>());
      });
    });
    // Stable: entries of one key keep their order, so the sums below add in a fixed order.
    const auto sorted = at::sort(entry_keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const at::Tensor& sorted_keys = std::get<0>(sorted);
    const at::Tensor& sorted_entries = std::get<1>(sorted);
    const at::Tensor key_starts = at::searchsorted(sorted_keys, at::arange(keys + 1, sorted_keys.options()));
    DC_DISPATCH(t.value.scalar_type(), "sampled_sum_backward_cuda", [&] {
      using acc_t = opmath_type<scalar_t>;
      with_index_width(fits_int32(s), [&](auto index) {
        const Split split = split_for(s.channels);
        launch_and_check(&SampledSumLaunchers<scalar_t, decltype(index)>::value_grad_gather,
                         blocks_for(keys << split.lanes_log2), s, t.levels(), split, t.points.const_data_ptr<acc_t>(),
                         grad_output.const_data_ptr<scalar_t>(), sorted_entries.const_data_ptr<int64_t>(),
                         key_starts.const_data_ptr<int64_t>(), first, keys, grad_value.mutable_data_ptr<acc_t>());
      });
    });
  }
}

at::Tensor forward(const at::Tensor& value, const at::Tensor& points, const at::Tensor& point_levels,
                   const at::Tensor& spatial_shapes, const at::Tensor& level_start_index) {
  const SampledSumSizes s = make_sampled_sum_sizes(value, points, point_levels, spatial_shapes, level_start_index);
  check_sampled_sum_devices({&points, &point_levels, &spatial_shapes, &level_start_index}, value);
  const DeviceGuard guard(value.device());
  const SampledSumTensors t(value, points, point_levels, spatial_shapes, level_start_index);
  // Every element is written once by the forward kernel (a sum of no points is 0).
  at::Tensor output = at::empty({s.batch, s.queries, s.groups, s.channels}, value.options());
  const int64_t items = s.batch * s.queries * s.groups;
  if (items == 0 || s.channels == 0) return output;
  DC_DISPATCH(value.scalar_type(), "sampled_sum_cuda", [&] {
    using acc_t = opmath_type<scalar_t>;
    with_index_width(fits_int32(s), [&](auto index) {
      const Split split = split_for(s.channels);
      launch_and_check(&SampledSumLaunchers<scalar_t, decltype(index)>::forward,
                       blocks_for(items << split.lanes_log2), s, t.levels(), split,
                       t.value.const_data_ptr<scalar_t>(), t.points.const_data_ptr<acc_t>(),
                       output.mutable_data_ptr<scalar_t>());
    });
  });
  return output;
}

std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& grad_output, const at::Tensor& value,
                                            const at::Tensor& points, const at::Tensor& point_levels,
                                            const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                                            BorderGradient border) {
  const SampledSumSizes s = make_sampled_sum_sizes(value, points, point_levels, spatial_shapes, level_start_index);
  TORCH_INTERNAL_ASSERT(grad_output.sizes() == at::IntArrayRef({s.batch, s.queries, s.groups, s.channels}) &&
                            grad_output.scalar_type() == value.scalar_type(),
                        "sampled_sum: grad_output does not match the output");
  check_sampled_sum_devices({&grad_output, &points, &point_levels, &spatial_shapes, &level_start_index}, value);
  const DeviceGuard guard(value.device());
  const SampledSumTensors t(value, points, point_levels, spatial_shapes, level_start_index);
  const at::Tensor grad = grad_output.contiguous();
  const at::ScalarType acc_type = at::toOpMathType(value.scalar_type());
  // Pixels no point reads (and any outside every level) keep a zero gradient.
  at::Tensor grad_value = at::zeros(value.sizes(), value.options().dtype(acc_type));
  // Every element is written once by the backward kernel.
  at::Tensor grad_points = at::empty(t.points.sizes(), t.points.options());
  const int64_t items = s.batch * s.queries * s.groups;
  if (items > 0 && s.points > 0) {
    const bool deterministic = at::globalContext().deterministicAlgorithms();
    DC_DISPATCH(value.scalar_type(), "sampled_sum_backward_cuda", [&] {
      using acc_t = opmath_type<scalar_t>;
      with_index_width(fits_int32(s), [&](auto index) {
        const Split split = split_for(s.channels);
        const int64_t per_warp = kWarp >> split.lanes_log2;
        launch_and_check(&SampledSumLaunchers<scalar_t, decltype(index)>::backward,
                         blocks_for((items + per_warp - 1) / per_warp * kWarp), s, t.levels(), split, border,
                         t.value.const_data_ptr<scalar_t>(), t.points.const_data_ptr<acc_t>(),
                         grad.const_data_ptr<scalar_t>(),
                         deterministic ? nullptr : grad_value.mutable_data_ptr<acc_t>(),
                         grad_points.mutable_data_ptr<acc_t>());
      });
    });
    // No channels or no pixels: value's gradient has no elements to gather.
    if (deterministic && grad_value.numel() > 0) sampled_sum_value_grad_gathered(s, t, grad, grad_value);
  }
  return {grad_value.to(value.scalar_type()), grad_points};
}

}  // namespace

const SampledSumKernels& sampled_sum_kernels() {
  static const SampledSumKernels kernels{forward, backward, /*grid_forward=*/nullptr, /*grid_backward=*/nullptr,
                                         /*level_forward=*/nullptr, /*level_backward=*/nullptr};
  return kernels;
}

}  // namespace cuda
}  // namespace deform_conv
