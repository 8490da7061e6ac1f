// The kernels DCNv3, DCNv4 and FlashDeformAttn share: for each (image, query, group), the weighted sum of bilinear
// samples of a channels-last value tensor at given points, and its gradients. The ops differ only in where their
// points come from (a grid plus offsets, or normalised locations in levels) and whether their weights pass
// through a softmax; each op's host code (csrc/<op>/) computes the points in float32 (float64 for a float64
// value) with ATen's operators (points.h), whatever the value's dtype, calls these kernels, and carries the
// points' gradients back to its own arguments. So there is one CPU and one CUDA kernel for the whole family (and
// multi-scale deformable attention's CPU kernels). (The CPU's grid_forward, grid_backward, level_forward and
// level_backward, below, read the points in place instead: the same points.)
//
//   value        [N, S, G, D]     S = the pixels of all levels, one level after another
//   points       [N, Q, G, K, 3]  (x, y, weight) of each point, x and y in the level's pixel coordinates
//                                 (the bilinear sampling of csrc/sampling.h); float32 (float64 for float64 values)
//   point_levels [K] int64        the level of each point
//   levels       spatial_shapes [L, 2] (height, width) and level_start_index [L], int64
//   -> output    [N, Q, G, D]     value's dtype
//
// The backward returns value's gradient (value's dtype) and the points' [N, Q, G, K, 3] (d x, d y, d weight),
// the coordinates' derivatives following `border` at exactly -1 and zero for points outside their level
// (sampling.h's coordinate_grad). Host code.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "../sampling.h"
#include "points.h"
#include "sampled_sum_sizes.h"

namespace deform_conv {

// The family's kernels of one backend: what an op's host code calls.
struct SampledSumKernels {
  at::Tensor (*forward)(const at::Tensor& value, const at::Tensor& points, const at::Tensor& point_levels,
                        const at::Tensor& spatial_shapes, const at::Tensor& level_start_index);
  std::tuple<at::Tensor, at::Tensor> (*backward)(const at::Tensor& grad_output, const at::Tensor& value,
                                                 const at::Tensor& points, const at::Tensor& point_levels,
                                                 const at::Tensor& spatial_shapes,
                                                 const at::Tensor& level_start_index, BorderGradient border);
  // The forward on a grid's points read in place from contiguous offsets and weights (points.h's GridLayout) of
  // the points' dtype or the value's, without materialising them: the same points, the same sums, bitwise. The
  // CPU's only (nullptr elsewhere: there the host code materialises the points).
  at::Tensor (*grid_forward)(const at::Tensor& value, const ConvGrid& grid, const GridLayout& layout,
                             const at::Tensor& offsets, const at::Tensor& weights);
  // The backward on a grid's points read in place as grid_forward reads them: value's gradient, and the gradients
  // of the offsets and of the weights (the points' dtype, laid out as `offsets` and `weights`; one tensor where they
  // are one), the offsets' being the points' times offset_scale, as grid_points_backward's: the same bits as the
  // backward on the materialised points. The CPU's only, as grid_forward.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> (*grid_backward)(const at::Tensor& grad_output,
                                                                  const at::Tensor& value, const ConvGrid& grid,
                                                                  const GridLayout& layout, const at::Tensor& offsets,
                                                                  const at::Tensor& weights, BorderGradient border);
  // The forward on points in levels read in place from normalised locations (level_points' convention; any layout
  // with point k's x and y at 2 * k and 2 * k + 1 of its group's block, `locations` contiguous [N, Q, G, block],
  // of the points' dtype or the value's) and contiguous weights [N, Q, G, L * K] (the points' dtype or the value's,
  // each whatever the other's), K = points_per_level: the same points, the same sums, bitwise. The CPU's only, as
  // grid_forward.
  at::Tensor (*level_forward)(const at::Tensor& value, const at::Tensor& spatial_shapes,
                              const at::Tensor& level_start_index, const at::Tensor& locations,
                              const at::Tensor& weights, int64_t points_per_level);
  // Its backward: grad_value, and the gradients of the locations [N, Q, G, 2 * L * K] (point k's x and y at 2 * k
  // and 2 * k + 1, whatever the layout of `locations`) and of the weights [N, Q, G, L * K], each in the dtype of
  // its argument.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> (*level_backward)(
      const at::Tensor& grad_output, const at::Tensor& value, const at::Tensor& spatial_shapes,
      const at::Tensor& level_start_index, const at::Tensor& locations, const at::Tensor& weights,
      int64_t points_per_level, BorderGradient border);
};

namespace cpu {
const SampledSumKernels& sampled_sum_kernels();  // cpu/sampled_sum_cpu.cpp
}  // namespace cpu
namespace cuda {
const SampledSumKernels& sampled_sum_kernels();  // cuda/sampled_sum_cuda.cpp
}  // namespace cuda

// Checks the kernels' arguments against each other (only the family's host code calls the kernels, so a failure
// here is a bug of ours, not a user's) and returns the sizes.
SampledSumSizes make_sampled_sum_sizes(const at::Tensor& value, const at::Tensor& points,
                                       const at::Tensor& point_levels, const at::Tensor& spatial_shapes,
                                       const at::Tensor& level_start_index);

// The sizes of a call on `value` [N, S, G, D] with `queries` rows of `points` points in `levels` levels.
SampledSumSizes sampled_sum_sizes(const at::Tensor& value, int64_t queries, int64_t points, int64_t levels);

// The dtype points are computed in for a value of `dtype`: float64 for float64, else float32.
at::ScalarType point_dtype(at::ScalarType dtype);

}  // namespace deform_conv
