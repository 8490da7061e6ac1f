// CUDA backend of multi-scale deformable attention, host side (kernels in attention_kernels.cuh): this file chooses
// every launch -- dtype, index width, lanes, blocks -- and reaches the kernels through their launchers
// (launchers.h, defined in ms_deform_attn_cuda.cu), so that it is compiled by the host compiler and nvcc never
// parses ATen. The sampling math is sampling.h, shared with the CPU; the same file runs in the CUDA simulation
// (cuda/host.h).
//
// Work is split by item (image, query, head): a group of `lanes` adjacent threads (the smallest power of two that
// covers the head's channels, at most a warp) takes one item, and each lane strides over its channels, so the
// loads of one corner are contiguous across the lanes. Every point's location and weights are read once per
// channel lane; they are a few bytes against the D channels read at each corner.
//
// Every host entry point: validate (devices included) -> device guard -> allocate -> launch on the current
// stream -> launch check (cuda/host.h's launch_and_check).
#include "../entry_points.h"

#include <ATen/Context.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "../../cuda/host.h"
#include "../attention_params.h"
#include "float32_points.h"
#include "launchers.h"

namespace deform_conv {
namespace cuda {
namespace {

// The deterministic gradient's keys of a run of images stay within this budget (as deform_conv2d's).
constexpr int64_t kBudgetBytes = int64_t(256) << 20;

// The kernels' index arithmetic runs in 32 bits when every flat index of every tensor they touch stays below
// 2^30 (int32_index_limit): value and its gradient, the locations (2 per point), the output, the deterministic
// path's entries (4 per point) and keys (heads * pixels per image); the grid-stride loops step by at most 2^28,
// so index + step cannot overflow either. Level sizes are below `pixels`, so pixel coordinates fit too.
bool fits_int32(const AttentionParams& p) {
  const int64_t limit = int32_index_limit();
  const int64_t value = p.batch * p.pixels * p.heads * std::max<int64_t>(p.channels, 1);
  const int64_t entries = 4 * p.total_points();
  const int64_t output = p.batch * p.queries * p.heads * std::max<int64_t>(p.channels, 1);
  const int64_t keys = p.batch * p.heads * p.pixels + 1;
  return value < limit && entries < limit && output < limit && keys < limit;
}

struct AttentionTensors {  // the inputs, contiguous
  at::Tensor value, spatial_shapes, level_start_index, locations, weights;

  AttentionTensors(const at::Tensor& v, const at::Tensor& shapes, const at::Tensor& starts, const at::Tensor& loc,
                   const at::Tensor& w)
      : value(v.contiguous()), spatial_shapes(shapes.contiguous()), level_start_index(starts.contiguous()),
        locations(loc.contiguous()), weights(w.contiguous()) {}

