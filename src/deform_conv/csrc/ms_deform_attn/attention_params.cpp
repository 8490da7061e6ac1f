#include "attention_params.h"

#include <ATen/ops/_assert_async.h>
#include <c10/util/Exception.h>

namespace deform_conv {
namespace {

void check_dense(const at::Tensor& t, const char* name, int64_t dims, const char* layout) {
  TORCH_CHECK(t.layout() == at::kStrided, name, " must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK(t.dim() == dims, name, " must be ", dims, "-D ", layout, ", got shape ", t.sizes());
}

void check_device(const at::Tensor& t, const char* name, const at::Tensor& value) {
  TORCH_CHECK(t.device() == value.device(), name, " must be on value's device ", value.device(), ", got ",
              t.device());
}

}  // namespace

void check_level_values(const at::Tensor& spatial_shapes, const at::Tensor& level_start_index, int64_t pixels) {
  const at::Tensor shapes = spatial_shapes.contiguous();
  const at::Tensor starts = level_start_index.contiguous();
  const int64_t* hw = shapes.const_data_ptr<int64_t>();
  const int64_t* start = starts.const_data_ptr<int64_t>();
  int64_t expected = 0;
  for (int64_t l = 0; l < shapes.size(0); ++l) {
    const int64_t height = hw[2 * l], width = hw[2 * l + 1];
    TORCH_CHECK(height >= 1 && width >= 1, "spatial_shapes[", l, "] (height, width) must be at least 1x1, got (",
                height, ", ", width, ")");
    TORCH_CHECK(start[l] == expected, "level_start_index[", l, "] must be ", expected,
                " (the pixels of the levels before it, sum of H_l * W_l), got ", start[l]);
    TORCH_CHECK(level_fits(expected, height, width, pixels), "value.shape[1] must be the levels' pixel count "
                "sum(H_l * W_l) from spatial_shapes, got ", pixels, ", fewer than the ", expected, " + ", height,
                " * ", width, " that levels 0 to ", l, " need");
    expected += height * width;
  }
  TORCH_CHECK(expected == pixels, "value.shape[1] must be the levels' pixel count sum(H_l * W_l) = ", expected,
              " from spatial_shapes, got ", pixels);
}

void assert_level_values_async(const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                               int64_t pixels) {
  // What check_level_values checks, computed on the device: levels at least 1x1, each starting where the ones
  // before it end, filling value's pixels. Each level's pixel count is also compared with value's in float64 (exact
  // up to 2^53), where it cannot wrap around as an int64 product can (2^32 x 2^32 would wrap to 0).
  const at::Tensor heights = spatial_shapes.select(1, 0), widths = spatial_shapes.select(1, 1);
  const at::Tensor sizes = heights.mul(widths);
  const at::Tensor ends = sizes.cumsum(0);
  const at::Tensor fit = heights.to(at::kDouble).mul(widths.to(at::kDouble)).le(static_cast<double>(pixels)).all();
  const at::Tensor consistent = heights.ge(1).logical_and(widths.ge(1)).all()
                                    .logical_and(fit)
                                    .logical_and(level_start_index.eq(ends.sub(sizes)).all())
                                    .logical_and(ends.select(0, ends.size(0) - 1).eq(pixels));
  at::_assert_async(consistent,
                    "spatial_shapes and level_start_index must describe levels of at least 1x1 pixels, one after "
                    "another (level_start_index[l] = sum of H_k * W_k for k < l), filling value.shape[1] pixels "
                    "(checked on the device)");
}

AttentionParams make_attention_params(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                      const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                                      const at::Tensor& attention_weights, bool check_level_values) {
  check_dense(value, "value", 4, "[batch, pixels, heads, channels]");
  check_dense(spatial_shapes, "spatial_shapes", 2, "[levels, 2] (height, width)");
  check_dense(level_start_index, "level_start_index", 1, "[levels]");
  check_dense(sampling_locations, "sampling_locations", 6, "[batch, queries, heads, levels, points, 2]");
  check_dense(attention_weights, "attention_weights", 5, "[batch, queries, heads, levels, points]");
  const auto dtype = value.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
              "value must be float16, bfloat16, float32 or float64, got ", dtype);
  // Locations and weights in value's dtype, or float32 beside a half value (cuda/float32_points.h).
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  TORCH_CHECK(sampling_locations.scalar_type() == dtype || (half && sampling_locations.scalar_type() == at::kFloat),
              "sampling_locations must have value's dtype ", dtype, half ? " or float32" : "", ", got ",
              sampling_locations.scalar_type());
  TORCH_CHECK(attention_weights.scalar_type() == dtype || (half && attention_weights.scalar_type() == at::kFloat),
              "attention_weights must have value's dtype ", dtype, half ? " or float32" : "", ", got ",
              attention_weights.scalar_type());
  TORCH_CHECK(spatial_shapes.scalar_type() == at::kLong, "spatial_shapes must be an int64 (torch.long) tensor, got ",
              spatial_shapes.scalar_type());
  TORCH_CHECK(level_start_index.scalar_type() == at::kLong,
              "level_start_index must be an int64 (torch.long) tensor, got ", level_start_index.scalar_type());
  check_device(spatial_shapes, "spatial_shapes", value);
  check_device(level_start_index, "level_start_index", value);
  check_device(sampling_locations, "sampling_locations", value);
  check_device(attention_weights, "attention_weights", value);

