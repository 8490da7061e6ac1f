// The device-independent part of the op: lay out the tensors, walk the batch in chunks, and run the GEMMs
// through ATen: on the CPU the forward's as a 1x1 convolution over the columns (oneDNN) and the backward's image by
// image unless the backend runs them itself (SamplingPasses::backward_gemms); on the GPU all of them as plain
// GEMMs over a whole chunk, one (batched) GEMM per weight group (cuBLAS). Each backend supplies its three passes
// over the sampling points (SamplingPasses); the column layout they share is ConvParams::column_index. (On the CPU
// most float32 forwards take a path of their own, cpu/tiled_forward.h.)
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "conv_params.h"

namespace deform_conv {

struct SamplingTensors;

// What the driver's scratch buffers are for (see SamplingPasses::scratch).
// `tile`: the CPU's tiled passes (cpu/tiled_forward.h, cpu/brgemm.h): a task's columns and product, a worker's
// channels-last image, a tile of grad_output. `half_factors`: the half types' GEMMs' rounded and packed factors
// (cpu/half_gemm.h). `grad_columns`: the columns' gradient where the columns are in a half type
// (SamplingPasses::backward_column_dtype). `turned_image`: a worker's channels-last image for passes that keep no
// tile beside it (cpu/thread_images.h).
enum class ScratchSlot {
  columns = 0,
  channels_last_input = 1,
  tile = 2,
  half_factors = 3,
  grad_columns = 4,
  turned_image = 5
};

struct SamplingPasses {
  // The columns (see ConvParams::column_index) of images [first, first + images).
  void (*fill_columns)(const ConvParams&, const SamplingTensors&, int64_t first, int64_t images, at::Tensor& columns);
  // grad_offset [B, 2*offset_groups*taps, H_out, W_out] and grad_mask (undefined without a mask) of those images.
  void (*coordinate_and_mask_grads)(const ConvParams&, const SamplingTensors&, int64_t first, int64_t images,
                                    const at::Tensor& grad_columns, at::Tensor& grad_offset, at::Tensor& grad_mask);
  // Adds those images' input gradient into grad_input, channels-last [B, H, W, C_in], in the accumulation type.
  void (*accumulate_input_grad)(const ConvParams&, const SamplingTensors&, int64_t first, int64_t images,
                                const at::Tensor& grad_columns, at::Tensor& grad_input);
  // The column buffer of one chunk stays under this size (at least one image).
  int64_t column_budget_bytes;
  // The forward's GEMM as a 1x1 convolution (oneDNN on the CPU: faster than BLAS there, but for layers whose
  // weight is large against the chunk, columns_driver.cpp's rows_gemm_pays), or every GEMM as a plain
  // one over the whole chunk (on CUDA: cuDNN would use TF32 for float32 by default, cuBLAS follows torch's matmul
  // setting, off).
  bool gemm_as_convolution;
  // The backward's GEMMs for images [first, first + images), where the backend has a faster way than the
  // driver's ATen mm per image and group: grad_weights [C_out, taps * C_in/G] += grad_output x columns, then
  // the columns' gradient into grad_columns (the columns themselves, overwritten, unless backward_column_dtype
  // says otherwise). Returns false to leave them to the driver; nullptr: always.
  bool (*backward_gemms)(const ConvParams&, const at::Tensor& grad_output, int64_t first, int64_t images,
                         const at::Tensor& weight_matrix, const at::Tensor& columns, at::Tensor& grad_columns,
                         at::Tensor& grad_weights);
  // A channels-last tensor of `sizes` for one of the driver's internal buffers, valid until this thread asks
  // for the same slot again; nullptr: a fresh at::empty each time.
  at::Tensor (*scratch)(ScratchSlot slot, at::IntArrayRef sizes, const at::TensorOptions& options);
  // A backward chunk holds at least as many images as threads (at::get_num_threads), where the batch has them
  // and their columns fit in these many bytes, and where it holds more, a multiple of the thread count; 0: the
  // budget alone decides. (The CPU's input gradient gives each
  // thread images of its own; with fewer images than threads it splits their channels instead, and each thread
  // repeats the sampling of every point: S1 of the benchmark scaled 1.33x from one thread to two that way, 1.74x
  // with two images.)
  int64_t stretched_budget_bytes;
  // Undefined: the backward's columns are in the input's dtype, and their gradient overwrites them. A half type
  // (the input's): fill_columns writes the backward's columns in it (each rounded once, for backward_gemms), and
  // their gradient goes to a float32 buffer, which the other two passes read, their own sums in float32. float32,
  // for a half-type input: the backward runs in float32 as a float32 layer's does, on the input widened as it is
  // turned channels-last for the passes and grad_output widened a chunk at a time for the GEMMs.
  at::ScalarType backward_column_dtype = at::ScalarType::Undefined;
  // out (channels-last in memory) = the input [B, C, H, W] (contiguous), turned over for the passes: returns false,
  // doing nothing, to leave it to ATen's copy; nullptr: always ATen's.
  bool (*channels_last)(const at::Tensor& channels_first, at::Tensor& out) = nullptr;
  // out [B, C, H, W] (contiguous) = channels_last [B, H, W, C] (contiguous) turned over, rounded once where out is
  // in a half type and channels_last in float32: the input's gradient, accumulated channels-last, and the forward's
  // convolution over the columns, whose output is channels-last. Returns false, doing nothing, to leave it to
  // ATen's copy; nullptr: always ATen's.
  bool (*channels_first)(const at::Tensor& channels_last, at::Tensor& out, const float* add_per_channel) = nullptr;
  // The weight [C_out, C_in/G, kh, kw] turned to the columns' order, [C_out, kh, kw, C_in/G] (contiguous), in
  // `dtype` (its own, or float32 from a half type), or an undefined tensor to leave it to ATen's copy of the
  // permuted weight; nullptr: always ATen's.
  at::Tensor (*weight_in_column_order)(const at::Tensor& weight, at::ScalarType dtype) = nullptr;
  // The rest of the backward of images [first, first + images) once their columns are filled, in one pass of the
  // backend's own: grad_weights += the images' weight gradient, and their grad_offset, grad_mask (undefined without
  // a mask) and grad_input from the columns' gradient, kept in cache a tile at a time (cpu/tiled_backward.h).
  // Returns false, doing nothing, to leave them to backward_gemms and the two passes; nullptr: always.
  bool (*tiled_backward)(const ConvParams&, const SamplingTensors&, const at::Tensor& grad_output, int64_t first,
                         int64_t images, const at::Tensor& weight_matrix, const at::Tensor& columns,
                         at::Tensor& grad_weights, at::Tensor& grad_offset, at::Tensor& grad_mask,
                         at::Tensor& grad_input) = nullptr;
};

// The tensors the passes read, in the layout they expect: input channels-last [B, H, W, C_in] in memory, in
// `input_dtype` (its own unless given: a copy unless it is already, in SamplingPasses::scratch memory where the
// backend has it), offset and mask contiguous (mask undefined without a mask).
struct SamplingTensors {
  at::Tensor input, offset, mask;
  SamplingTensors(const SamplingPasses& passes, const at::Tensor& input, const at::Tensor& offset,
                  const std::optional<at::Tensor>& mask, std::optional<at::ScalarType> input_dtype = std::nullopt);
};

// Whether the CPU forward's GEMM over `rows` column rows (a chunk's images * H_out*W_out) runs faster as plain
// matrix products than as oneDNN's 1x1 convolution: where the weight is large against the rows (the half types'
// tiled forward leaves such layers to the driver too).
bool rows_gemm_pays(const ConvParams& p, int64_t rows, at::ScalarType dtype);

// `p` comes from make_conv_params on the same tensors (which validates them). `gemm_dtype` (on the CPU; the
// passes' GEMM a convolution): a half type, the input's: the columns, sampled in float32 (from an input in float32
// or in that type, widened as it is loaded), are rounded once to it as the fill pass writes them (the backend's
// fill_columns writes the column buffer's dtype), and the convolution over them (oneDNN's, on its half-precision
// kernels) multiplies them by the weight and adds the bias, both already in it, into an output in it. float32 for
// a half-type input: everything in float32 as for a float32 layer, the input widened as it is turned channels-last,
// the weight as it is turned to the columns' order, the bias given in float32, the output rounded once.
at::Tensor forward_with(const SamplingPasses& passes, const ConvParams& p, const at::Tensor& input,
                        const at::Tensor& offset, const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                        const std::optional<at::Tensor>& bias,
                        std::optional<at::ScalarType> gemm_dtype = std::nullopt);

// `p` comes from make_conv_params, and check_grad_output has accepted grad_output.
std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> backward_with(
    const SamplingPasses& passes, const ConvParams& p, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& offset, const at::Tensor& weight, const std::optional<at::Tensor>& mask, bool bias_defined);

}  // namespace deform_conv
