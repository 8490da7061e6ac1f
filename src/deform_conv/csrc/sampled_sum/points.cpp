#include "points.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/stack.h>

#include <vector>

namespace deform_conv {
namespace {

// A small table computed on the host, as a 1-D tensor of `dtype` on `like`'s device.
at::Tensor table(const std::vector<double>& values, const at::Tensor& like, at::ScalarType dtype) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kDouble));
  double* data = t.mutable_data_ptr<double>();
  for (size_t i = 0; i < values.size(); ++i) data[i] = values[i];
  return t.to(like.options().dtype(dtype));
}

// [L * K] of a per-level quantity (column `column` of spatial_shapes), in `dtype`.
at::Tensor per_point(const at::Tensor& spatial_shapes, int64_t column, int64_t points_per_level,
                     at::ScalarType dtype) {
  const int64_t levels = spatial_shapes.size(0);
  return spatial_shapes.select(1, column).to(dtype).unsqueeze(1).expand({levels, points_per_level})
      .reshape({levels * points_per_level});
}

}  // namespace

GridTables grid_tables(const ConvGrid& g) {
  GridTables t;
  for (int64_t i = 0; i < g.kernel_w; ++i) {
    for (int64_t j = 0; j < g.kernel_h; ++j) {
      if (g.remove_center && i == g.kernel_w / 2 && j == g.kernel_h / 2) continue;
      t.tap_x.push_back(static_cast<double>(i * g.dilation_w));
      t.tap_y.push_back(static_cast<double>(j * g.dilation_h));
    }
  }
  // p0 - half * offset_scale of each output column (row), half = (dilation * (kernel - 1)) / 2.
  const int64_t half_w = (g.dilation_w * (g.kernel_w - 1)) / 2, half_h = (g.dilation_h * (g.kernel_h - 1)) / 2;
  for (int64_t o = 0; o < g.out_width(); ++o) {
    t.base_x.push_back(static_cast<double>(half_w - g.pad_w + o * g.stride_w) - half_w * g.offset_scale);
  }
  for (int64_t o = 0; o < g.out_height(); ++o) {
    t.base_y.push_back(static_cast<double>(half_h - g.pad_h + o * g.stride_h) - half_h * g.offset_scale);
  }
  return t;
}

at::Tensor grid_points(const ConvGrid& g, const at::Tensor& offsets, const at::Tensor& weights,
                       at::ScalarType dtype) {
  const int64_t points = g.points(), out_h = g.out_height(), out_w = g.out_width();
  const GridTables t = grid_tables(g);
  const double s = g.offset_scale;
  // As InternImage's kernel: base + (tap + offset) * offset_scale.
  const at::Tensor x = table(t.base_x, offsets, dtype).view({1, 1, out_w, 1, 1})
                           .add(table(t.tap_x, offsets, dtype).view({1, 1, 1, 1, points}).add(offsets.select(-1, 0)).mul(s));
  const at::Tensor y = table(t.base_y, offsets, dtype).view({1, out_h, 1, 1, 1})
                           .add(table(t.tap_y, offsets, dtype).view({1, 1, 1, 1, points}).add(offsets.select(-1, 1)).mul(s));
  const at::Tensor points_ = at::stack({x, y, weights.to(dtype)}, -1);
  return points_.view({offsets.size(0), out_h * out_w, offsets.size(3), points, 3});
}

std::pair<at::Tensor, at::Tensor> grid_points_backward(const ConvGrid& g, const at::Tensor& grad_points) {
  const int64_t batch = grad_points.size(0), groups = grad_points.size(2), points = g.points();
  const at::Tensor offsets = grad_points.narrow(-1, 0, 2).mul(g.offset_scale)
                                 .reshape({batch, g.out_height(), g.out_width(), groups, points, 2});
  // Contiguous copies, not views into the points' gradient: the ops return them as they are.
  const at::Tensor weights =
      grad_points.select(-1, 2).reshape({batch, g.out_height(), g.out_width(), groups, points}).contiguous();
  return {offsets, weights};
}

at::Tensor level_points(const at::Tensor& locations, const at::Tensor& weights, const at::Tensor& spatial_shapes,
                        int64_t points_per_level, at::ScalarType dtype) {
  // grid_sample's convention (sampling.h's half_pixel_coordinate): pixel coordinate = location * size - 0.5.
  const at::Tensor widths = per_point(spatial_shapes, 1, points_per_level, dtype);
  const at::Tensor heights = per_point(spatial_shapes, 0, points_per_level, dtype);
  const at::Tensor x = locations.select(-1, 0).to(dtype).mul(widths).sub(0.5);
  const at::Tensor y = locations.select(-1, 1).to(dtype).mul(heights).sub(0.5);
  return at::stack({x, y, weights.to(dtype)}, -1);
}

std::pair<at::Tensor, at::Tensor> level_points_backward(const at::Tensor& grad_points,
                                                        const at::Tensor& spatial_shapes, int64_t points_per_level) {
  const at::ScalarType dtype = grad_points.scalar_type();
  const at::Tensor widths = per_point(spatial_shapes, 1, points_per_level, dtype);
  const at::Tensor heights = per_point(spatial_shapes, 0, points_per_level, dtype);
  const at::Tensor locations = at::stack({grad_points.select(-1, 0).mul(widths), grad_points.select(-1, 1).mul(heights)}, -1);
  return {locations, grad_points.select(-1, 2).contiguous()};
}

at::Tensor point_levels(int64_t levels, int64_t points_per_level, const at::Tensor& like) {
  return at::arange(levels, like.options().dtype(at::kLong)).unsqueeze(1).expand({levels, points_per_level})
      .reshape({levels * points_per_level});
}

at::Tensor softmax_weights(const at::Tensor& logits, at::ScalarType dtype) { return at::softmax(logits, -1, dtype); }

at::Tensor softmax_weights_backward(const at::Tensor& grad_weights, const at::Tensor& weights) {
  return weights.mul(grad_weights.sub(grad_weights.mul(weights).sum(-1, /*keepdim=*/true)));
}

}  // namespace deform_conv
