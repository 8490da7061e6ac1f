#include "sampled_sum.h"

#include <c10/util/Exception.h>

namespace deform_conv {

at::ScalarType point_dtype(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

SampledSumSizes sampled_sum_sizes(const at::Tensor& value, int64_t queries, int64_t points, int64_t levels) {
  TORCH_INTERNAL_ASSERT(value.dim() == 4, "sampled_sum: value must be [N, S, G, D]");
  return {value.size(0), value.size(1), value.size(2), value.size(3), queries, points, levels};
}

SampledSumSizes make_sampled_sum_sizes(const at::Tensor& value, const at::Tensor& points,
                                       const at::Tensor& point_levels, const at::Tensor& spatial_shapes,
                                       const at::Tensor& level_start_index) {
  TORCH_INTERNAL_ASSERT(value.dim() == 4 && points.dim() == 5 && points.size(4) == 3 && point_levels.dim() == 1 &&
                            spatial_shapes.dim() == 2 && spatial_shapes.size(1) == 2 && level_start_index.dim() == 1,
                        "sampled_sum: bad ranks");
  const SampledSumSizes s = sampled_sum_sizes(value, points.size(1), points.size(3), spatial_shapes.size(0));
  TORCH_INTERNAL_ASSERT(points.size(0) == s.batch && points.size(2) == s.groups && point_levels.size(0) == s.points &&
                            level_start_index.size(0) == s.levels,
                        "sampled_sum: inconsistent shapes");
  TORCH_INTERNAL_ASSERT(points.scalar_type() == point_dtype(value.scalar_type()) &&
                            point_levels.scalar_type() == at::kLong && spatial_shapes.scalar_type() == at::kLong &&
                            level_start_index.scalar_type() == at::kLong,
                        "sampled_sum: bad dtypes");
  return s;
}

}  // namespace deform_conv
