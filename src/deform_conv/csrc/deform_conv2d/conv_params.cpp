#include "conv_params.h"

#include <c10/util/Exception.h>

#include "../pair_check.h"

namespace deform_conv {
namespace {

void check_strided(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.layout() == at::kStrided, name, " must be a dense (strided) tensor, got layout ", t.layout());
}

// Size arithmetic on values a direct torch.ops call (TorchScript, an exported program) may set near 2^63:
// checked, never wrapped (signed overflow is undefined behaviour; a wrapped size samples the wrong pixels).
int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t result = 0;
  TORCH_CHECK(!__builtin_mul_overflow(a, b, &result), what, " overflows int64 (", a, " * ", b, ")");
  return result;
}

int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t result = 0;
  TORCH_CHECK(!__builtin_add_overflow(a, b, &result), what, " overflows int64 (", a, " + ", b, ")");
  return result;
}

// 2^48 elements (1 PiB of float32) per image: no real layer comes near it.
constexpr int64_t kMaxElementsPerImage = int64_t(1) << 48;

void check_per_image(int64_t elements, const char* what) {
  TORCH_CHECK(elements <= kMaxElementsPerImage, what, " is ", elements, " elements, more than the ",
              kMaxElementsPerImage, " this op supports");
}

void check_like_input(const at::Tensor& t, const char* name, const at::Tensor& input) {
  check_strided(t, name);
  TORCH_CHECK(t.scalar_type() == input.scalar_type(), name, " must have the input's dtype ", input.scalar_type(),
              ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == input.device(), name, " must be on the input's device ", input.device(), ", got ",
              t.device());
}

}  // namespace

