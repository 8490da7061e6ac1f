#include "dcnv4.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>

#include "../dcnv3/dcnv3.h"
#include "../sampled_sum/checks.h"
#include "../sampled_sum/points.h"

namespace deform_conv {
namespace {

// The grid, after checking offset_mask too.
ConvGrid checked_dcnv4(const at::Tensor& input, const at::Tensor& offset_mask, at::IntArrayRef kernel_size,
                       at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t group,
                       double offset_scale, bool remove_center) {
  const ConvGrid g =
      make_dcnv3_grid(input, kernel_size, stride, padding, dilation, group, offset_scale, remove_center);
  family::check_dense(offset_mask, "offset_mask", 4, "[N, H_out, W_out, P]");
  family::check_point_dtype(offset_mask, "offset_mask", input, "input");
  family::check_device(offset_mask, "offset_mask", input, "input");
  const int64_t needed = group * g.points() * 3;
  TORCH_CHECK(offset_mask.size(0) == input.size(0) && offset_mask.size(1) == g.out_height() &&
                  offset_mask.size(2) == g.out_width() && offset_mask.size(3) >= needed,
              "offset_mask must have shape [", input.size(0), ", ", g.out_height(), ", ", g.out_width(), ", P] with P >= ",
              "group * K * 3 = ", needed, " [N, H_out, W_out, P], got ", offset_mask.sizes());
  return g;
}

// offset_mask's groups' blocks: offsets [N, Ho, Wo, G, K, 2] and mask values [N, Ho, Wo, G, K] (views).
std::pair<at::Tensor, at::Tensor> split(const ConvGrid& g, const at::Tensor& offset_mask, int64_t group) {
  const int64_t k = g.points();
  const at::Tensor blocks = offset_mask.narrow(3, 0, group * 3 * k)
                                .unflatten(3, {group, 3 * k});
  return {blocks.narrow(4, 0, 2 * k).unflatten(4, {k, 2}), blocks.narrow(4, 2 * k, k)};
}

// Where point k of group g lies in an output pixel's offset_mask [P]: its offsets at g * 3K + 2k, its mask value
// at g * 3K + 2K + k.
GridLayout dcnv4_layout(const at::Tensor& offset_mask, int64_t points) {
  return {offset_mask.size(3), 3 * points, offset_mask.size(3), 2 * points, 3 * points};
}

}  // namespace

at::Tensor dcnv4_forward(const SampledSumKernels& kernels, const at::Tensor& input, const at::Tensor& offset_mask,
                         at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding,
                         at::IntArrayRef dilation, int64_t group, double offset_scale, bool remove_center,
                         bool softmax) {
  const ConvGrid g =
      checked_dcnv4(input, offset_mask, kernel_size, stride, padding, dilation, group, offset_scale, remove_center);
  const at::ScalarType dtype = point_dtype(input.scalar_type());
  const GridCall call = grid_call(g, input, group);
  // The points read in place from offset_mask's blocks, their weights too or, under the softmax, from its output
  // beside them (the same points as grid_points', bitwise).
  const int64_t k = g.points();
  if (kernels.grid_forward != nullptr && !softmax &&
      (offset_mask.scalar_type() == dtype || offset_mask.scalar_type() == input.scalar_type())) {
    const at::Tensor om = offset_mask.contiguous();
    const at::Tensor output = kernels.grid_forward(call.value, g, dcnv4_layout(offset_mask, k), om, om);
    return output.view({input.size(0), g.out_height(), g.out_width(), input.size(3)});
  }
  const auto [offsets, mask] = split(g, offset_mask, group);
  if (kernels.grid_forward != nullptr && softmax && offset_mask.scalar_type() == dtype) {
    const at::Tensor weights = softmax_weights(mask, dtype).contiguous();
    const at::Tensor output = kernels.grid_forward(call.value, g, {offset_mask.size(3), 3 * k, group * k, 0, k},
                                                   offset_mask.contiguous(), weights);
    return output.view({input.size(0), g.out_height(), g.out_width(), input.size(3)});
  }
  const at::Tensor pts = grid_points(g, offsets, softmax ? softmax_weights(mask, dtype) : mask, dtype);
  const at::Tensor output =
      kernels.forward(call.value, pts, call.point_levels, call.spatial_shapes, call.level_start_index);
  return output.view({input.size(0), g.out_height(), g.out_width(), input.size(3)});
}

std::tuple<at::Tensor, at::Tensor> dcnv4_backward(const SampledSumKernels& kernels, const at::Tensor& grad_output,
                                                  const at::Tensor& input, const at::Tensor& offset_mask,
                                                  at::IntArrayRef kernel_size, at::IntArrayRef stride,
                                                  at::IntArrayRef padding, at::IntArrayRef dilation, int64_t group,
                                                  double offset_scale, bool remove_center, bool softmax) {
  const ConvGrid g =
      checked_dcnv4(input, offset_mask, kernel_size, stride, padding, dilation, group, offset_scale, remove_center);
  const int64_t batch = input.size(0), channels = input.size(3), k = g.points();
  check_grid_grad_output(g, grad_output, input);
  const at::ScalarType dtype = point_dtype(input.scalar_type());
  const GridCall call = grid_call(g, input, group);
  const at::Tensor grad = grad_output.reshape({batch, g.out_height() * g.out_width(), group, channels / group});
  if (kernels.grid_backward != nullptr && !softmax &&
      (offset_mask.scalar_type() == dtype || offset_mask.scalar_type() == input.scalar_type())) {
    // The points read in place from offset_mask's blocks, their gradients written into the same blocks (the
    // padding channels stay 0).
    const at::Tensor om = offset_mask.contiguous();
    const auto [grad_value, grad_offset_mask, same_tensor] = kernels.grid_backward(
        grad, call.value, g, dcnv4_layout(offset_mask, k), om, om, BorderGradient::mmcv);
    return {grad_value.view(input.sizes()), grad_offset_mask.to(offset_mask.scalar_type())};
  }
  const auto [offsets, mask] = split(g, offset_mask, group);
  const at::Tensor weights = softmax ? softmax_weights(mask, dtype) : mask;
  const at::Tensor pts = grid_points(g, offsets, weights, dtype);
  const auto [grad_value, grad_points] = kernels.backward(grad, call.value, pts, call.point_levels,
                                                          call.spatial_shapes, call.level_start_index,
                                                          BorderGradient::mmcv);
  auto [grad_offsets, grad_weights] = grid_points_backward(g, grad_points);
  if (softmax) grad_weights = softmax_weights_backward(grad_weights, weights);
  // The groups' blocks, then zeros for the padding channels.
  const at::Tensor blocks = at::cat({grad_offsets.flatten(4), grad_weights}, 4).flatten(3);
  at::Tensor grad_offset_mask = at::zeros(offset_mask.sizes(), offset_mask.options().dtype(dtype));
  grad_offset_mask.narrow(3, 0, group * 3 * k).copy_(blocks);
  return {grad_value.view(input.sizes()), grad_offset_mask.to(offset_mask.scalar_type())};
}

}  // namespace deform_conv
