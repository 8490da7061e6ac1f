#include "float32_points.h"

#include "../../sampled_sum/points.h"

namespace deform_conv {
namespace {

at::Tensor points_of(const AttentionParams& p, const at::Tensor& spatial_shapes, const at::Tensor& locations,
                     const at::Tensor& weights) {
  const int64_t points = p.levels * p.points;
  return level_points(locations.reshape({p.batch, p.queries, p.heads, points, 2}),
                      weights.reshape({p.batch, p.queries, p.heads, points}), spatial_shapes, p.points, at::kFloat);
}

}  // namespace

bool has_float32_points(const at::Tensor& value, const at::Tensor& sampling_locations,
                        const at::Tensor& attention_weights) {
  return sampling_locations.scalar_type() != value.scalar_type() ||
         attention_weights.scalar_type() != value.scalar_type();
}

at::Tensor ms_deform_attn_on_float32_points(const SampledSumKernels& kernels, const AttentionParams& p,
                                            const at::Tensor& value, const at::Tensor& spatial_shapes,
                                            const at::Tensor& level_start_index,
                                            const at::Tensor& sampling_locations,
                                            const at::Tensor& attention_weights) {
  const at::Tensor points = points_of(p, spatial_shapes, sampling_locations, attention_weights);
  const at::Tensor output = kernels.forward(value, points, point_levels(p.levels, p.points, value), spatial_shapes,
                                            level_start_index);
  return output.view({p.batch, p.queries, p.heads * p.channels});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward_on_float32_points(
    const SampledSumKernels& kernels, const AttentionParams& p, const at::Tensor& grad_output,
    const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
    const at::Tensor& sampling_locations, const at::Tensor& attention_weights) {
  const at::Tensor points = points_of(p, spatial_shapes, sampling_locations, attention_weights);
  const auto [grad_value, grad_points] =
      kernels.backward(grad_output.reshape({p.batch, p.queries, p.heads, p.channels}), value, points,
                       point_levels(p.levels, p.points, value), spatial_shapes, level_start_index,
                       BorderGradient::torchvision);
  const auto [grad_locations, grad_weights] = level_points_backward(grad_points, spatial_shapes, p.points);
  return {grad_value, grad_locations.reshape(sampling_locations.sizes()).to(sampling_locations.scalar_type()),
          grad_weights.reshape(attention_weights.sizes()).to(attention_weights.scalar_type())};
}

}  // namespace deform_conv
