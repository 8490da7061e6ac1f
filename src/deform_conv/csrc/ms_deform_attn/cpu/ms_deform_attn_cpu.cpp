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

// The locations [N, Lq, M, L * P * 2] and weights [N, Lq, M, L * P] as level_forward reads them, each in its own
// dtype (the value's, or float32 beside a half value).
struct LevelArguments {
  at::Tensor locations, weights;
};

LevelArguments level_arguments(const AttentionParams& p, const at::Tensor& sampling_locations,
                               const at::Tensor& attention_weights) {
  const int64_t points = p.levels * p.points;
  return {sampling_locations.contiguous().view({p.batch, p.queries, p.heads, 2 * points}),
          attention_weights.contiguous().view({p.batch, p.queries, p.heads, points})};
}

}  // namespace

at::Tensor ms_deform_attn_forward(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                  const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                                  const at::Tensor& attention_weights) {
  const AttentionParams p =
      make_attention_params(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                            /*check_level_values=*/true);
  const LevelArguments a = level_arguments(p, sampling_locations, attention_weights);
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
  const LevelArguments a = level_arguments(p, sampling_locations, attention_weights);
  const auto [grad_value, grad_locations, grad_weights] = sampled_sum_kernels().level_backward(
      grad_output.reshape({p.batch, p.queries, p.heads, p.channels}), value, spatial_shapes, level_start_index,
      a.locations, a.weights, p.points, BorderGradient::torchvision);
  // Each in its argument's dtype, as level_backward writes them.
  return {grad_value, grad_locations.view(sampling_locations.sizes()), grad_weights.view(attention_weights.sizes())};
}

}  // namespace cpu
}  // namespace deform_conv
