// CPU forward and backward: sample into channels-innermost columns, then one batched GEMM per image over the
// weight groups (ATen's BLAS). The batch is processed in chunks so the column buffer stays bounded.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "../conv_params.h"
#include "sampling_passes.h"

namespace deform_conv {
namespace cpu {
namespace {

// The column buffer of one chunk stays under this size (at least one image) and holds at most
// kMaxImagesPerChunk images, which bounds memory whatever the batch.
constexpr int64_t kColumnBudgetBytes = int64_t(32) << 20;
constexpr int64_t kMaxImagesPerChunk = 32;

int64_t images_per_chunk(const ConvParams& p, int64_t element_size) {
  const int64_t per_image = std::max<int64_t>(1, p.out_pixels() * p.taps() * p.in_channels * element_size);
  return std::clamp<int64_t>(kColumnBudgetBytes / per_image, 1, kMaxImagesPerChunk);
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

// Contiguous tensors that the sampling passes read, kept alive for as long as the pointers are used.
struct SamplingTensors {
  at::Tensor input, offset, mask;  // mask is undefined without a mask

  SamplingTensors(const at::Tensor& input_, const at::Tensor& offset_, const std::optional<at::Tensor>& mask_)
      : input(input_.contiguous(at::MemoryFormat::ChannelsLast)),
        offset(offset_.contiguous()),
        mask(mask_.has_value() ? mask_->contiguous() : at::Tensor()) {}

  template <typename scalar_t>
  SamplingInputs<scalar_t> pointers() const {
    return {input.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
            mask.defined() ? mask.const_data_ptr<scalar_t>() : nullptr};
  }
};

at::Tensor deform_conv2d_cpu(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                             const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                             at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  const ConvParams p = make_conv_params(input, offset, weight, mask, bias, stride, padding, dilation);
  at::Tensor output = at::empty({p.batch, p.out_channels, p.out_h, p.out_w}, input.options());  // [B, C_out, H_out, W_out]
  if (output.numel() == 0) return output;

  const SamplingTensors tensors(input, offset, mask);
  const at::Tensor weights = weight_as_matrices(p, weight);  // [G, C_out/G, taps * C_in/G]
  const int64_t chunk = images_per_chunk(p, input.element_size());
  // [chunk, G, H_out*W_out, taps * C_in/G]
  at::Tensor columns = at::empty({chunk, p.groups, p.out_pixels(), p.taps() * p.in_channels_per_group()}, input.options());
  at::Tensor output_matrices = output.view({p.batch, p.groups, p.out_channels_per_group(), p.out_pixels()});

  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "deform_conv2d_cpu", [&] {
    const SamplingInputs<scalar_t> in = tensors.pointers<scalar_t>();
    for (int64_t first = 0; first < p.batch; first += chunk) {
      const int64_t images = std::min(chunk, p.batch - first);
      fill_columns<scalar_t>(p, in, first, images, columns.mutable_data_ptr<scalar_t>());
      for (int64_t n = 0; n < images; ++n) {
        at::Tensor out_n = output_matrices[first + n];  // [G, C_out/G, H_out*W_out]
        at::bmm_out(out_n, weights, columns[n].transpose(1, 2));
      }
    }
  });
  if (bias.has_value()) output.add_(bias->view({1, p.out_channels, 1, 1}));
  return output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>
deform_conv2d_backward_cpu(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
                           const at::Tensor& weight, const std::optional<at::Tensor>& mask, at::IntArrayRef stride,
                           at::IntArrayRef padding, at::IntArrayRef dilation, bool bias_defined) {
  const ConvParams p = make_conv_params(input, offset, weight, mask, std::nullopt, stride, padding, dilation);
  check_grad_output(p, grad_output);

  // Every element of grad_offset and grad_mask is written exactly once by coordinate_and_mask_grads.
  at::Tensor grad_input = at::zeros({p.batch, p.height, p.width, p.in_channels}, input.options());  // channels-last
  at::Tensor grad_offset = at::empty(offset.sizes(), offset.options());
  at::Tensor grad_mask = mask.has_value() ? at::empty(mask->sizes(), mask->options()) : at::Tensor();
  at::Tensor grad_weights = at::zeros({p.groups, p.out_channels_per_group(), p.taps() * p.in_channels_per_group()},
                                      weight.options());
  std::optional<at::Tensor> grad_bias;
  if (bias_defined) grad_bias = grad_output.sum({0, 2, 3});

  if (p.batch > 0 && p.out_channels > 0) {
    const SamplingTensors tensors(input, offset, mask);
    const at::Tensor weights = weight_as_matrices(p, weight);
    const at::Tensor grad_output_matrices =
        grad_output.contiguous().view({p.batch, p.groups, p.out_channels_per_group(), p.out_pixels()});
    const int64_t chunk = images_per_chunk(p, input.element_size());
    at::Tensor columns = at::empty({chunk, p.groups, p.out_pixels(), p.taps() * p.in_channels_per_group()}, input.options());

    AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "deform_conv2d_backward_cpu", [&] {
      const SamplingInputs<scalar_t> in = tensors.pointers<scalar_t>();
      for (int64_t first = 0; first < p.batch; first += chunk) {
        const int64_t images = std::min(chunk, p.batch - first);
        fill_columns<scalar_t>(p, in, first, images, columns.mutable_data_ptr<scalar_t>());
        for (int64_t n = 0; n < images; ++n) grad_weights.baddbmm_(grad_output_matrices[first + n], columns[n]);
        // The columns are not needed any more: reuse the buffer for their gradient.
        for (int64_t n = 0; n < images; ++n) {
          at::Tensor grad_columns_n = columns[n];
          at::bmm_out(grad_columns_n, grad_output_matrices[first + n].transpose(1, 2), weights);
        }
        const scalar_t* grad_columns = columns.const_data_ptr<scalar_t>();
        coordinate_and_mask_grads<scalar_t>(p, in, first, images, grad_columns, grad_offset.mutable_data_ptr<scalar_t>(),
                                            grad_mask.defined() ? grad_mask.mutable_data_ptr<scalar_t>() : nullptr);
        accumulate_input_grad<scalar_t>(p, in, first, images, grad_columns, grad_input.mutable_data_ptr<scalar_t>());
      }
    });
  } else {
    grad_offset.zero_();
    if (grad_mask.defined()) grad_mask.zero_();
  }

  std::optional<at::Tensor> grad_mask_result;
  if (grad_mask.defined()) grad_mask_result = grad_mask;
  return {grad_input.permute({0, 3, 1, 2}).contiguous(), grad_offset, matrices_as_weight(p, grad_weights),
          grad_mask_result, grad_bias};
}

}  // namespace
}  // namespace cpu
}  // namespace deform_conv

TORCH_LIBRARY_IMPL(deform_conv, CPU, m) {
  m.impl("deform_conv2d", &deform_conv::cpu::deform_conv2d_cpu);
  m.impl("deform_conv2d_backward", &deform_conv::cpu::deform_conv2d_backward_cpu);
}
