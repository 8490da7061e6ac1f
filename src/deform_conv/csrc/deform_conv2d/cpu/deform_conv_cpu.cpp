// CPU backend: the three sampling passes (sampling_passes.cpp), dispatched over float32/float64, behind the shared
// chunk-and-GEMM driver; float32 forwards whose tiles hold 32 pixels fuse sampling and GEMM per tile
// (tiled_forward.cpp), and float32 backward GEMMs run on the batch-reduce GEMM (brgemm.cpp); depthwise layers
// take their own path without GEMMs (depthwise.cpp). Where the CPU multiplies the half types natively
// (half_gemm.h), their GEMMs run in them: the forward tiled, or as oneDNN's half convolution over the driver's
// columns, and the backward's on half GEMMs (brgemm.h), the passes reading their input as it is and summing in
// float32; elsewhere they run through float32.
#include "../entry_points.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "../../cpu_kernels.h"
#include "../columns_driver.h"
#include "brgemm.h"
#include "depthwise.h"
#include "half_conversion.h"
#include "half_gemm.h"
#include "layout.h"
#include "sampling_passes.h"
#include "scratch.h"
#include "tiled_backward.h"
#include "tiled_forward.h"
#include "transpose.h"

namespace deform_conv {
namespace cpu {
namespace {

template <typename scalar_t, typename image_t = scalar_t>
SamplingInputs<scalar_t, image_t> pointers(const SamplingTensors& t) {
  return {t.input.const_data_ptr<image_t>(), t.offset.const_data_ptr<scalar_t>(),
          t.mask.defined() ? t.mask.const_data_ptr<scalar_t>() : nullptr};
}

// A half-type layer's columns (its offsets and mask widened to float32, its input in the half type) in the half
// type of the column buffer: sampled in float32 and rounded once as they are written, for the half GEMM.
template <typename half_t>
void fill_half(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images, at::Tensor& columns) {
  fill_columns(p, pointers<float, half_t>(t), first, images, columns.mutable_data_ptr<half_t>());
}

// The columns in the input's dtype, or in the half type of the column buffer (fill_half).
void fill(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images, at::Tensor& columns) {
  switch (columns.scalar_type()) {
    case at::kBFloat16:
      fill_half<c10::BFloat16>(p, t, first, images, columns);
      return;
    case at::kHalf:
      fill_half<c10::Half>(p, t, first, images, columns);
      return;
    default:
      AT_DISPATCH_FLOATING_TYPES(t.input.scalar_type(), "deform_conv2d_cpu", [&] {
        fill_columns(p, pointers<scalar_t>(t), first, images, columns.mutable_data_ptr<scalar_t>());
      });
  }
}

template <typename scalar_t, typename image_t = scalar_t>
void coordinate_grads_from(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                           const at::Tensor& grad_columns, at::Tensor& grad_offset, at::Tensor& grad_mask) {
  coordinate_and_mask_grads(p, pointers<scalar_t, image_t>(t), first, images, grad_columns.const_data_ptr<scalar_t>(),
                            grad_offset.mutable_data_ptr<scalar_t>(),
                            grad_mask.defined() ? grad_mask.mutable_data_ptr<scalar_t>() : nullptr);
}

// The coordinates' gradient, in the dtype of the columns' gradient: the input's, or float32 for a half-type input,
// whose image the pass reads as it is.
void coordinate_grads(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                      const at::Tensor& grad_columns, at::Tensor& grad_offset, at::Tensor& grad_mask) {
  switch (t.input.scalar_type()) {
    case at::kBFloat16:
      return coordinate_grads_from<float, c10::BFloat16>(p, t, first, images, grad_columns, grad_offset, grad_mask);
    case at::kHalf:
      return coordinate_grads_from<float, c10::Half>(p, t, first, images, grad_columns, grad_offset, grad_mask);
    default:
      AT_DISPATCH_FLOATING_TYPES(t.input.scalar_type(), "deform_conv2d_backward_cpu", [&] {
        coordinate_grads_from<scalar_t>(p, t, first, images, grad_columns, grad_offset, grad_mask);
      });
  }
}

// The input's gradient, in the dtype of the columns' gradient: the pass reads the offsets and the mask, not the
// input.
void input_grad(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                const at::Tensor& grad_columns, at::Tensor& grad_input) {
  AT_DISPATCH_FLOATING_TYPES(grad_columns.scalar_type(), "deform_conv2d_backward_cpu", [&] {
    const SamplingInputs<scalar_t> in{nullptr, t.offset.const_data_ptr<scalar_t>(),
                                      t.mask.defined() ? t.mask.const_data_ptr<scalar_t>() : nullptr};
    accumulate_input_grad<scalar_t>(p, in, first, images, grad_columns.const_data_ptr<scalar_t>(),
                                    grad_input.mutable_data_ptr<scalar_t>());
  });
}

// 8 MiB of columns per chunk (at least one image): written by the sampling pass and read by the GEMM while
// still in cache. The buffers live in per-thread scratch memory (scratch.h), kept from call to call: a backward
// chunk stretched to an image per thread stays within what it keeps.
constexpr SamplingPasses kPasses{fill, coordinate_grads, input_grad, int64_t(8) << 20, /*gemm_as_convolution=*/true,
                                 /*backward_gemms=*/backward_gemms, scratch, kMaxKeptScratchBytes,
                                 /*backward_column_dtype=*/at::ScalarType::Undefined, channels_last, channels_first,
                                 weight_in_column_order, tiled_backward<float>};
// A half-type layer's backward where the CPU does not multiply its type natively: in float32, as a float32
// layer's, its input widened as it is turned for the passes, grad_output a chunk at a time for the GEMMs, the
// input's gradient rounded as it is turned back, the weight widened as it is turned to the columns' order (the
// offsets and the mask come widened).
constexpr SamplingPasses kHalfInFloat32Passes{fill, coordinate_grads, input_grad, int64_t(8) << 20, true,
                                              backward_gemms, scratch, kMaxKeptScratchBytes,
                                              /*backward_column_dtype=*/at::kFloat, channels_last, channels_first,
                                              weight_in_column_order};
// A half-type layer's backward where the CPU multiplies its type natively: the input, grad_output and the weight
// read in the half type, the offsets and the mask widened to float32; the columns filled in the half type for the
// GEMMs on the half type's (brgemm.h), their gradient and every sum in float32.
constexpr SamplingPasses kBFloat16Passes{fill, coordinate_grads, input_grad, int64_t(8) << 20, true,
                                         half_backward_gemms<c10::BFloat16>, scratch, kMaxKeptScratchBytes,
                                         /*backward_column_dtype=*/at::kBFloat16, channels_last, channels_first,
                                         weight_in_column_order, tiled_backward<c10::BFloat16>};
constexpr SamplingPasses kFloat16Passes{fill, coordinate_grads, input_grad, int64_t(8) << 20, true,
                                        half_backward_gemms<c10::Half>, scratch, kMaxKeptScratchBytes,
                                        /*backward_column_dtype=*/at::kHalf, channels_last, channels_first,
                                        weight_in_column_order, tiled_backward<c10::Half>};

// Whether a half-type layer's GEMMs run on the half type's here.
bool native_half_layer(const at::Tensor& input) { return half_gemm_for(input.scalar_type()).uses_native_path(); }

// float16 and bfloat16 (e.g. under CPU autocast): where the CPU multiplies the half type natively, the GEMMs in
// it (the columns sampled in float32 and rounded once to it; the input, grad_output and the weight read as they
// are, the offsets and the mask widened); elsewhere everything in float32, the input, grad_output and the weight
// widened as they are turned (tiled_forward.h; forward_with's and backward_with's float32 GEMMs). Depthwise
// layers (no GEMM) run in float32 on every CPU, their input and grad_output widened as they are turned
// (depthwise.h). Every sum in float32, each result rounded once to the input's dtype.
bool is_half_type(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}
at::Tensor widened(const at::Tensor& t) { return float32_contiguous(t); }
std::optional<at::Tensor> widened(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(widened(*t)) : std::nullopt;
}
std::optional<at::Tensor> narrowed(const std::optional<at::Tensor>& t, at::ScalarType dtype) {
  return t.has_value() ? std::optional<at::Tensor>(t->to(dtype)) : std::nullopt;
}

}  // namespace

at::Tensor deform_conv2d_forward(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                                 at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                 c10::string_view border_gradient) {
  begin_cpu_call();
  const ConvParams p = make_conv_params(input, offset, weight, mask, bias, stride, padding, dilation, border_gradient);
  if (p.is_depthwise()) return depthwise_forward(p, input, offset, weight, mask, bias);
  if (is_half_type(input)) {
    if (native_half_layer(input)) {
      if (tiled_forward_applies(p, input)) return tiled_forward(p, input, offset, mask, weight, bias);
      return forward_with(kPasses, p, input, widened(offset), weight, widened(mask), bias, input.scalar_type());
    }
    // In float32: tiled, or on the driver, reading the input and the weight as they are.
    if (tiled_forward_applies(p, input)) return tiled_forward(p, input, offset, mask, weight, bias);
    return forward_with(kPasses, p, input, widened(offset), weight, widened(mask), widened(bias), at::kFloat);
  }
  if (tiled_forward_applies(p, input)) return tiled_forward(p, input, offset, mask, weight, bias);
  return forward_with(kPasses, p, input, offset, weight, mask, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>
deform_conv2d_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
    const std::optional<at::Tensor>& mask, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
    bool bias_defined, c10::string_view border_gradient) {
  begin_cpu_call();
  const ConvParams p = make_conv_params(input, offset, weight, mask, std::nullopt, stride, padding, dilation, border_gradient);
  check_grad_output(p, grad_output, input);
  if (p.is_depthwise()) return depthwise_backward(p, grad_output, input, offset, weight, mask, bias_defined);
  if (is_half_type(input)) {
    const at::ScalarType dtype = input.scalar_type();
    if (native_half_layer(input) && half_backward_gemms_fit(p)) {
      const SamplingPasses& passes = dtype == at::kBFloat16 ? kBFloat16Passes : kFloat16Passes;
      auto [gi, go, gw, gm, gb] =
          backward_with(passes, p, grad_output, input, widened(offset), weight, widened(mask), bias_defined);
      return {gi.to(dtype), go.to(dtype), gw.to(dtype), narrowed(gm, dtype), narrowed(gb, dtype)};
    }
    auto [gi, go, gw, gm, gb] = backward_with(kHalfInFloat32Passes, p, grad_output, input, widened(offset), weight,
                                              widened(mask), bias_defined);
    return {gi, go.to(dtype), gw.to(dtype), narrowed(gm, dtype), gb};
  }
  return backward_with(kPasses, p, grad_output, input, offset, weight, mask, bias_defined);
}

}  // namespace cpu
}  // namespace deform_conv
