#include "dcnv3.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <string>

#include "../pair_check.h"
#include "../sampled_sum/checks.h"

namespace deform_conv {
namespace {

// An int64 [levels, 2] or [levels] table on `like`'s device.
at::Tensor long_table(std::initializer_list<int64_t> values, c10::IntArrayRef shape, const at::Tensor& like) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(at::kLong));
  int64_t* data = t.mutable_data_ptr<int64_t>();
  for (int64_t v : values) *data++ = v;
  return t.to(like.device());
}

}  // namespace

ConvGrid make_dcnv3_grid(const at::Tensor& input, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                         at::IntArrayRef padding, at::IntArrayRef dilation, int64_t group, double offset_scale,
                         bool remove_center) {
  family::check_dense(input, "input", 4, "[N, H, W, group * group_channels]");
  family::check_value_dtype(input, "input");
  check_pair(kernel_size, "kernel_size", 1);
  check_pair(stride, "stride", 1);
  check_pair(padding, "padding", 0);
  check_pair(dilation, "dilation", 1);
  TORCH_CHECK(group >= 1, "group must be >= 1, got ", group);
  TORCH_CHECK(input.size(3) % group == 0, "input's channels (input.shape[3] = ", input.size(3),
              ") must be divisible by group = ", group);
  TORCH_CHECK(std::isfinite(offset_scale), "offset_scale must be finite, got ", offset_scale);
  TORCH_CHECK(!remove_center || (kernel_size[0] % 2 == 1 && kernel_size[1] % 2 == 1),
              "remove_center needs an odd kernel_size in both dimensions, got ", kernel_size);
  // K (and the offsets' group * K * 3 channels, the most any op reads) overflow-checked: the schema takes any int.
  const int64_t taps = family::checked_mul_add(kernel_size[0], kernel_size[1], 0, "kernel_size[0] * kernel_size[1]");
  family::checked_mul_add(family::checked_mul_add(group, 3, 0, "group * 3"), taps, 0,
                          "group * kernel_size[0] * kernel_size[1] * 3");
  ConvGrid g{kernel_size[0], kernel_size[1], stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1],
             offset_scale, remove_center, input.size(1), input.size(2)};
  // The span of the kernel and the padded size, overflow-checked (the Python checks bound them first).
  const int64_t span_h = family::checked_mul_add(g.dilation_h, g.kernel_h - 1, 1, "dilation[0] * (kernel_size[0] - 1)");
  const int64_t span_w = family::checked_mul_add(g.dilation_w, g.kernel_w - 1, 1, "dilation[1] * (kernel_size[1] - 1)");
  const int64_t padded_h = family::checked_mul_add(2, g.pad_h, g.height, "height + 2 * padding[0]");
  const int64_t padded_w = family::checked_mul_add(2, g.pad_w, g.width, "width + 2 * padding[1]");
  TORCH_CHECK(padded_h >= span_h && padded_w >= span_w, "the kernel (", span_h, "x", span_w,
              " pixels with dilation) must fit in the padded input (", padded_h, "x", padded_w, ")");
  return g;
}

void check_grid_grad_output(const ConvGrid& g, const at::Tensor& grad_output, const at::Tensor& input) {
  family::check_dense(grad_output, "grad_output", 4, "[N, H_out, W_out, group * group_channels]");
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), "grad_output must have input's dtype ",
              input.scalar_type(), ", got ", grad_output.scalar_type());
  family::check_device(grad_output, "grad_output", input, "input");
  family::check_shape(grad_output, "grad_output", {input.size(0), g.out_height(), g.out_width(), input.size(3)},
                      "[N, H_out, W_out, group * group_channels]");
}

GridCall grid_call(const ConvGrid& grid, const at::Tensor& input, int64_t group) {
  const int64_t batch = input.size(0), channels = input.size(3);
  return {input.contiguous().view({batch, grid.height * grid.width, group, channels / group}),
          long_table({grid.height, grid.width}, {1, 2}, input), long_table({0}, {1}, input),
          at::zeros({grid.points()}, input.options().dtype(at::kLong))};
}

