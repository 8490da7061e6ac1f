// Where the family's ops put their points (sampled_sum.h): on a grid plus offsets (DCNv3, DCNv4) or at normalised
// locations in levels (FlashDeformAttn), with weights given or as logits under a softmax; and the way back, from
// the points' gradients to the ops' arguments. Written once with ATen's operators, so every backend runs the same
// code (on the value's device, without a host synchronisation); the points are computed in float32 (float64 for
// a float64 value) whatever the dtype of the value or of the offsets: coordinates are never rounded to a half
// type. (The CPU kernels compute the same points in place: sampled_sum.h's grid_forward and grid_backward, on
// grid_tables, and level_forward.) Host code.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace deform_conv {

// DCNv3's and DCNv4's sampling grid (InternImage's CUDA kernel): point (i, j), i < kernel_w, j < kernel_h, x-major
// (the centre left out with remove_center), of output pixel (oy, ox) lies at
//   x = p0_x - (dilation_w * (kernel_w - 1)) / 2 * offset_scale + (i * dilation_w + offset_x) * offset_scale,
//   p0_x = (dilation_w * (kernel_w - 1)) / 2 - pad_w + ox * stride_w      (integer halves, rounded down)
// and likewise y with j, h and oy.
struct ConvGrid {
  int64_t kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  double offset_scale;
  bool remove_center;
  int64_t height, width;  // the input's

  int64_t points() const { return kernel_h * kernel_w - (remove_center ? 1 : 0); }
  int64_t out_height() const { return (height + 2 * pad_h - (dilation_h * (kernel_h - 1) + 1)) / stride_h + 1; }
  int64_t out_width() const { return (width + 2 * pad_w - (dilation_w * (kernel_w - 1) + 1)) / stride_w + 1; }
};

// The grid's tables, in float64: base_x[ox] = p0_x - half_w * offset_scale for each output column (base_y likewise
// for rows), and (tap_x, tap_y)[k] = (i * dilation_w, j * dilation_h) of each point in the grid's order. A point's
// x is base_x[ox] + (tap_x[k] + offset_x) * offset_scale, computed in the points' dtype.
struct GridTables {
  std::vector<double> base_x, base_y, tap_x, tap_y;
};
GridTables grid_tables(const ConvGrid& grid);

// Where each point's offsets and weight lie in one output pixel's row of the offset and weight tensors (both
// contiguous [N, Ho, Wo, row]): x of point k of group g at g * offset_group + 2 * k (y next to it), its weight at
// weight_start + g * weight_group + k. DCNv3: separate tensors; DCNv4: one, each group's block 3K long.
struct GridLayout {
  int64_t offset_row, offset_group, weight_row, weight_start, weight_group;
};

// offsets [N, Ho, Wo, G, K, 2] (x, y) and weights [N, Ho, Wo, G, K], any dtype and strides -> points
// [N, Ho * Wo, G, K, 3] in `dtype`.
at::Tensor grid_points(const ConvGrid& grid, const at::Tensor& offsets, const at::Tensor& weights,
                       at::ScalarType dtype);

// The points' gradient [N, Q, G, K, 3] -> the offsets' [N, Ho, Wo, G, K, 2] and the weights' [N, Ho, Wo, G, K]
// (in the points' dtype), contiguous.
std::pair<at::Tensor, at::Tensor> grid_points_backward(const ConvGrid& grid, const at::Tensor& grad_points);

// FlashDeformAttn's points: locations [N, Lq, G, L * K, 2] (x, y in [0, 1], grid_sample's align_corners=False, as
// multi-scale deformable attention's) in the levels of spatial_shapes [L, 2], K points a level, and weights
// [N, Lq, G, L * K] -> points [N, Lq, G, L * K, 3] in `dtype`.
at::Tensor level_points(const at::Tensor& locations, const at::Tensor& weights, const at::Tensor& spatial_shapes,
                        int64_t points_per_level, at::ScalarType dtype);

// The points' gradient -> the locations' [N, Lq, G, L * K, 2] and the weights' [N, Lq, G, L * K], contiguous.
std::pair<at::Tensor, at::Tensor> level_points_backward(const at::Tensor& grad_points,
                                                        const at::Tensor& spatial_shapes, int64_t points_per_level);

// The level of each of L * K points: [L * K] int64 on `like`'s device (0 for a grid).
at::Tensor point_levels(int64_t levels, int64_t points_per_level, const at::Tensor& like);

// softmax over the last dimension in `dtype`, and its backward given the softmax's output.
at::Tensor softmax_weights(const at::Tensor& logits, at::ScalarType dtype);
at::Tensor softmax_weights_backward(const at::Tensor& grad_weights, const at::Tensor& weights);

}  // namespace deform_conv