  AttentionParams p{};
  p.batch = value.size(0);
  p.pixels = value.size(1);
  p.heads = value.size(2);
  p.channels = value.size(3);
  p.levels = spatial_shapes.size(0);
  p.queries = sampling_locations.size(1);
  p.points = sampling_locations.size(4);
  TORCH_CHECK(p.levels >= 1 && spatial_shapes.size(1) == 2,
              "spatial_shapes must have shape [levels, 2] with at least 1 level, got ", spatial_shapes.sizes());
  TORCH_CHECK(level_start_index.size(0) == p.levels, "level_start_index must have shape (", p.levels,
              ",) [levels], got ", level_start_index.sizes());
  TORCH_CHECK(p.heads >= 1, "value must have at least 1 head, got shape ", value.sizes());
  const std::vector<int64_t> locations{p.batch, p.queries, p.heads, p.levels, p.points, 2};
  TORCH_CHECK(sampling_locations.sizes() == c10::IntArrayRef(locations), "sampling_locations must have shape ",
              c10::IntArrayRef(locations), " [batch, queries, heads, levels, points, 2], got ",
              sampling_locations.sizes());
  const std::vector<int64_t> weights{p.batch, p.queries, p.heads, p.levels, p.points};
  TORCH_CHECK(attention_weights.sizes() == c10::IntArrayRef(weights), "attention_weights must have shape ",
              c10::IntArrayRef(weights), " [batch, queries, heads, levels, points], got ", attention_weights.sizes());
  if (check_level_values) deform_conv::check_level_values(spatial_shapes, level_start_index, p.pixels);
  return p;
}

void check_attention_grad_output(const AttentionParams& p, const at::Tensor& grad_output, const at::Tensor& value) {
  TORCH_CHECK(grad_output.layout() == at::kStrided, "grad_output must be a dense (strided) tensor");
  TORCH_CHECK(grad_output.scalar_type() == value.scalar_type() && grad_output.device() == value.device(),
              "grad_output must have value's dtype and device (", value.scalar_type(), ", ", value.device(),
              "), got ", grad_output.scalar_type(), ", ", grad_output.device());
  const std::vector<int64_t> expected{p.batch, p.queries, p.heads * p.channels};
  TORCH_CHECK(grad_output.sizes() == c10::IntArrayRef(expected), "grad_output must have shape ",
              c10::IntArrayRef(expected), ", got ", grad_output.sizes());
}

}  // namespace deform_conv
