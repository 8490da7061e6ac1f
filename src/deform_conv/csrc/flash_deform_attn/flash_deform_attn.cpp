#include "flash_deform_attn.h"

#include <ATen/ops/cat.h>

#include "../ms_deform_attn/attention_params.h"
#include "../sampled_sum/checks.h"
#include "../sampled_sum/points.h"

namespace deform_conv {
namespace {

struct FlashSizes {
  int64_t batch, pixels, groups, channels, queries, levels, points;  // points a level
};

FlashSizes checked_flash(const at::Tensor& value, const at::Tensor& spatial_shapes,
                         const at::Tensor& level_start_index, const at::Tensor& sampling_loc_attn, int64_t n_points) {
  family::check_dense(value, "value", 4, "[N, S, group, group_channels]");
  family::check_dense(spatial_shapes, "spatial_shapes", 2, "[levels, 2] (height, width)");
  family::check_dense(level_start_index, "level_start_index", 1, "[levels]");
  family::check_dense(sampling_loc_attn, "sampling_loc_attn", 4, "[N, Lq, group, levels * n_points * 3]");
  family::check_value_dtype(value, "value");
  family::check_point_dtype(sampling_loc_attn, "sampling_loc_attn", value, "value");
  TORCH_CHECK(spatial_shapes.scalar_type() == at::kLong, "spatial_shapes must be an int64 (torch.long) tensor, got ",
              spatial_shapes.scalar_type());
  TORCH_CHECK(level_start_index.scalar_type() == at::kLong,
              "level_start_index must be an int64 (torch.long) tensor, got ", level_start_index.scalar_type());
  family::check_device(spatial_shapes, "spatial_shapes", value, "value");
  family::check_device(level_start_index, "level_start_index", value, "value");
  family::check_device(sampling_loc_attn, "sampling_loc_attn", value, "value");
  TORCH_CHECK(n_points >= 1, "n_points must be >= 1, got ", n_points);
  FlashSizes s{value.size(0), value.size(1), value.size(2), value.size(3), sampling_loc_attn.size(1),
               spatial_shapes.size(0), n_points};
  TORCH_CHECK(s.levels >= 1 && spatial_shapes.size(1) == 2,
              "spatial_shapes must have shape [levels, 2] with at least 1 level, got ", spatial_shapes.sizes());
  TORCH_CHECK(level_start_index.size(0) == s.levels, "level_start_index must have shape (", s.levels,
              ",) [levels], got ", level_start_index.sizes());
  TORCH_CHECK(s.groups >= 1, "value must have at least 1 group, got shape ", value.sizes());
  const int64_t per_query = family::checked_mul_add(s.levels * 3, n_points, 0, "levels * n_points * 3");
  family::check_shape(sampling_loc_attn, "sampling_loc_attn", {s.batch, s.queries, s.groups, per_query},
                      "[N, Lq, group, levels * n_points * 3]");
  // On the CPU the levels' values are checked here; a GPU's are not read by the host (a synchronisation a call)
  // but checked on the device, and the kernels sample NaN from a level that does not fit in value.
  if (value.device().is_cpu()) {
    check_level_values(spatial_shapes, level_start_index, s.pixels);
  } else {
    assert_level_values_async(spatial_shapes, level_start_index, s.pixels);
  }
  return s;
}

struct FlashPoints {
  at::Tensor weights, points;  // the softmax's output [N, Lq, G, L * K] and the points [N, Lq, G, L * K, 3]
};

// The softmax over each query's levels and points of its weights' logits: [N, Lq, G, L * K], in `dtype`.
at::Tensor flash_weights(const FlashSizes& s, const at::Tensor& sampling_loc_attn, at::ScalarType dtype) {
  const int64_t points = s.levels * s.points;
  return softmax_weights(sampling_loc_attn.narrow(3, 2 * points, points), dtype).contiguous();
}

FlashPoints flash_points(const FlashSizes& s, const at::Tensor& spatial_shapes, const at::Tensor& sampling_loc_attn,
                         at::ScalarType dtype) {
  const int64_t points = s.levels * s.points;
  const at::Tensor locations = sampling_loc_attn.narrow(3, 0, 2 * points).unflatten(3, {points, 2});
  const at::Tensor weights = flash_weights(s, sampling_loc_attn, dtype);
  return {weights, level_points(locations, weights, spatial_shapes, s.points, dtype)};
}

}  // namespace

at::Tensor flash_deform_attn_forward(const SampledSumKernels& kernels, const at::Tensor& value,
                                     const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                                     const at::Tensor& sampling_loc_attn, int64_t n_points) {
  const FlashSizes s = checked_flash(value, spatial_shapes, level_start_index, sampling_loc_attn, n_points);
  const at::ScalarType dtype = point_dtype(value.scalar_type());
  if (kernels.level_forward != nullptr) {
    // The points read in place from the locations, beside the softmax's weights (the same points as
    // flash_points', bitwise).
    const at::Tensor weights = flash_weights(s, sampling_loc_attn, dtype);
    const at::Tensor output = kernels.level_forward(value, spatial_shapes, level_start_index,
                                                    sampling_loc_attn.contiguous(), weights, s.points);
    return output.view({s.batch, s.queries, s.groups * s.channels});
  }
  const FlashPoints p = flash_points(s, spatial_shapes, sampling_loc_attn, dtype);
  const at::Tensor output = kernels.forward(value, p.points, point_levels(s.levels, s.points, value),
                                            spatial_shapes, level_start_index);
  return output.view({s.batch, s.queries, s.groups * s.channels});
}

std::tuple<at::Tensor, at::Tensor> flash_deform_attn_backward(const SampledSumKernels& kernels,
                                                              const at::Tensor& grad_output, const at::Tensor& value,
                                                              const at::Tensor& spatial_shapes,
                                                              const at::Tensor& level_start_index,
                                                              const at::Tensor& sampling_loc_attn, int64_t n_points) {
  const FlashSizes s = checked_flash(value, spatial_shapes, level_start_index, sampling_loc_attn, n_points);
  family::check_dense(grad_output, "grad_output", 3, "[N, Lq, group * group_channels]");
  TORCH_CHECK(grad_output.scalar_type() == value.scalar_type(), "grad_output must have value's dtype ",
              value.scalar_type(), ", got ", grad_output.scalar_type());
  family::check_device(grad_output, "grad_output", value, "value");
  family::check_shape(grad_output, "grad_output", {s.batch, s.queries, s.groups * s.channels},
                      "[N, Lq, group * group_channels]");
  const at::ScalarType dtype = point_dtype(value.scalar_type());
  if (kernels.level_backward != nullptr) {  // the points read in place, as the forward's
    const at::Tensor weights = flash_weights(s, sampling_loc_attn, dtype);
    const auto [grad_value, grad_locations, grad_weights] = kernels.level_backward(
        grad_output.reshape({s.batch, s.queries, s.groups, s.channels}), value, spatial_shapes, level_start_index,
        sampling_loc_attn.contiguous(), weights, s.points, BorderGradient::torchvision);
    const at::Tensor grad = at::cat({grad_locations, softmax_weights_backward(grad_weights, weights)}, 3);
    return {grad_value, grad.to(sampling_loc_attn.scalar_type())};
  }
  const FlashPoints p = flash_points(s, spatial_shapes, sampling_loc_attn, dtype);
  const auto [grad_value, grad_points] =
      kernels.backward(grad_output.reshape({s.batch, s.queries, s.groups, s.channels}), value, p.points,
                       point_levels(s.levels, s.points, value), spatial_shapes, level_start_index,
                       BorderGradient::torchvision);
  const auto [grad_locations, grad_weights] = level_points_backward(grad_points, spatial_shapes, s.points);
  const at::Tensor grad = at::cat({grad_locations.flatten(3), softmax_weights_backward(grad_weights, p.weights)}, 3);
  return {grad_value, grad.to(sampling_loc_attn.scalar_type())};
}

}  // namespace deform_conv