namespace {

ConvGrid checked_dcnv3(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask,
                       at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding,
                       at::IntArrayRef dilation, int64_t group, double offset_scale, bool remove_center) {
  const ConvGrid g =
      make_dcnv3_grid(input, kernel_size, stride, padding, dilation, group, offset_scale, remove_center);
  family::check_dense(offset, "offset", 4, "[N, H_out, W_out, group * K * 2]");
  family::check_dense(mask, "mask", 4, "[N, H_out, W_out, group * K]");
  family::check_point_dtype(offset, "offset", input, "input");
  family::check_point_dtype(mask, "mask", input, "input");
  family::check_device(offset, "offset", input, "input");
  family::check_device(mask, "mask", input, "input");
  const int64_t batch = input.size(0), points = group * g.points();
  family::check_shape(offset, "offset", {batch, g.out_height(), g.out_width(), points * 2},
                      "[N, H_out, W_out, group * K * 2]");
  family::check_shape(mask, "mask", {batch, g.out_height(), g.out_width(), points}, "[N, H_out, W_out, group * K]");
  return g;
}

// The kernels read the points in place (grid_forward, grid_backward) from offsets and a mask of one dtype, the
// points' or the input's.
bool in_place_types(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& mask) {
  const at::ScalarType dtype = point_dtype(input.scalar_type());
  return (offset.scalar_type() == dtype || offset.scalar_type() == input.scalar_type()) &&
         mask.scalar_type() == offset.scalar_type();
}

// Where point k of group g lies in an output pixel's offsets [G * K * 2] and mask [G * K].
GridLayout dcnv3_layout(int64_t group, int64_t points) {
  return {group * points * 2, points * 2, group * points, 0, points};
}

}  // namespace

at::Tensor dcnv3_forward(const SampledSumKernels& kernels, const at::Tensor& input, const at::Tensor& offset,
                         const at::Tensor& mask, at::IntArrayRef kernel_size, at::IntArrayRef stride,
                         at::IntArrayRef padding, at::IntArrayRef dilation, int64_t group, double offset_scale,
                         bool remove_center) {
  const ConvGrid g =
      checked_dcnv3(input, offset, mask, kernel_size, stride, padding, dilation, group, offset_scale, remove_center);
  const int64_t batch = input.size(0), points = g.points();
  const GridCall call = grid_call(g, input, group);
  if (kernels.grid_forward != nullptr && in_place_types(input, offset, mask)) {
    // The points read in place from the offsets and the mask (the same points as grid_points', bitwise).
    const at::Tensor output =
        kernels.grid_forward(call.value, g, dcnv3_layout(group, points), offset.contiguous(), mask.contiguous());
    return output.view({batch, g.out_height(), g.out_width(), input.size(3)});
  }
  const at::Tensor pts = grid_points(
      g, offset.reshape({batch, g.out_height(), g.out_width(), group, points, 2}),
      mask.reshape({batch, g.out_height(), g.out_width(), group, points}), point_dtype(input.scalar_type()));
  const at::Tensor output =
      kernels.forward(call.value, pts, call.point_levels, call.spatial_shapes, call.level_start_index);
  return output.view({batch, g.out_height(), g.out_width(), input.size(3)});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dcnv3_backward(
    const SampledSumKernels& kernels, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& offset, const at::Tensor& mask, at::IntArrayRef kernel_size, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t group, double offset_scale, bool remove_center) {
  const ConvGrid g =
      checked_dcnv3(input, offset, mask, kernel_size, stride, padding, dilation, group, offset_scale, remove_center);
  const int64_t batch = input.size(0), points = g.points(), channels = input.size(3);
  check_grid_grad_output(g, grad_output, input);
  const GridCall call = grid_call(g, input, group);
  const at::Tensor grad = grad_output.reshape({batch, g.out_height() * g.out_width(), group, channels / group});
  if (kernels.grid_backward != nullptr && in_place_types(input, offset, mask)) {
    // The points read in place as the forward reads them, their gradients written in the offsets' and the mask's
    // layouts (InternImage's kernel leaves a point at exactly -1 out: as below).
    const auto [grad_value, grad_offset, grad_mask] =
        kernels.grid_backward(grad, call.value, g, dcnv3_layout(group, points), offset.contiguous(),
                              mask.contiguous(), BorderGradient::mmcv);
    return {grad_value.view(input.sizes()), grad_offset.to(offset.scalar_type()), grad_mask.to(mask.scalar_type())};
  }
  const at::Tensor pts = grid_points(
      g, offset.reshape({batch, g.out_height(), g.out_width(), group, points, 2}),
      mask.reshape({batch, g.out_height(), g.out_width(), group, points}), point_dtype(input.scalar_type()));
  // InternImage's kernel leaves a point at exactly -1 out (loc > -1): its derivative there is 0, as mmcv's.
  const auto [grad_value, grad_points] = kernels.backward(grad, call.value, pts, call.point_levels,
                                                          call.spatial_shapes, call.level_start_index,
                                                          BorderGradient::mmcv);
  const auto [grad_offsets, grad_weights] = grid_points_backward(g, grad_points);
  return {grad_value.view(input.sizes()), grad_offsets.reshape(offset.sizes()).to(offset.scalar_type()),
          grad_weights.reshape(mask.sizes()).to(mask.scalar_type())};
}

}  // namespace deform_conv
