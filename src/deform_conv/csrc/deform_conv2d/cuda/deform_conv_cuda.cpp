// CUDA backend, host side: the three sampling passes (kernels in sampling_kernels.cuh) behind the shared
// chunk-and-GEMM driver (the GEMMs go to cuBLAS through ATen, on tensor cores for half types), and a depthwise path
// without columns (depthwise_kernels.cuh). This file chooses every launch -- dtype, index width, vector width, lanes,
// blocks -- and reaches the kernels through their launchers (launchers.h, defined in deform_conv_cuda.cu), so that
// it is compiled by the host compiler and nvcc never parses ATen. The sampling math is sampling.h, shared with the
// CPU; the same file runs in the CUDA simulation (cuda/host.h).
//
// Work is split by sampling point (image, output pixel, offset group, tap): a group of `lanes` adjacent threads
// (a power of two up to a warp) takes one point, computes its coordinates, bilinear weights and neighbours once,
// and strides over the point's channels with vector loads and stores of up to 16 bytes. `lanes` is the smallest
// power of two that covers the offset group's channel vectors, so no warp idles when an offset group has few
// channels (one thread a point when each offset group has one channel). The column layout, channels innermost
// (ConvParams::column_index), makes those loads and stores contiguous.
//
// Every host entry point: validate (devices included) -> device guard -> allocate -> launch on the current
// stream -> launch check (cuda/host.h's launch_and_check).
#include "../entry_points.h"

#include <ATen/Context.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "../../cuda/host.h"
#include "../columns_driver.h"
#include "launchers.h"

namespace deform_conv {
namespace cuda {
namespace {

// 256 MiB of columns per chunk: large enough that the GEMMs fill the GPU. The deterministic input gradient's
// keys and the depthwise path's channels-last rows (of the output, or of grad_output) keep to the same budget.
constexpr int64_t kBudgetBytes = int64_t(256) << 20;


// The kernels' index arithmetic (loop counters, the divisions that split a flat index, every element index) runs
// in 32 bits when every flat index of every tensor they touch stays below 2^30 (int32_index_limit): the columns
// of one chunk, the input and its gradient, the offset, the deterministic path's entries (4 per point); the
// grid-stride loops step by at most 2^28 (2^20 blocks of 256 threads), so index + step cannot overflow either.
// Coordinates too: every padded size, stride and dilation below 2^30 keeps oy * stride - pad + i * dilation
// within int32.
bool fits_int32(const ConvParams& p, int64_t images) {
  const int64_t limit = int32_index_limit();
  const int64_t columns = images * p.out_pixels() * p.taps() * p.in_channels;
  const int64_t input = p.batch * p.height * p.width * p.in_channels;
  const int64_t offset = p.batch * 2 * p.offset_groups * p.taps() * p.out_pixels();
  const int64_t entries = 4 * images * p.out_pixels() * p.offset_groups * p.taps();
  const int64_t coordinates = std::max({p.height + 2 * p.pad_h, p.width + 2 * p.pad_w, p.stride_h, p.stride_w,
                                        p.dilation_h * p.kernel_h, p.dilation_w * p.kernel_w});
  return columns < limit && input < limit && offset < limit && entries < limit && coordinates < limit;
}

template <typename F>
void with_index_type(const ConvParams& p, int64_t images, F&& f) {
  with_index_width(fits_int32(p, images), f);
}

template <typename scalar_t>
const scalar_t* pointer_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<scalar_t>() : nullptr;
}

// `columns`: vectors also must not straddle two weight groups of the columns.
template <typename scalar_t>
bool wide_vectors_fit(const ConvParams& p, bool columns, std::initializer_list<const void*> pointers) {
  constexpr int v = kWideVector<scalar_t>;
  bool fit = p.channels_per_offset_group() % v == 0 && (!columns || p.in_channels_per_group() % v == 0);
  for (const void* pointer : pointers) fit = fit && reinterpret_cast<uintptr_t>(pointer) % (v * sizeof(scalar_t)) == 0;
  return fit;
}


// Calls f(index_t(0), std::integral_constant<int, V>()) with the index type and vector width chosen for this call.
template <typename scalar_t, typename F>
void with_index_and_vector(const ConvParams& p, int64_t images, bool wide, F&& f) {
  with_index_type(p, images, [&](auto index) {
    if (wide) {
      f(index, std::integral_constant<int, kWideVector<scalar_t>>());
    } else {
      f(index, std::integral_constant<int, 1>());
    }
  });
}

int64_t points_of(const ConvParams& p, int64_t images) {
  return images * p.out_pixels() * p.offset_groups * p.taps();
}

// ------------------------------------------------------------------------------------------ the sampling passes

void fill(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images, at::Tensor& columns) {
  DC_DISPATCH(t.input.scalar_type(), "deform_conv2d_cuda", [&] {
    const bool wide = wide_vectors_fit<scalar_t>(p, true, {t.input.const_data_ptr(), columns.const_data_ptr()});
    with_index_and_vector<scalar_t>(p, images, wide, [&](auto index, auto vector) {
      using Launchers = VectorLaunchers<scalar_t, decltype(index), decltype(vector)::value>;
      const Split split = split_for(p.channels_per_offset_group() / decltype(vector)::value);
      const int64_t points = points_of(p, images);
      launch_and_check(&Launchers::fill_columns, blocks_for(points << split.lanes_log2), p, split,
                       t.input.const_data_ptr<scalar_t>(), t.offset.const_data_ptr<scalar_t>(),
                       pointer_or_null<scalar_t>(t.mask), first, points, columns.mutable_data_ptr<scalar_t>());
    });
  });
}

// Where a backward pass reads the columns' gradient from: the GEMM's buffer, or (depthwise) weight * grad_output.
struct GradSource {
  at::Tensor grad_columns;      // GEMM path
  at::Tensor weight_tc, grad_rows;  // depthwise path: [taps, C] and [B, H_out*W_out, C]

