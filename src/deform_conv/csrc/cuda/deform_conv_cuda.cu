// CUDA backend: the three sampling passes as kernels, behind the shared chunk-and-GEMM driver (the GEMMs go
// to cuBLAS through ATen, on tensor cores for half types). Same column layout as the CPU (channels innermost:
// consecutive threads handle consecutive channels, so the gathers from the channels-last input and the
// writes to the columns are coalesced). The sampling math is sampling.h, shared with the CPU.
//
// Every host entry point: validate (devices included) -> device guard -> allocate -> launch on the current
// stream -> launch check.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>


#include "../columns_driver.h"
#include "../sampling.h"

namespace deform_conv {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

int64_t blocks_for(int64_t work, int64_t per_block) {
  // Grid-stride loops cover the rest; 2^20 blocks keep every SM busy on any GPU.
  return std::max<int64_t>(1, std::min<int64_t>((work + per_block - 1) / per_block, int64_t(1) << 20));
}

// The kernels' loop counters and the divisions that split a flat work index into its parts (the costly part of
// the index arithmetic) run in 32 bits when every flat index of every tensor the kernels touch (the columns of
// one chunk, the input, the offset and the input gradient) stays below 2^30: the grid-stride loops step by at
// most 2^28 (2^20 blocks of 256 threads), so index + step cannot overflow int32 either. Addresses are computed
// in 64 bits either way (ConvParams' helpers return int64_t).
bool fits_int32(const ConvParams& p, int64_t images) {
  const int64_t limit = int64_t(1) << 30;
  const int64_t columns = images * p.out_pixels() * p.taps() * p.in_channels;
  const int64_t input = p.batch * p.height * p.width * p.in_channels;
  const int64_t offset = p.batch * 2 * p.offset_groups * p.taps() * p.out_pixels();
  return columns < limit && input < limit && offset < limit;
}

// One sampling point: (image n, output pixel, offset group, tap), with its coordinates read from the offset.
template <typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ BilinearSample<acc_t> sample_point(const ConvParams& p, const scalar_t* offset, index_t n,
                                                              index_t pixel, index_t group, index_t tap) {
  const scalar_t* dy = offset + p.offset_index(n, group, tap, pixel);
  const acc_t y = static_cast<acc_t>(p.base_y(pixel / p.out_w, tap / p.kernel_w)) + static_cast<acc_t>(dy[0]);
  const acc_t x = static_cast<acc_t>(p.base_x(pixel % p.out_w, tap % p.kernel_w)) +
                  static_cast<acc_t>(dy[p.out_pixels()]);
  return bilinear_sample(y, x, p.height, p.width);
}

// The mask's factor for a sampling point (1 without a mask).
template <typename scalar_t, typename acc_t, typename index_t>
__device__ __forceinline__ acc_t mask_factor(const ConvParams& p, const scalar_t* mask, index_t n, index_t group,
                                             index_t tap, index_t pixel) {
  return mask != nullptr ? static_cast<acc_t>(mask[p.mask_index(n, group, tap, pixel)]) : acc_t(1);
}

// Decomposes a flat work index (channel fastest, then tap, then output pixel, then image) into its parts and
// the address of its element in the columns (ConvParams::column_index).
template <typename index_t>
struct ColumnElement {
  index_t n_local, pixel, tap, channel, group, column;

