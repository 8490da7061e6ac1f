// CPU backend of multi-scale deformable attention: the family's kernels (csrc/sampled_sum/) on the locations and
// weights read in place (level_forward, level_backward), every dtype computed natively, the half types accumulating
// in float32 and rounded once. A location's pixel coordinate is location * size - 0.5 in float32 (float64), the
// sums are taken over the levels, then the points, in order, and the backward's tasks (image, head, level) each own
// a slice of value's gradient: the gradients are bitwise the same for any thread count.
#include "../entry_points.h"

#include "../../sampled_sum/sampled_sum.h"
#include "../attention_params.h"

namespace deform_conv {
namespace cpu {
namespace {

// The locations [N, Lq, M, L * P * 2] and weights [N, Lq, M, L * P] as level_forward reads them: the weights in
// the points' dtype or the locations' (half weights beside float32 locations are widened to float32, exactly).
struct LevelArguments {
  at::Tensor locations, weights;
};

LevelArguments level_arguments(const AttentionParams& p, const at::Tensor& value,
                               const at::Tensor& sampling_locations, const at::Tensor& attention_weights) {
  const int64_t points = p.levels * p.points;
  const at::Tensor locations = sampling_locations.contiguous().view({p.batch, p.queries, p.heads, 2 * points});
  at::Tensor weights = attention_weights.contiguous().view({p.batch, p.queries, p.heads, points});
  const at::ScalarType point_type = point_dtype(value.scalar_type());
  if (weights.scalar_type() != point_type && weights.scalar_type() != locations.scalar_type()) {
    weights = weights.to(point_type);
  }
  return {locations, weights};
}

}  // namespace

at::Tensor ms_deform_attn_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                  const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                                  const at::Tensor& attention_weights) {
  const AttentionParams p =
      make_attention_params(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                            /*check_level_values=*/true);
  const LevelArguments a = level_arguments(p, value, sampling_locations, attention_weights);
  const at::Tensor output =
      sampled_sum_kernels().level_forward(value, spatial_shapes, level_start_index, a.locations, a.weights, p.points);
  return output.view({p.batch, p.queries, p.heads * p.channels});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward(
    const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
    const at::Tensor& level_start_index, const at::Tensor& sampling_locations, const at::Tensor& attention_weights) {
  const AttentionParams p =
      make_attention_params(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                            /*check_level_values=*/true);
  check_attention_grad_output(p, grad_output, value);
  const LevelArguments a = level_arguments(p, value, sampling_locations, attention_weights);
  const auto [grad_value, grad_locations, grad_weights] = sampled_sum_kernels().level_backward(
      grad_output.reshape({p.batch, p.queries, p.heads, p.channels}), value, spatial_shapes, level_start_index,
      a.locations, a.weights, p.points, BorderGradient::torchvision);
  // Each in the dtype level_backward was given it in: the arguments' own, but for widened weights (rounded once).
  return {grad_value, grad_locations.view(sampling_locations.sizes()).to(sampling_locations.scalar_type()),
          grad_weights.view(attention_weights.sizes()).to(attention_weights.scalar_type())};
}

}  // namespace cpu
}  // namespace deform_conv