ConvParams make_conv_params(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& bias,
                            c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                            c10::string_view border_gradient) {
  TORCH_CHECK(border_gradient == "torchvision" || border_gradient == "mmcv",
              "border_gradient must be 'torchvision' or 'mmcv', got '", border_gradient, "'");
  check_strided(input, "input");
  TORCH_CHECK(input.dim() == 4, "input must be 4-D [batch, channels, height, width], got shape ", input.sizes());
  TORCH_CHECK(weight.dim() == 4, "weight must be 4-D [out_channels, in_channels / groups, kernel_h, kernel_w], got shape ",
              weight.sizes());
  TORCH_CHECK(offset.dim() == 4, "offset must be 4-D [batch, 2 * offset_groups * kernel_h * kernel_w, out_h, out_w], got shape ",
              offset.sizes());
  const at::ScalarType dtype = input.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
              "input must be float16, bfloat16, float32 or float64, got ", dtype);
  check_like_input(offset, "offset", input);
  check_like_input(weight, "weight", input);
  check_pair(stride, "stride", 1);
  check_pair(padding, "padding", 0);
  check_pair(dilation, "dilation", 1);

  ConvParams p{};
  p.batch = input.size(0);
  p.in_channels = input.size(1);
  p.height = input.size(2);
  p.width = input.size(3);
  p.out_channels = weight.size(0);
  p.kernel_h = weight.size(2);
  p.kernel_w = weight.size(3);
  p.stride_h = stride[0];
  p.stride_w = stride[1];
  p.pad_h = padding[0];
  p.pad_w = padding[1];
  p.dilation_h = dilation[0];
  p.dilation_w = dilation[1];
  p.has_mask = mask.has_value();
  p.border_gradient = border_gradient == "mmcv" ? BorderGradient::mmcv : BorderGradient::torchvision;

  TORCH_CHECK(p.in_channels > 0, "input must have at least 1 channel, got shape ", input.sizes());
  TORCH_CHECK(p.kernel_h > 0 && p.kernel_w > 0, "weight's kernel size must be positive, got ", weight.sizes());
  TORCH_CHECK(weight.size(1) > 0 && p.in_channels % weight.size(1) == 0, "weight.shape[1] (", weight.size(1),
              ") must divide the input's channel count (", p.in_channels, ")");
  p.groups = p.in_channels / weight.size(1);
  TORCH_CHECK(p.out_channels % p.groups == 0, "weight.shape[0] (", p.out_channels,
              ") must be divisible by groups = in_channels / weight.shape[1] = ", p.groups);

  const int64_t offset_per_group = checked_mul(2, checked_mul(p.kernel_h, p.kernel_w, "weight: kernel_h * kernel_w"),
                                               "weight: 2 * kernel_h * kernel_w");
  TORCH_CHECK(offset.size(1) > 0 && offset.size(1) % offset_per_group == 0, "offset.shape[1] must be a positive multiple of 2 * kernel_h * kernel_w = ",
              offset_per_group, ", got ", offset.size(1));
  p.offset_groups = offset.size(1) / offset_per_group;
  TORCH_CHECK(p.in_channels % p.offset_groups == 0, "offset_groups = offset.shape[1] / (2 * kernel_h * kernel_w) = ",
              p.offset_groups, " must divide the input's channel count (", p.in_channels, ")");

  // height + 2 * padding - dilation * (kernel - 1) - 1: every sampled row lies in [-padding, height + padding),
  // so once these fit in int64 so does every coordinate the kernels compute.
  const int64_t padded_h = checked_add(p.height, checked_mul(2, p.pad_h, "padding: 2 * padding[0]"),
                                       "padding: height + 2 * padding[0]");
  const int64_t padded_w = checked_add(p.width, checked_mul(2, p.pad_w, "padding: 2 * padding[1]"),
                                       "padding: width + 2 * padding[1]");
  const int64_t extent_h = padded_h - checked_mul(p.dilation_h, p.kernel_h - 1, "dilation: dilation[0] * (kernel_h - 1)") - 1;
  const int64_t extent_w = padded_w - checked_mul(p.dilation_w, p.kernel_w - 1, "dilation: dilation[1] * (kernel_w - 1)") - 1;
  TORCH_CHECK(extent_h >= 0 && extent_w >= 0, "the output would be smaller than 1x1: input ", p.height, "x", p.width,
              ", kernel ", p.kernel_h, "x", p.kernel_w, ", padding ", padding, ", dilation ", dilation);
  p.out_h = extent_h / p.stride_h + 1;  // cannot overflow: stride >= 1 and extent < padded size <= INT64_MAX
  p.out_w = extent_w / p.stride_w + 1;
  // Per-image sizes the kernels index with (a batch of 0 images, or expanded tensors, allow any sizes), bounded far
  // below 2^63 so that every later product with an element size or a tile length stays exact too.
  const int64_t out_pixels = checked_mul(p.out_h, p.out_w, "padding/stride: the output size out_h * out_w");
  check_per_image(checked_mul(checked_mul(p.height, p.width, "input: height * width"), p.in_channels,
                              "input: channels * height * width"), "input: channels * height * width");
  check_per_image(checked_mul(checked_mul(out_pixels, p.taps(), "weight/padding: the columns of an image"),
                              p.in_channels, "weight/padding: the columns of an image"),
                  "weight/padding: the columns of an image (out_h * out_w * kernel_h * kernel_w * in_channels)");
  check_per_image(checked_mul(out_pixels, p.out_channels, "weight/padding: the output of an image"),
                  "weight/padding: the output of an image (out_channels * out_h * out_w)");
  TORCH_CHECK(offset.size(0) == p.batch && offset.size(2) == p.out_h && offset.size(3) == p.out_w,
              "offset must have shape [", p.batch, ", ", offset.size(1), ", ", p.out_h, ", ", p.out_w, "], got ",
              offset.sizes());

  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    check_like_input(m, "mask", input);
    TORCH_CHECK(m.dim() == 4 && m.size(0) == p.batch && m.size(1) == p.offset_groups * p.taps() &&
                    m.size(2) == p.out_h && m.size(3) == p.out_w,
                "mask must have shape [", p.batch, ", ", p.offset_groups * p.taps(), ", ", p.out_h, ", ", p.out_w,
                "], got ", m.sizes());
  }
  if (bias.has_value()) {
    check_like_input(*bias, "bias", input);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == p.out_channels, "bias must have shape [", p.out_channels,
                "], got ", bias->sizes());
  }
  return p;
}

void check_grad_output(const ConvParams& p, const at::Tensor& grad_output, const at::Tensor& input) {
  check_like_input(grad_output, "grad_output", input);
  TORCH_CHECK(grad_output.dim() == 4 && grad_output.size(0) == p.batch && grad_output.size(1) == p.out_channels &&
                  grad_output.size(2) == p.out_h && grad_output.size(3) == p.out_w,
              "grad_output must have shape [", p.batch, ", ", p.out_channels, ", ", p.out_h, ", ", p.out_w, "], got ",
              grad_output.sizes());
}

}  // namespace deform_conv
