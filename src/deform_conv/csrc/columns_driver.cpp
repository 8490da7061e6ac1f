#include "columns_driver.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <algorithm>

namespace deform_conv {
namespace {

// At most this many images share one column buffer, whatever the budget allows.
constexpr int64_t kMaxImagesPerChunk = 32;

int64_t images_per_chunk(const ConvParams& p, int64_t element_size, int64_t budget_bytes) {
  const int64_t per_image = std::max<int64_t>(1, p.out_pixels() * p.taps() * p.in_channels * element_size);
  return std::clamp<int64_t>(budget_bytes / per_image, 1, kMaxImagesPerChunk);
}

// weight [C_out, C_in/groups, kh, kw] -> [groups, C_out/groups, taps * C_in/groups], taps outer and channels
// inner, as in the columns.
at::Tensor weight_as_matrices(const ConvParams& p, const at::Tensor& weight) {
  return weight.reshape({p.groups, p.out_channels_per_group(), p.in_channels_per_group(), p.taps()})
      .permute({0, 1, 3, 2})
      .contiguous()
      .view({p.groups, p.out_channels_per_group(), p.taps() * p.in_channels_per_group()});
}

// The inverse of weight_as_matrices, for the weight's gradient.
at::Tensor matrices_as_weight(const ConvParams& p, const at::Tensor& matrices) {
  return matrices.view({p.groups, p.out_channels_per_group(), p.taps(), p.in_channels_per_group()})
      .permute({0, 1, 3, 2})
      .reshape({p.out_channels, p.in_channels_per_group(), p.kernel_h, p.kernel_w})
      .contiguous();
}

at::Tensor column_buffer(const ConvParams& p, int64_t images, const at::TensorOptions& options) {
  return at::empty({images, p.groups, p.out_pixels(), p.taps() * p.in_channels_per_group()}, options);
}

}  // namespace

SamplingTensors::SamplingTensors(const at::Tensor& input_, const at::Tensor& offset_,
                                 const std::optional<at::Tensor>& mask_)
    : input(input_.contiguous(at::MemoryFormat::ChannelsLast)),
      offset(offset_.contiguous()),
      mask(mask_.has_value() ? mask_->contiguous() : at::Tensor()) {}

at::Tensor forward_with(const SamplingPasses& passes, const ConvParams& p, const at::Tensor& input,
                        const at::Tensor& offset, const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                        const std::optional<at::Tensor>& bias) {
  at::Tensor output = at::empty({p.batch, p.out_channels, p.out_h, p.out_w}, input.options());  // [B, C_out, H_out, W_out]
  if (output.numel() == 0) return output;

  const SamplingTensors tensors(input, offset, mask);
  const at::Tensor weights = weight_as_matrices(p, weight);  // [G, C_out/G, taps * C_in/G]
  const int64_t chunk = images_per_chunk(p, input.element_size(), passes.column_budget_bytes);
  at::Tensor columns = column_buffer(p, std::min(chunk, p.batch), input.options());
  at::Tensor output_matrices = output.view({p.batch, p.groups, p.out_channels_per_group(), p.out_pixels()});
  for (int64_t first = 0; first < p.batch; first += chunk) {
    const int64_t images = std::min(chunk, p.batch - first);
    passes.fill_columns(p, tensors, first, images, columns);
    for (int64_t n = 0; n < images; ++n) {
      at::Tensor out_n = output_matrices[first + n];  // [G, C_out/G, H_out*W_out]
      at::bmm_out(out_n, weights, columns[n].transpose(1, 2));
    }
  }
  if (bias.has_value()) output.add_(bias->view({1, p.out_channels, 1, 1}));
  return output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> backward_with(
    const SamplingPasses& passes, const ConvParams& p, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& offset, const at::Tensor& weight, const std::optional<at::Tensor>& mask, bool bias_defined) {
  // Sums over many terms (the input's scatter, the weight's sum over images) run in the accumulation type:
  // float for half and bfloat16.
  const at::ScalarType acc_type = at::toOpMathType(input.scalar_type());
  at::Tensor grad_input = at::zeros({p.batch, p.height, p.width, p.in_channels}, input.options().dtype(acc_type));
  // Every element of grad_offset and grad_mask is written exactly once by coordinate_and_mask_grads.
  at::Tensor grad_offset = at::empty(offset.sizes(), offset.options());
  at::Tensor grad_mask = mask.has_value() ? at::empty(mask->sizes(), mask->options()) : at::Tensor();
  at::Tensor grad_weights = at::zeros({p.groups, p.out_channels_per_group(), p.taps() * p.in_channels_per_group()},
                                      weight.options().dtype(acc_type));
  std::optional<at::Tensor> grad_bias;
  if (bias_defined) grad_bias = grad_output.sum({0, 2, 3}, /*keepdim=*/false, acc_type).to(input.scalar_type());

  if (p.batch > 0 && p.out_channels > 0) {
    const SamplingTensors tensors(input, offset, mask);
    const at::Tensor weights = weight_as_matrices(p, weight);
    const at::Tensor grad_output_matrices =
        grad_output.contiguous().view({p.batch, p.groups, p.out_channels_per_group(), p.out_pixels()});
    const int64_t chunk = images_per_chunk(p, input.element_size(), passes.column_budget_bytes);
    at::Tensor columns = column_buffer(p, std::min(chunk, p.batch), input.options());
    const bool same_type = acc_type == input.scalar_type();
    for (int64_t first = 0; first < p.batch; first += chunk) {
      const int64_t images = std::min(chunk, p.batch - first);
      passes.fill_columns(p, tensors, first, images, columns);
      for (int64_t n = 0; n < images; ++n) {
        const at::Tensor grad_out_n = grad_output_matrices[first + n];  // [G, C_out/G, H_out*W_out]
        if (same_type) {
          grad_weights.baddbmm_(grad_out_n, columns[n]);
        } else {
          grad_weights.add_(at::bmm(grad_out_n, columns[n]));
        }
      }
      // The columns are not needed any more: the buffer now receives their gradient.
      for (int64_t n = 0; n < images; ++n) {
        at::Tensor grad_columns_n = columns[n];
        at::bmm_out(grad_columns_n, grad_output_matrices[first + n].transpose(1, 2), weights);
      }
      passes.coordinate_and_mask_grads(p, tensors, first, images, columns, grad_offset, grad_mask);
      passes.accumulate_input_grad(p, tensors, first, images, columns, grad_input);
    }
  } else {
    grad_offset.zero_();
    if (grad_mask.defined()) grad_mask.zero_();
  }

  std::optional<at::Tensor> grad_mask_result;
  if (grad_mask.defined()) grad_mask_result = grad_mask;
  return {grad_input.permute({0, 3, 1, 2}).to(input.scalar_type(), /*non_blocking=*/false, /*copy=*/false,
                                               at::MemoryFormat::Contiguous),
          grad_offset, matrices_as_weight(p, grad_weights.to(weight.scalar_type())), grad_mask_result, grad_bias};
}

}  // namespace deform_conv