  template <typename scalar_t>
  GradColumnsSource<scalar_t> pointers() const {
    if (grad_columns.defined()) return {grad_columns.const_data_ptr<scalar_t>(), nullptr, nullptr};
    return {nullptr, weight_tc.const_data_ptr<scalar_t>(), grad_rows.const_data_ptr<scalar_t>()};
  }
  bool columns() const { return grad_columns.defined(); }
};

template <typename scalar_t>
bool wide_for(const ConvParams& p, const GradSource& source, const void* other) {
  if (source.columns()) return wide_vectors_fit<scalar_t>(p, true, {other, source.grad_columns.const_data_ptr()});
  return wide_vectors_fit<scalar_t>(p, false, {other, source.weight_tc.const_data_ptr(), source.grad_rows.const_data_ptr()});
}

void coordinate_grads_from(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                           const GradSource& source, at::Tensor& grad_offset, at::Tensor& grad_mask) {
  DC_DISPATCH(t.input.scalar_type(), "deform_conv2d_backward_cuda", [&] {
    const bool wide = wide_for<scalar_t>(p, source, t.input.const_data_ptr());
    with_index_and_vector<scalar_t>(p, images, wide, [&](auto index, auto vector) {
      using Launchers = VectorLaunchers<scalar_t, decltype(index), decltype(vector)::value>;
      const Split split = split_for(p.channels_per_offset_group() / decltype(vector)::value);
      const int64_t points = points_of(p, images), per_warp = kWarp >> split.lanes_log2;
      launch_and_check(&Launchers::coordinate_grads, blocks_for((points + per_warp - 1) / per_warp * kWarp), p, split,
                       t.input.const_data_ptr<scalar_t>(), t.offset.const_data_ptr<scalar_t>(),
                       pointer_or_null<scalar_t>(t.mask), source.pointers<scalar_t>(), first, points,
                       grad_offset.mutable_data_ptr<scalar_t>(),
                       grad_mask.defined() ? grad_mask.mutable_data_ptr<scalar_t>() : nullptr);
    });
  });
}

// Deterministic: in runs of images whose keys fit the budget: 4 entries a point, each a key, its sorted copy, the
// sort's permutation and what the sort itself keeps (about as much again), 8 bytes each; 16 bytes a key for the
// key starts and the searched keys.
void input_grad_gathered(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                         const GradSource& source, at::Tensor& grad_input) {
  const int64_t per_image = std::max<int64_t>(
      1, 4 * points_of(p, 1) * 6 * int64_t(sizeof(int64_t)) + p.offset_groups * p.height * p.width * 16);
  const int64_t run = std::clamp<int64_t>(budget_bytes(kBudgetBytes) / per_image, 1, images);
  for (int64_t start = first; start < first + images; start += run) {
    const int64_t count = std::min(run, first + images - start);
    const int64_t points = points_of(p, count), keys = count * p.offset_groups * p.height * p.width;
    at::Tensor entry_keys = at::empty({4 * points}, t.offset.options().dtype(at::kLong));
    DC_DISPATCH(t.input.scalar_type(), "deform_conv2d_backward_cuda", [&] {
      with_index_type(p, count, [&](auto index) {
        launch_and_check(&GatherLaunchers<scalar_t, decltype(index)>::entry_keys, blocks_for(points), p,
                         t.offset.const_data_ptr<scalar_t>(), pointer_or_null<scalar_t>(t.mask), start, points, keys,
                         entry_keys.mutable_data_ptr<int64_t>());
      });
    });
    // Stable: entries of one key keep their order, so the sums below add in a fixed order.
    const auto sorted = at::sort(entry_keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const at::Tensor& sorted_keys = std::get<0>(sorted);
    const at::Tensor& sorted_entries = std::get<1>(sorted);
    const at::Tensor key_starts = at::searchsorted(sorted_keys, at::arange(keys + 1, sorted_keys.options()));
    // This run's columns (or grad_output rows) start `start - first` images into the chunk's buffer.
    GradSource run_source = source;
    if (source.columns()) {
      run_source.grad_columns = source.grad_columns.narrow(0, start - first, count);
    } else {
      run_source.grad_rows = source.grad_rows.narrow(0, start - first, count);
    }
    DC_DISPATCH(t.input.scalar_type(), "deform_conv2d_backward_cuda", [&] {
      with_index_type(p, count, [&](auto index) {
        const Split split = split_for(p.channels_per_offset_group());
        launch_and_check(&GatherLaunchers<scalar_t, decltype(index)>::input_grad_gather,
                         blocks_for(keys << split.lanes_log2), p, split, t.offset.const_data_ptr<scalar_t>(),
                         pointer_or_null<scalar_t>(t.mask), run_source.pointers<scalar_t>(),
                         sorted_entries.const_data_ptr<int64_t>(), key_starts.const_data_ptr<int64_t>(), start, keys,
                         grad_input.mutable_data_ptr<opmath_type<scalar_t>>());
      });
    });
  }
}

void input_grad_from(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                     const GradSource& source, at::Tensor& grad_input) {
  if (at::globalContext().deterministicAlgorithms()) {
    input_grad_gathered(p, t, first, images, source, grad_input);
    return;
  }
  DC_DISPATCH(t.input.scalar_type(), "deform_conv2d_backward_cuda", [&] {
    const bool wide = wide_for<scalar_t>(p, source, grad_input.const_data_ptr());
    with_index_and_vector<scalar_t>(p, images, wide, [&](auto index, auto vector) {
      using Launchers = VectorLaunchers<scalar_t, decltype(index), decltype(vector)::value>;
      const Split split = split_for(p.channels_per_offset_group() / decltype(vector)::value);
      const int64_t points = points_of(p, images);
      launch_and_check(&Launchers::input_grad_atomic, blocks_for(points << split.lanes_log2), p, split,
                       t.offset.const_data_ptr<scalar_t>(), pointer_or_null<scalar_t>(t.mask),
                       source.pointers<scalar_t>(), first, points,
                       grad_input.mutable_data_ptr<opmath_type<scalar_t>>());
    });
  });
}

void coordinate_grads(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                      const at::Tensor& grad_columns, at::Tensor& grad_offset, at::Tensor& grad_mask) {
  coordinate_grads_from(p, t, first, images, GradSource{grad_columns, {}, {}}, grad_offset, grad_mask);
}

void input_grad(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                const at::Tensor& grad_columns, at::Tensor& grad_input) {
  input_grad_from(p, t, first, images, GradSource{grad_columns, {}, {}}, grad_input);
}

SamplingPasses passes() {
  return {fill, coordinate_grads, input_grad, budget_bytes(kBudgetBytes), /*gemm_as_convolution=*/false,
          /*backward_gemms=*/nullptr, /*scratch=*/nullptr,  // the caching allocator reuses device memory already
          /*stretched_budget_bytes=*/0};
}

// ------------------------------------------------------------------------------------------ the depthwise path

// weight [C, 1, kh, kw] -> [taps, C]: one tap's weights for all channels contiguous.
at::Tensor weight_by_tap(const ConvParams& p, const at::Tensor& weight) {
  return weight.reshape({p.in_channels, p.taps()}).t().contiguous();
}

// Images per chunk of the depthwise path: its channels-last rows (of the output, or of grad_output) stay within
// the budget.
int64_t depthwise_chunk(const ConvParams& p, int64_t element_size) {
  const int64_t per_image = std::max<int64_t>(1, p.out_pixels() * p.in_channels * element_size);
  return std::clamp<int64_t>(budget_bytes(kBudgetBytes) / per_image, 1, std::max<int64_t>(1, p.batch));
}

at::Tensor depthwise_forward(const ConvParams& p, const at::Tensor& input, const at::Tensor& offset,
                             const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                             const std::optional<at::Tensor>& bias) {
  at::Tensor output = at::empty({p.batch, p.out_channels, p.out_h, p.out_w}, input.options());
  if (output.numel() == 0) return output;
  const SamplingTensors t(passes(), input, offset, mask);
  const at::Tensor weight_tc = weight_by_tap(p, weight);
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t chunk = depthwise_chunk(p, input.element_size());
  at::Tensor rows = at::empty({chunk, p.out_h, p.out_w, p.in_channels}, input.options());
  for (int64_t first = 0; first < p.batch; first += chunk) {
    const int64_t images = std::min(chunk, p.batch - first);
    at::Tensor out_rows = rows.narrow(0, 0, images);
    DC_DISPATCH(input.scalar_type(), "deform_conv2d_cuda", [&] {
      const bool wide = wide_vectors_fit<scalar_t>(
          p, false, {t.input.const_data_ptr(), out_rows.const_data_ptr(), weight_tc.const_data_ptr()});
      with_index_and_vector<scalar_t>(p, p.batch, wide, [&](auto index, auto vector) {
        using Launchers = VectorLaunchers<scalar_t, decltype(index), decltype(vector)::value>;
        const Split split = split_for(p.channels_per_offset_group() / decltype(vector)::value);
        const int64_t items = images * p.out_pixels() * p.offset_groups;
        launch_and_check(&Launchers::depthwise_forward, blocks_for(items << split.lanes_log2), p, split,
                         t.input.const_data_ptr<scalar_t>(), t.offset.const_data_ptr<scalar_t>(),
                         pointer_or_null<scalar_t>(t.mask), weight_tc.const_data_ptr<scalar_t>(),
                         pointer_or_null<scalar_t>(bias_c), first, items, out_rows.mutable_data_ptr<scalar_t>());
      });
    });
    output.narrow(0, first, images).copy_(out_rows.permute({0, 3, 1, 2}));  // [images, C, H_out, W_out]
  }
  return output;
}

// The weight's gradient sums over every (image, output pixel) row: each chunk's rows in at most this many blocks
// of consecutive rows, each summed by one lane in row order; then the blocks in order, then the chunks in order.
constexpr int64_t kMaxWeightBlocks = 256;

// partials [taps, C] of the chunk of `images` images starting at `first`, summed over its row blocks in order.
at::Tensor depthwise_weight_grad(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                                 const at::Tensor& grad_rows) {
  const int64_t rows = images * p.out_pixels();
  const int64_t rows_per_block = std::max<int64_t>(1, (rows + kMaxWeightBlocks - 1) / kMaxWeightBlocks);
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  const at::ScalarType acc_type = at::toOpMathType(t.input.scalar_type());
  at::Tensor partials = at::empty({blocks, p.taps(), p.in_channels}, t.input.options().dtype(acc_type));
  DC_DISPATCH(t.input.scalar_type(), "deform_conv2d_backward_cuda", [&] {
    const bool wide = wide_vectors_fit<scalar_t>(p, false, {t.input.const_data_ptr(), grad_rows.const_data_ptr()});
    with_index_and_vector<scalar_t>(p, p.batch, wide, [&](auto index, auto vector) {
      using Launchers = VectorLaunchers<scalar_t, decltype(index), decltype(vector)::value>;
      const Split split = split_for(p.channels_per_offset_group() / decltype(vector)::value);
      const int64_t items = blocks * p.offset_groups * p.taps();
      launch_and_check(&Launchers::depthwise_weight_partials, blocks_for(items << split.lanes_log2), p, split,
                       t.input.const_data_ptr<scalar_t>(), t.offset.const_data_ptr<scalar_t>(),
                       pointer_or_null<scalar_t>(t.mask), grad_rows.const_data_ptr<scalar_t>(), first, rows,
                       rows_per_block, items, partials.mutable_data_ptr<opmath_type<scalar_t>>());
    });
  });
  return partials.sum(0);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> depthwise_backward(
    const ConvParams& p, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
    const at::Tensor& weight, const std::optional<at::Tensor>& mask, bool bias_defined) {
  const at::ScalarType acc_type = at::toOpMathType(input.scalar_type());
  at::Tensor grad_input = at::zeros({p.batch, p.height, p.width, p.in_channels}, input.options().dtype(acc_type));
  // Every element of grad_offset and grad_mask is written exactly once by the coordinate pass.
  at::Tensor grad_offset = at::empty(offset.sizes(), offset.options());
  at::Tensor grad_mask = mask.has_value() ? at::empty(mask->sizes(), mask->options()) : at::Tensor();
  at::Tensor grad_weight_tc = at::zeros({p.taps(), p.in_channels}, weight.options().dtype(acc_type));
  std::optional<at::Tensor> grad_bias;
  if (bias_defined) grad_bias = grad_output.sum({0, 2, 3}, /*keepdim=*/false, acc_type).to(input.scalar_type());
  if (p.batch > 0) {
    const SamplingTensors t(passes(), input, offset, mask);
    const at::Tensor weight_tc = weight_by_tap(p, weight);
    const int64_t chunk = depthwise_chunk(p, input.element_size());
    at::Tensor rows = at::empty({chunk, p.out_h, p.out_w, p.in_channels}, input.options());
    for (int64_t first = 0; first < p.batch; first += chunk) {
      const int64_t images = std::min(chunk, p.batch - first);
      at::Tensor grad_rows = rows.narrow(0, 0, images);
      grad_rows.copy_(grad_output.narrow(0, first, images).permute({0, 2, 3, 1}));  // [images, H_out, W_out, C]
      const GradSource source{at::Tensor(), weight_tc, grad_rows};
      coordinate_grads_from(p, t, first, images, source, grad_offset, grad_mask);
      input_grad_from(p, t, first, images, source, grad_input);
      grad_weight_tc.add_(depthwise_weight_grad(p, t, first, images, grad_rows));
    }
  } else {
    grad_offset.zero_();
    if (grad_mask.defined()) grad_mask.zero_();
  }
  std::optional<at::Tensor> grad_mask_result;
  if (grad_mask.defined()) grad_mask_result = grad_mask;
  // [taps, C] -> [C, 1, kh, kw]
  at::Tensor grad_weight = grad_weight_tc.t().contiguous().view({p.in_channels, 1, p.kernel_h, p.kernel_w});
  return {grad_input.permute({0, 3, 1, 2}).to(input.scalar_type(), /*non_blocking=*/false, /*copy=*/false,
                                               at::MemoryFormat::Contiguous),
          grad_offset, grad_weight.to(weight.scalar_type()), grad_mask_result, grad_bias};
}

}  // namespace

// ------------------------------------------------------------------------------------------ the ops

at::Tensor deform_conv2d_forward(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                                 const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                                 at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                                 c10::string_view border_gradient) {
  const ConvParams p = make_conv_params(input, offset, weight, mask, bias, stride, padding, dilation, border_gradient);
  const DeviceGuard guard(input.device());
  if (p.is_depthwise()) return depthwise_forward(p, input, offset, weight, mask, bias);
  return forward_with(passes(), p, input, offset, weight, mask, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>
deform_conv2d_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset,
                       const at::Tensor& weight, const std::optional<at::Tensor>& mask, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, bool bias_defined,
                       c10::string_view border_gradient) {
  const ConvParams p = make_conv_params(input, offset, weight, mask, std::nullopt, stride, padding, dilation, border_gradient);
  check_grad_output(p, grad_output, input);
  const DeviceGuard guard(input.device());
  if (p.is_depthwise()) return depthwise_backward(p, grad_output, input, offset, weight, mask, bias_defined);
  return backward_with(passes(), p, grad_output, input, offset, weight, mask, bias_defined);
}

}  // namespace cuda
}  // namespace deform_conv
