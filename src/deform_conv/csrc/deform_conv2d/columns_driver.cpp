#include "columns_driver.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/version.h>

#include <algorithm>
#include <vector>

namespace deform_conv {
namespace {

// At most this many images share one column buffer, whatever the budget allows.
constexpr int64_t kMaxImagesPerChunk = 32;

// `extra_per_image`: bytes of other per-chunk buffers that must fit in the budget beside the columns.
int64_t images_per_chunk(const ConvParams& p, int64_t element_size, int64_t budget_bytes, int64_t extra_per_image = 0) {
  const int64_t per_image =
      std::max<int64_t>(1, p.out_pixels() * p.taps() * p.in_channels * element_size + extra_per_image);
  return std::clamp<int64_t>(budget_bytes / per_image, 1, kMaxImagesPerChunk);
}

// weight [C_out, C_in/groups, kh, kw] -> [C_out, taps * C_in/groups, 1, 1] in `dtype`, taps outer and channels
// inner as in the columns: the weight of the 1x1 convolution over the columns
// (SamplingPasses::weight_in_column_order, else ATen's copy).
at::Tensor weight_as_1x1(const SamplingPasses& passes, const ConvParams& p, const at::Tensor& weight,
                         at::ScalarType dtype) {
  at::Tensor turned =
      passes.weight_in_column_order != nullptr ? passes.weight_in_column_order(weight, dtype) : at::Tensor();
  if (!turned.defined()) turned = weight.permute({0, 2, 3, 1}).contiguous().to(dtype);
  return turned.view({p.out_channels, p.taps() * p.in_channels_per_group(), 1, 1});
}

// The inverse of weight_as_1x1, for the weight's gradient.
at::Tensor weight_from_1x1(const ConvParams& p, const at::Tensor& weight_1x1) {
  return weight_1x1.reshape({p.out_channels, p.kernel_h, p.kernel_w, p.in_channels_per_group()})
      .permute({0, 3, 1, 2})
      .contiguous();
}

at::Tensor channels_last_buffer(const SamplingPasses& passes, ScratchSlot slot, at::IntArrayRef sizes,
                                const at::TensorOptions& options) {
  if (passes.scratch != nullptr) return passes.scratch(slot, sizes, options);
  return at::empty(sizes, options, at::MemoryFormat::ChannelsLast);
}

// The column buffer of `images` images, viewed as the channels-last input of the 1x1 convolution:
// [images, groups * taps * C_in/groups, out_h, out_w] with channels innermost in memory (in `slot`: the columns,
// or the backward's columns' gradient where they are apart).
at::Tensor column_buffer(const SamplingPasses& passes, const ConvParams& p, int64_t images,
                         const at::TensorOptions& options, ScratchSlot slot = ScratchSlot::columns) {
  return channels_last_buffer(passes, slot,
                              {images, p.groups * p.taps() * p.in_channels_per_group(), p.out_h, p.out_w}, options);
}

const std::vector<int64_t> kOnes{1, 1}, kZeros{0, 0};

// A range named `name` ("deform_conv2d::fill_columns", ...) in torch.profiler's trace around one pass of the op,
// opened on the calling thread: on the CPU the pass's wall time, its threads' work included (on the GPU, the time
// to launch it). The op's time split between its passes in any trace, and what benchmarks/sampling_passes_speed.py
// reads; without a profiler, one check that nothing listens. A tensor after the name is recorded as the range's
// input (its dtype, and with record_shapes its shape): the fill's ranges name the columns, so that a trace tells
// which path a half-type layer took (its columns in its own type, or widened to float32).
#define DC_PASS_RANGE(name, ...) RECORD_FUNCTION(name, std::vector<c10::IValue>{__VA_ARGS__})

// out [B, C, H, W] = channels_last [B, H, W, C] turned over (SamplingPasses::channels_first, else ATen's copy).
void copy_channels_first(const SamplingPasses& passes, const at::Tensor& channels_last, at::Tensor& out) {
  if (passes.channels_first == nullptr || !passes.channels_first(channels_last, out, nullptr)) {
    out.copy_(channels_last.permute({0, 3, 1, 2}));
  }
}

// sum += a x b, for matrices or batches of them, where `sum` may be float while a and b are half or bfloat16 (the
// weight's gradient sums over every image in float). On a GPU since torch 2.8 the product itself runs on the half
// types' tensor cores with a float result; otherwise the factors are widened first.
void add_product(at::Tensor sum, const at::Tensor& a, const at::Tensor& b) {
  const bool batched = a.dim() == 3;
  auto accumulate = [&](const at::Tensor& x, const at::Tensor& y) { batched ? sum.baddbmm_(x, y) : sum.addmm_(x, y); };
  if (sum.scalar_type() == a.scalar_type()) {
    accumulate(a, b);
    return;
  }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  if (sum.is_cuda()) {  // (the out_dtype products have only CUDA kernels; the CUDA simulation runs on the CPU)
    sum.add_(batched ? at::bmm(a, b, sum.scalar_type()) : at::mm(a, b, sum.scalar_type()));
    return;
  }
#endif
  accumulate(a.to(sum.scalar_type()), b.to(sum.scalar_type()));
}

// The CPU backward's GEMMs for images [first, first + images), image by image and group by group, with plain GEMMs
// into buffers that exist already (no temporaries of the columns' size, except that for the half types
// add_product makes a float product of a weight group's size, and before torch 2.8 widens the image's columns of
// the group too): first the weight's gradient, accumulated in place,
// [C_out/G, H_out*W_out] x [H_out*W_out, taps * C_in/G]; then, as the columns are no longer needed, their
// gradient overwrites them, [H_out*W_out, C_out/G] x [C_out/G, taps * C_in/G].
void backward_gemms_with_aten(const ConvParams& p, const at::Tensor& grad_output, int64_t first, int64_t images,
                              const at::Tensor& weight_matrix, at::Tensor& columns, at::Tensor& grad_weights) {
  const int64_t per_group = p.taps() * p.in_channels_per_group(), out_per_group = p.out_channels_per_group();
  for (int64_t n = 0; n < images; ++n) {
    const at::Tensor grad_out_n = grad_output[first + n].reshape({p.out_channels, p.out_pixels()});
    at::Tensor columns_n = columns[n].permute({1, 2, 0}).view({p.out_pixels(), p.groups * per_group});
    for (int64_t g = 0; g < p.groups; ++g) {
      const at::Tensor grad_out_g = grad_out_n.narrow(0, g * out_per_group, out_per_group);
      at::Tensor columns_g = columns_n.narrow(1, g * per_group, per_group);
      add_product(grad_weights.view({p.out_channels, -1}).narrow(0, g * out_per_group, out_per_group), grad_out_g,
                  columns_g);
      // Half types: cuBLAS multiplies on the tensor cores and accumulates in float, then rounds once.
      at::mm_out(columns_g, grad_out_g.t(), weight_matrix.narrow(0, g * out_per_group, out_per_group));
    }
  }
}


// The forward's GEMMs of one chunk as batched GEMMs (cuBLAS), straight into the output: for image n and weight
// group g, [C_out/G, taps * C_in/G] x [taps * C_in/G, H_out*W_out]. Batched over the chunk's images (the weight
// broadcast, not copied) with one call per group, or over the groups with one call per image, whichever makes
// fewer calls: groups == 1 is one GEMM a chunk. The bias is the GEMM's addend (beta = 1; ATen writes it into the
// output first).
void chunk_gemms_forward(const ConvParams& p, const at::Tensor& chunk_columns, const at::Tensor& weight_1x1,
                         const std::optional<at::Tensor>& bias, at::Tensor output) {
  const int64_t images = chunk_columns.size(0), per_group = p.taps() * p.in_channels_per_group();
  const int64_t out_per_group = p.out_channels_per_group(), pixels = p.out_pixels();
  const at::Tensor columns = chunk_columns.permute({0, 2, 3, 1}).view({images, pixels, p.groups, per_group});
  const at::Tensor weights = weight_1x1.view({p.groups, out_per_group, per_group});
  at::Tensor out = output.view({images, p.groups, out_per_group, pixels});
  const at::Tensor addend = bias.has_value() ? bias->view({p.groups, out_per_group, 1}) : at::Tensor();
  auto gemm = [&](at::Tensor result, const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias_part) {
    if (bias_part.defined()) {
      at::baddbmm_out(result, bias_part.expand(result.sizes()), a, b);
    } else {
      at::bmm_out(result, a, b);
    }
  };
  if (p.groups <= images) {
    for (int64_t g = 0; g < p.groups; ++g) {  // [images, C_out/G, pixels] = [C_out/G, K/G] x [images, K/G, pixels]
      gemm(out.select(1, g), weights[g].expand({images, out_per_group, per_group}),
           columns.select(2, g).transpose(1, 2), addend.defined() ? addend[g].unsqueeze(0) : at::Tensor());
    }
  } else {
    for (int64_t n = 0; n < images; ++n) {  // [G, C_out/G, pixels] = [G, C_out/G, K/G] x [G, K/G, pixels]
      gemm(out[n], weights, columns[n].permute({1, 2, 0}), addend);
    }
  }
}

// The forward's GEMM of one chunk as matrix products over its rows (images * H_out*W_out of them): for each weight
// group, [rows, taps * C_in/G] x the weight's group transposed (read so, as it lies), the bias added by the GEMM;
// then turned into the output's [C_out/G, H_out*W_out] per image and group.
void chunk_gemm_rows(const ConvParams& p, const at::Tensor& chunk_columns, const at::Tensor& weight_1x1,
                     const std::optional<at::Tensor>& bias, at::Tensor output) {
  const int64_t images = chunk_columns.size(0), per_group = p.taps() * p.in_channels_per_group();
  const int64_t out_per_group = p.out_channels_per_group(), pixels = p.out_pixels(), rows = images * pixels;
  const at::Tensor columns = chunk_columns.permute({0, 2, 3, 1}).view({rows, p.groups * per_group});
  const at::Tensor weights = weight_1x1.view({p.out_channels, per_group});
  at::Tensor out = output.view({images, p.groups, out_per_group, pixels});
  for (int64_t g = 0; g < p.groups; ++g) {
    const at::Tensor a = columns.narrow(1, g * per_group, per_group);
    const at::Tensor b = weights.narrow(0, g * out_per_group, out_per_group).t();
    const at::Tensor product = bias.has_value() ? at::addmm(bias->narrow(0, g * out_per_group, out_per_group), a, b)
                                                : at::mm(a, b);  // [rows, C_out/G]
    out.select(1, g).copy_(product.view({images, pixels, out_per_group}).transpose(1, 2));
  }
}

// The backward's GEMMs of one chunk as one batched GEMM over the weight groups each (cuBLAS): the chunk's images
// and output pixels together are one dimension of length M = images * H_out*W_out, since the columns
// [M, groups * taps * C_in/G] and grad_output read channels-last, `grad_rows` [M, C_out], are plain matrices.
// The weight's gradient [G, C_out/G, taps * C_in/G] += grad_rows_g^T x columns_g, then the columns' gradient
// overwrites them, columns_g = grad_rows_g x weight_g. groups == 1: two GEMMs a chunk.
void chunk_gemms_backward(const ConvParams& p, const at::Tensor& grad_rows, const at::Tensor& weight_matrix,
                          at::Tensor& chunk_columns, at::Tensor& grad_weights) {
  const int64_t images = chunk_columns.size(0), per_group = p.taps() * p.in_channels_per_group();
  const int64_t out_per_group = p.out_channels_per_group(), rows = images * p.out_pixels();
  at::Tensor columns = chunk_columns.permute({0, 2, 3, 1}).view({rows, p.groups, per_group}).permute({1, 0, 2});
  const at::Tensor grad = grad_rows.view({rows, p.groups, out_per_group}).permute({1, 0, 2});  // [G, M, C_out/G]
  add_product(grad_weights.view({p.groups, out_per_group, per_group}), grad.transpose(1, 2), columns);
  // Half types: cuBLAS multiplies on the tensor cores and accumulates in float, then rounds once.
  at::bmm_out(columns, grad, weight_matrix.view({p.groups, out_per_group, per_group}));
}

}  // namespace

// Whether the CPU forward's GEMM over a chunk of `rows` column rows runs faster as plain matrix products
// (chunk_gemm_rows) than as oneDNN's 1x1 convolution, which reorders the whole weight into its blocked layout on
// every call: that costs as much as the products where a weight row is longer than the chunk has rows. Measured on
// a Sapphire Rapids Xeon (2 threads), float32 forward: 512 channels at 14x14, 2 images (392 rows of 4608), 4.6 ms
// against 5.5 ms; 1024 channels at 7x7, 5.4 ms against 18.7 ms; but 256 channels at 28x28 (3136 rows of 2304)
// 1.06x slower and 64 at 56x56 1.28x slower. The half types (bfloat16 on AMX) gain from them only where a weight
// row is 16 times longer: 1.06x slower at 392 rows of 4608, 1.4x and 3.5x faster at 196 rows of 4608 and 98 of
// 9216. Decided once a call, for its largest chunk: a batch's last, shorter chunk takes the same GEMM as the others.
bool rows_gemm_pays(const ConvParams& p, int64_t rows, at::ScalarType dtype) {
  const int64_t row_length = p.taps() * p.in_channels_per_group();
  return (c10::isReducedFloatingType(dtype) ? 16 * rows : rows) < row_length;
}

SamplingTensors::SamplingTensors(const SamplingPasses& passes, const at::Tensor& input_, const at::Tensor& offset_,
                                 const std::optional<at::Tensor>& mask_, std::optional<at::ScalarType> input_dtype)
    : input(input_),
      offset(offset_.contiguous()),
      mask(mask_.has_value() ? mask_->contiguous() : at::Tensor()) {
  const at::ScalarType dtype = input_dtype.value_or(input_.scalar_type());
  if (dtype != input_.scalar_type() || !input.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    input = channels_last_buffer(passes, ScratchSlot::channels_last_input, input_.sizes(),
                                 input_.options().dtype(dtype));
    DC_PASS_RANGE("deform_conv2d::channels_last");
    if (passes.channels_last == nullptr || !passes.channels_last(input_, input)) input.copy_(input_);
  }
}

at::Tensor forward_with(const SamplingPasses& passes, const ConvParams& p, const at::Tensor& input,
                        const at::Tensor& offset, const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                        const std::optional<at::Tensor>& bias, std::optional<at::ScalarType> gemm_dtype) {
  TORCH_CHECK(!gemm_dtype.has_value() || passes.gemm_as_convolution, "deform_conv: gemm_dtype needs a convolution");
  const at::ScalarType gemm_type = gemm_dtype.value_or(input.scalar_type());
  TORCH_CHECK(gemm_type == input.scalar_type() ||
                  (gemm_type == at::kFloat && c10::isReducedFloatingType(input.scalar_type())),
              "deform_conv: gemm_dtype is the input's, or float32 for a half-type input");
  at::Tensor output = at::empty({p.batch, p.out_channels, p.out_h, p.out_w},  // [B, C_out, H_out, W_out]
                                input.options());
  if (output.numel() == 0) return output;

  const SamplingTensors tensors(passes, input, offset, mask, gemm_type);
  const at::Tensor weight_1x1 = weight_as_1x1(passes, p, weight, gemm_type);
  // The fill pass writes the columns in gemm_type (rounded once as they are sampled, for a half type).
  const at::TensorOptions column_options = input.options().dtype(gemm_type);
  const int64_t chunk = images_per_chunk(p, column_options.dtype().itemsize(), passes.column_budget_bytes);
  at::Tensor columns = column_buffer(passes, p, std::min(chunk, p.batch), column_options);
  const bool rows_gemm = passes.gemm_as_convolution &&
                         rows_gemm_pays(p, columns.size(0) * p.out_pixels(), column_options.dtype().toScalarType());
  for (int64_t first = 0; first < p.batch; first += chunk) {
    const int64_t images = std::min(chunk, p.batch - first);
    at::Tensor chunk_columns = columns.narrow(0, 0, images);
    {
      DC_PASS_RANGE("deform_conv2d::fill_columns", chunk_columns);
      passes.fill_columns(p, tensors, first, images, chunk_columns);
    }
    at::Tensor chunk_output = output.narrow(0, first, images);
    DC_PASS_RANGE("deform_conv2d::forward_gemm");  // (with the product turned channels-first where it is not)
    if (!passes.gemm_as_convolution) {
      chunk_gemms_forward(p, chunk_columns, weight_1x1, bias, chunk_output);
    } else if (rows_gemm) {
      chunk_gemm_rows(p, chunk_columns, weight_1x1, bias, chunk_output);
    } else {
      const at::Tensor product = at::conv2d(chunk_columns, weight_1x1, bias, kOnes, kZeros, kOnes, p.groups);
      if (product.is_contiguous(at::MemoryFormat::ChannelsLast)) {
        copy_channels_first(passes, product.permute({0, 2, 3, 1}), chunk_output);
      } else {
        chunk_output.copy_(product);
      }
    }
  }
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
  at::Tensor grad_weights =
      at::zeros({p.out_channels, p.taps() * p.in_channels_per_group(), 1, 1}, weight.options().dtype(acc_type));
  // The columns' dtype, and whether their gradient goes to a buffer apart (SamplingPasses::backward_column_dtype).
  const at::ScalarType column_dtype = passes.backward_column_dtype != at::ScalarType::Undefined
                                          ? passes.backward_column_dtype
                                          : input.scalar_type();
  const bool columns_apart =
      passes.backward_column_dtype != at::ScalarType::Undefined && c10::isReducedFloatingType(column_dtype);
  const bool half_in_float32 = passes.backward_column_dtype == at::kFloat && input.scalar_type() != at::kFloat;
  TORCH_CHECK(!half_in_float32 || c10::isReducedFloatingType(input.scalar_type()),
              "deform_conv: float32 backward columns are for half-type inputs");
  // A half-type grad_output for float32 GEMMs is widened a chunk at a time, or whole where the bias's gradient
  // sums it (ATen's sum in float32 widens it whole anyway).
  const at::Tensor wide_grad_output = half_in_float32 && bias_defined ? grad_output.to(acc_type) : at::Tensor();
  std::optional<at::Tensor> grad_bias;
  if (bias_defined) {
    grad_bias = (wide_grad_output.defined() ? wide_grad_output : grad_output)
                    .sum({0, 2, 3}, /*keepdim=*/false, acc_type)
                    .to(input.scalar_type());
  }
  if (p.batch > 0 && p.out_channels > 0) {
    const SamplingTensors tensors(passes, input, offset, mask, columns_apart ? input.scalar_type() : column_dtype);
    const at::Tensor weight_matrix = weight_as_1x1(passes, p, weight, half_in_float32 ? acc_type : weight.scalar_type())
                                         .view({p.out_channels, -1});
    // GPU GEMMs read grad_output channels-last: a copy of each chunk's part unless it is already (as the
    // gradient of a channels-last output is). The copy counts against the column budget, so the peak stays as it
    // was without it.
    const bool chunk_gemms = !passes.gemm_as_convolution;
    const bool copy_grad_rows = chunk_gemms && !grad_output.is_contiguous(at::MemoryFormat::ChannelsLast);
    const at::Tensor grad_output_rows = chunk_gemms ? grad_output.permute({0, 2, 3, 1}) : at::Tensor();
    const int64_t extra_per_image = copy_grad_rows ? p.out_pixels() * p.out_channels * input.element_size() : 0;
    // The columns, and where they are in a half type, their gradient apart in the accumulation type: the budget
    // bounds the larger buffer.
    const at::TensorOptions grad_column_options = input.options().dtype(columns_apart ? acc_type : column_dtype);
    const int64_t element_size = grad_column_options.dtype().itemsize();
    int64_t chunk = images_per_chunk(p, element_size, passes.column_budget_bytes, extra_per_image);
    if (passes.stretched_budget_bytes > 0) {
      const int64_t threads = at::get_num_threads();
      const int64_t stretched = images_per_chunk(p, element_size, passes.stretched_budget_bytes, extra_per_image);
      chunk = std::max(chunk, std::min({threads, stretched, p.batch}));
      // And a whole number of images per thread, where the chunk has more images than threads: the CPU's passes
      // then give each thread whole images (3 images a chunk on 2 threads had the input gradient's channels split
      // between them, each repeating the sampling of every point).
      if (chunk > threads) chunk -= chunk % threads;
    }
    TORCH_CHECK(!columns_apart || (!chunk_gemms && passes.backward_gemms != nullptr),
                "deform_conv: half-type backward columns need the backend's backward GEMMs");
    TORCH_CHECK(!half_in_float32 || !chunk_gemms, "deform_conv: float32 backward columns need GEMMs per image");
    const int64_t buffer_images = std::min(chunk, p.batch);
    const at::TensorOptions column_options = input.options().dtype(column_dtype);
    at::Tensor columns = column_buffer(passes, p, buffer_images, column_options);
    at::Tensor grad_columns;  // where they are apart: allocated for the first chunk that needs it
    for (int64_t first = 0; first < p.batch; first += chunk) {
      const int64_t images = std::min(chunk, p.batch - first);
      at::Tensor chunk_columns = columns.narrow(0, 0, images);
      {
        DC_PASS_RANGE("deform_conv2d::fill_columns", chunk_columns);
        passes.fill_columns(p, tensors, first, images, chunk_columns);
      }
      if (passes.tiled_backward != nullptr &&  // (which opens its own range, "deform_conv2d::tiled_backward")
          passes.tiled_backward(p, tensors, grad_output, first, images, weight_matrix, chunk_columns, grad_weights,
                                grad_offset, grad_mask, grad_input)) {
        continue;
      }
      if (columns_apart && !grad_columns.defined()) {
        grad_columns = column_buffer(passes, p, buffer_images, grad_column_options, ScratchSlot::grad_columns);
      }
      at::Tensor chunk_grad_columns = columns_apart ? grad_columns.narrow(0, 0, images) : chunk_columns;
      const at::Tensor chunk_grad_output = wide_grad_output.defined() ? wide_grad_output
                                           : half_in_float32 ? grad_output.narrow(0, first, images).to(acc_type)
                                                             : grad_output;
      const int64_t grad_first = half_in_float32 && !wide_grad_output.defined() ? 0 : first;
      {
        DC_PASS_RANGE("deform_conv2d::backward_gemms");
        if (chunk_gemms) {
          const at::Tensor grad_rows = grad_output_rows.narrow(0, first, images).contiguous()
                                           .view({images * p.out_pixels(), p.out_channels});
          chunk_gemms_backward(p, grad_rows, weight_matrix, chunk_columns, grad_weights);
        } else if (passes.backward_gemms == nullptr ||
                   !passes.backward_gemms(p, chunk_grad_output, grad_first, images, weight_matrix, chunk_columns,
                                          chunk_grad_columns, grad_weights)) {
          // Half-type columns refused (the half GEMM's settings, DEFORM_CONV_CPU_HALF_GEMM or oneDNN's flag, changed
          // since the call began, on another thread): ATen's GEMMs on them, widened, and on grad_output and the
          // weight widened too.
          if (columns_apart) {
            chunk_grad_columns.copy_(chunk_columns);
            backward_gemms_with_aten(p, grad_output.narrow(0, first, images).to(acc_type), 0, images,
                                     weight_matrix.to(acc_type), chunk_grad_columns, grad_weights);
          } else {
            backward_gemms_with_aten(p, chunk_grad_output, grad_first, images, weight_matrix, chunk_grad_columns,
                                     grad_weights);
          }
        }
      }
      {
        DC_PASS_RANGE("deform_conv2d::coordinate_grads");
        passes.coordinate_and_mask_grads(p, tensors, first, images, chunk_grad_columns, grad_offset, grad_mask);
      }
      DC_PASS_RANGE("deform_conv2d::input_grad");
      passes.accumulate_input_grad(p, tensors, first, images, chunk_grad_columns, grad_input);
    }
  } else {
    grad_offset.zero_();
    if (grad_mask.defined()) grad_mask.zero_();
  }

  std::optional<at::Tensor> grad_mask_result;
  if (grad_mask.defined()) grad_mask_result = grad_mask;
  at::Tensor grad_input_result = at::empty({p.batch, p.in_channels, p.height, p.width}, input.options());
  {
    DC_PASS_RANGE("deform_conv2d::channels_first");
    copy_channels_first(passes, grad_input, grad_input_result);
  }
  return {grad_input_result, grad_offset, weight_from_1x1(p, grad_weights.to(weight.scalar_type())), grad_mask_result,
          grad_bias};
}

}  // namespace deform_conv

#undef DC_PASS_RANGE