  __device__ __forceinline__ ColumnElement(const ConvParams& p, index_t flat) {
    const index_t channels = p.in_channels, taps = p.taps(), pixels = p.out_pixels();
    channel = flat % channels;
    index_t rest = flat / channels;
    tap = rest % taps;
    rest /= taps;
    pixel = rest % pixels;
    n_local = rest / pixels;
    group = channel / p.channels_per_offset_group();
    const index_t per_group = p.in_channels_per_group();
    const index_t g = channel / per_group;
    column = p.column_index(n_local, pixel, g, tap, channel - g * per_group);
  }
};

template <typename scalar_t, typename index_t>
__global__ void fill_columns_kernel(ConvParams p, const scalar_t* __restrict__ input, const scalar_t* __restrict__ offset,
                                    const scalar_t* __restrict__ mask, index_t first, index_t total,
                                    scalar_t* __restrict__ columns) {
  using acc_t = at::opmath_type<scalar_t>;
  for (index_t flat = blockIdx.x * index_t(blockDim.x) + threadIdx.x; flat < total;
       flat += index_t(blockDim.x) * gridDim.x) {
    const ColumnElement<index_t> e(p, flat);
    const index_t n = first + e.n_local;
    const BilinearSample<acc_t> s = sample_point<scalar_t, acc_t, index_t>(p, offset, n, e.pixel, e.group, e.tap);
    const scalar_t* image = input + n * p.height * p.width * p.in_channels + e.channel;
    acc_t value = sum_start(s);
    for (int q = 0; q < s.count; ++q) value += s.weight[q] * static_cast<acc_t>(image[s.pixel[q] * p.in_channels]);
    // The mask multiplies the interpolated value, so a non-finite mask propagates as a multiplication would.
    if (mask != nullptr) value *= mask_factor<scalar_t, acc_t, index_t>(p, mask, n, e.group, e.tap, e.pixel);
    columns[e.column] = static_cast<scalar_t>(value);
  }
}

// One warp per sampling point: the lanes stride over the offset group's channels, then a fixed-order
// butterfly reduction (deterministic) gives d loss / d value, d y and d x.
template <typename scalar_t, typename index_t>
__global__ void coordinate_grads_kernel(ConvParams p, const scalar_t* __restrict__ input,
                                        const scalar_t* __restrict__ offset, const scalar_t* __restrict__ mask,
                                        const scalar_t* __restrict__ grad_columns, index_t first, index_t points,
                                        scalar_t* __restrict__ grad_offset, scalar_t* __restrict__ grad_mask) {
  using acc_t = at::opmath_type<scalar_t>;
  const index_t lane = threadIdx.x % kWarp;
  const index_t warps = index_t(blockDim.x / kWarp) * gridDim.x;
  const index_t per_offset_group = p.channels_per_offset_group(), per_group = p.in_channels_per_group();
  for (index_t point = (blockIdx.x * index_t(blockDim.x) + threadIdx.x) / kWarp; point < points; point += warps) {
    // point = ((n_local * pixels + pixel) * offset_groups + group) * taps + tap
    const index_t tap = point % p.taps();
    index_t rest = point / p.taps();
    const index_t group = rest % p.offset_groups;
    rest /= p.offset_groups;
    const index_t pixel = rest % p.out_pixels(), n_local = rest / p.out_pixels(), n = first + n_local;
    const BilinearSample<acc_t> s = sample_point<scalar_t, acc_t, index_t>(p, offset, n, pixel, group, tap);
    const scalar_t* image = input + n * p.height * p.width * p.in_channels;
    acc_t grad_value = sum_start(s), grad_y = sum_start(s), grad_x = sum_start(s);
    for (index_t c = group * per_offset_group + lane; c < (group + 1) * per_offset_group; c += kWarp) {
      const index_t g = c / per_group;
      const index_t column = p.column_index(n_local, pixel, g, tap, c - g * per_group);
      const acc_t grad = static_cast<acc_t>(grad_columns[column]);
      for (int q = 0; q < s.count; ++q) {
        const acc_t v = grad * static_cast<acc_t>(image[s.pixel[q] * p.in_channels + c]);
        grad_value += s.weight[q] * v;
        grad_y += s.weight_dy[q] * v;
        grad_x += s.weight_dx[q] * v;
      }
    }
    for (int delta = kWarp / 2; delta > 0; delta /= 2) {
      grad_value += __shfl_xor_sync(0xffffffffu, grad_value, delta);
      grad_y += __shfl_xor_sync(0xffffffffu, grad_y, delta);
      grad_x += __shfl_xor_sync(0xffffffffu, grad_x, delta);
    }
    if (lane == 0) {
      const acc_t m = mask_factor<scalar_t, acc_t, index_t>(p, mask, n, group, tap, pixel);
      if (mask != nullptr) grad_mask[p.mask_index(n, group, tap, pixel)] = static_cast<scalar_t>(grad_value);
      scalar_t* g_dy = grad_offset + p.offset_index(n, group, tap, pixel);
      g_dy[0] = static_cast<scalar_t>(coordinate_grad(s, m, grad_y));
      g_dy[p.out_pixels()] = static_cast<scalar_t>(coordinate_grad(s, m, grad_x));
    }
  }
}

// One thread per column element scatters its gradient into the (up to) four neighbours with atomics, in the
// accumulation type. The order of the atomic additions is not fixed: not bitwise reproducible.
template <typename scalar_t, typename index_t>
__global__ void input_grad_kernel(ConvParams p, const scalar_t* __restrict__ offset, const scalar_t* __restrict__ mask,
                                  const scalar_t* __restrict__ grad_columns, index_t first, index_t total,
                                  at::opmath_type<scalar_t>* __restrict__ grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  for (index_t flat = blockIdx.x * index_t(blockDim.x) + threadIdx.x; flat < total;
       flat += index_t(blockDim.x) * gridDim.x) {
    const ColumnElement<index_t> e(p, flat);
    const index_t n = first + e.n_local;
    const BilinearSample<acc_t> s = sample_point<scalar_t, acc_t, index_t>(p, offset, n, e.pixel, e.group, e.tap);
    if (s.count == 0) continue;
    const acc_t grad = static_cast<acc_t>(grad_columns[e.column]) *
                       mask_factor<scalar_t, acc_t, index_t>(p, mask, n, e.group, e.tap, e.pixel);
    acc_t* image_grad = grad_input + n * p.height * p.width * p.in_channels + e.channel;
    for (int q = 0; q < s.count; ++q) gpuAtomicAdd(image_grad + s.pixel[q] * p.in_channels, s.weight[q] * grad);
  }
}

#define DEFORM_CONV_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)

template <typename scalar_t>
const scalar_t* mask_pointer(const SamplingTensors& t) {
  return t.mask.defined() ? t.mask.const_data_ptr<scalar_t>() : nullptr;
}

template <typename F>
void with_index_type(const ConvParams& p, int64_t images, F&& f) {
  if (fits_int32(p, images)) {
    f(int32_t(0));
  } else {
    f(int64_t(0));
  }
}

void fill(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images, at::Tensor& columns) {
  const int64_t total = images * p.out_pixels() * p.taps() * p.in_channels;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  DEFORM_CONV_DISPATCH(t.input.scalar_type(), "deform_conv2d_cuda", [&] {
    with_index_type(p, images, [&](auto index) {
      using index_t = decltype(index);
      fill_columns_kernel<scalar_t, index_t><<<blocks_for(total, kThreads), kThreads, 0, stream>>>(
          p, t.input.const_data_ptr<scalar_t>(), t.offset.const_data_ptr<scalar_t>(), mask_pointer<scalar_t>(t),
          index_t(first), index_t(total), columns.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void coordinate_grads(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                      const at::Tensor& grad_columns, at::Tensor& grad_offset, at::Tensor& grad_mask) {
  const int64_t points = images * p.out_pixels() * p.offset_groups * p.taps();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  DEFORM_CONV_DISPATCH(t.input.scalar_type(), "deform_conv2d_backward_cuda", [&] {
    with_index_type(p, images, [&](auto index) {
      using index_t = decltype(index);
      coordinate_grads_kernel<scalar_t, index_t><<<blocks_for(points, kThreads / kWarp), kThreads, 0, stream>>>(
          p, t.input.const_data_ptr<scalar_t>(), t.offset.const_data_ptr<scalar_t>(), mask_pointer<scalar_t>(t),
          grad_columns.const_data_ptr<scalar_t>(), index_t(first), index_t(points),
          grad_offset.mutable_data_ptr<scalar_t>(),
          grad_mask.defined() ? grad_mask.mutable_data_ptr<scalar_t>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void input_grad(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                const at::Tensor& grad_columns, at::Tensor& grad_input) {
  at::globalContext().alertNotDeterministic("deform_conv2d_backward_cuda (the input gradient uses atomicAdd)");
  const int64_t total = images * p.out_pixels() * p.taps() * p.in_channels;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  DEFORM_CONV_DISPATCH(t.input.scalar_type(), "deform_conv2d_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_index_type(p, images, [&](auto index) {
      using index_t = decltype(index);
      input_grad_kernel<scalar_t, index_t><<<blocks_for(total, kThreads), kThreads, 0, stream>>>(
          p, t.offset.const_data_ptr<scalar_t>(), mask_pointer<scalar_t>(t), grad_columns.const_data_ptr<scalar_t>(),
          index_t(first), index_t(total), grad_input.mutable_data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// 256 MiB of columns per chunk: large enough that the GEMMs fill the GPU.
constexpr SamplingPasses kPasses{fill, coordinate_grads, input_grad, int64_t(256) << 20, /*gemm_as_convolution=*/false,
                                 /*backward_gemms=*/nullptr, /*scratch=*/nullptr};  // the caching allocator reuses device memory already

at::Tensor forward(const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
                   const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                   at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
  const ConvParams p = make_conv_params(input, offset, weight, mask, bias, stride, padding, dilation);
  const c10::cuda::CUDAGuard guard(input.device());
  return forward_with(kPasses, p, input, offset, weight, mask, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
    const std::optional<at::Tensor>& mask, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
    bool bias_defined) {
  const ConvParams p = make_conv_params(input, offset, weight, mask, std::nullopt, stride, padding, dilation);
  check_grad_output(p, grad_output, input);
  const c10::cuda::CUDAGuard guard(input.device());
  return backward_with(kPasses, p, grad_output, input, offset, weight, mask, bias_defined);
}

}  // namespace
}  // namespace cuda
}  // namespace deform_conv

TORCH_LIBRARY_IMPL(deform_conv, CUDA, m) {
  m.impl("deform_conv2d", &deform_conv::cuda::forward);
  m.impl("deform_conv2d_backward", &deform_conv::cuda::backward);
}