  AttentionLevels levels() const {
    return {spatial_shapes.const_data_ptr<int64_t>(), level_start_index.const_data_ptr<int64_t>()};
  }
};

// Deterministic: in runs of images whose keys fit the budget: 4 entries a point, each a key, its sorted copy, the
// sort's permutation and what the sort itself keeps (about as much again), 8 bytes each; 16 bytes a key for the
// key starts and the searched keys.
void value_grad_gathered(const AttentionParams& p, const AttentionTensors& t, const at::Tensor& grad_output,
                         at::Tensor& grad_value) {
  const int64_t points_per_image = p.queries * p.heads * p.levels * p.points;
  const int64_t per_image = std::max<int64_t>(1, 4 * points_per_image * 6 * 8 + p.heads * p.pixels * 16);
  const int64_t run = std::clamp<int64_t>(budget_bytes(kBudgetBytes) / per_image, 1, p.batch);
  for (int64_t first = 0; first < p.batch; first += run) {
    const int64_t images = std::min(run, p.batch - first);
    const int64_t points = images * points_per_image, keys = images * p.heads * p.pixels;
    at::Tensor entry_keys = at::empty({4 * points}, t.value.options().dtype(at::kLong));
    DC_DISPATCH(t.value.scalar_type(), "ms_deform_attn_backward_cuda", [&] {
      with_index_width(fits_int32(p), [&](auto index) {
        launch_and_check(&AttentionLaunchers<scalar_t, decltype(index)>::entry_keys, blocks_for(points), p,
                         t.levels(), t.locations.const_data_ptr<scalar_t>(), t.weights.const_data_ptr<scalar_t>(),
                         first, points, keys, entry_keys.mutable_data_ptr<int64_t>());
      });
    });
    // Stable: entries of one key keep their order, so the sums below add in a fixed order.
    const auto sorted = at::sort(entry_keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const at::Tensor& sorted_keys = std::get<0>(sorted);
    const at::Tensor& sorted_entries = std::get<1>(sorted);
    const at::Tensor key_starts = at::searchsorted(sorted_keys, at::arange(keys + 1, sorted_keys.options()));
    DC_DISPATCH(t.value.scalar_type(), "ms_deform_attn_backward_cuda", [&] {
      with_index_width(fits_int32(p), [&](auto index) {
        const Split split = split_for(p.channels);
        launch_and_check(&AttentionLaunchers<scalar_t, decltype(index)>::value_grad_gather,
                         blocks_for(keys << split.lanes_log2), p, t.levels(), split,
                         t.locations.const_data_ptr<scalar_t>(), t.weights.const_data_ptr<scalar_t>(),
                         grad_output.const_data_ptr<scalar_t>(), sorted_entries.const_data_ptr<int64_t>(),
                         key_starts.const_data_ptr<int64_t>(), first, keys,
                         grad_value.mutable_data_ptr<opmath_type<scalar_t>>());
      });
    });
  }
}

}  // namespace

at::Tensor ms_deform_attn_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                  const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                                  const at::Tensor& attention_weights) {
  const AttentionParams p =
      make_attention_params(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                            /*check_level_values=*/false);
  if (level_checks_on_device()) assert_level_values_async(spatial_shapes, level_start_index, p.pixels);
  const DeviceGuard guard(value.device());
  if (has_float32_points(value, sampling_locations, attention_weights)) {
    return ms_deform_attn_on_float32_points(sampled_sum_kernels(), p, value, spatial_shapes, level_start_index,
                                            sampling_locations, attention_weights);
  }
  const AttentionTensors t(value, spatial_shapes, level_start_index, sampling_locations, attention_weights);
  at::Tensor output = at::empty({p.batch, p.queries, p.heads * p.channels}, value.options());
  const int64_t items = p.batch * p.queries * p.heads;
  if (items == 0 || p.channels == 0) return output;
  DC_DISPATCH(value.scalar_type(), "ms_deform_attn_cuda", [&] {
    with_index_width(fits_int32(p), [&](auto index) {
      const Split split = split_for(p.channels);
      launch_and_check(&AttentionLaunchers<scalar_t, decltype(index)>::forward, blocks_for(items << split.lanes_log2),
                       p, t.levels(), split, t.value.const_data_ptr<scalar_t>(),
                       t.locations.const_data_ptr<scalar_t>(), t.weights.const_data_ptr<scalar_t>(),
                       output.mutable_data_ptr<scalar_t>());
    });
  });
  return output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward(const at::Tensor& grad_output,
                                                                       const at::Tensor& value,
                                                                       const at::Tensor& spatial_shapes,
                                                                       const at::Tensor& level_start_index,
                                                                       const at::Tensor& sampling_locations,
                                                                       const at::Tensor& attention_weights) {
  const AttentionParams p =
      make_attention_params(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                            /*check_level_values=*/false);
  if (level_checks_on_device()) assert_level_values_async(spatial_shapes, level_start_index, p.pixels);
  check_attention_grad_output(p, grad_output, value);
  const DeviceGuard guard(value.device());
  if (has_float32_points(value, sampling_locations, attention_weights)) {
    return ms_deform_attn_backward_on_float32_points(sampled_sum_kernels(), p, grad_output, value, spatial_shapes,
                                                     level_start_index, sampling_locations, attention_weights);
  }
  const AttentionTensors t(value, spatial_shapes, level_start_index, sampling_locations, attention_weights);
  const at::Tensor grad = grad_output.contiguous();
  const at::ScalarType acc_type = at::toOpMathType(value.scalar_type());
  at::Tensor grad_value = at::zeros(value.sizes(), value.options().dtype(acc_type));
  // Every element of these two is written once by the backward kernel.
  at::Tensor grad_locations = at::empty(t.locations.sizes(), t.locations.options());
  at::Tensor grad_weights = at::empty(t.weights.sizes(), t.weights.options());
  const int64_t items = p.batch * p.queries * p.heads;
  if (items > 0) {
    const bool deterministic = at::globalContext().deterministicAlgorithms();
    DC_DISPATCH(value.scalar_type(), "ms_deform_attn_backward_cuda", [&] {
      with_index_width(fits_int32(p), [&](auto index) {
        const Split split = split_for(p.channels);
        const int64_t per_warp = kWarp >> split.lanes_log2;
        launch_and_check(&AttentionLaunchers<scalar_t, decltype(index)>::backward,
                         blocks_for((items + per_warp - 1) / per_warp * kWarp), p, t.levels(), split,
                         t.value.const_data_ptr<scalar_t>(), t.locations.const_data_ptr<scalar_t>(),
                         t.weights.const_data_ptr<scalar_t>(), grad.const_data_ptr<scalar_t>(),
                         deterministic ? nullptr : grad_value.mutable_data_ptr<opmath_type<scalar_t>>(),
                         grad_locations.mutable_data_ptr<scalar_t>(), grad_weights.mutable_data_ptr<scalar_t>());
      });
    });
    if (deterministic) value_grad_gathered(p, t, grad, grad_value);
  }
  return {grad_value.to(value.scalar_type()), grad_locations, grad_weights};
}

}  // namespace cuda
}  // namespace deform_conv
