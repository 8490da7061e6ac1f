// CUDA backend: the three sampling passes as kernels, behind the shared chunk-and-GEMM driver (the GEMMs go
// to cuBLAS through ATen, on tensor cores for half types). The sampling math is sampling.h, shared with the CPU;
// the few device-specific calls go through execution.cuh, so the CUDA simulation runs this same source in the
// tests.
//
// Work is split by sampling point (image, output pixel, offset group, tap): a group of `lanes` adjacent threads
// (a power of two up to a warp) takes one point, computes its coordinates, bilinear weights and neighbours once,
// and strides over the point's channels with vector loads and stores of up to 16 bytes. `lanes` is the smallest
// power of two that covers the offset group's channel vectors, so no warp idles when an offset group has few
// channels (one thread a point when each offset group has one channel). The column layout, channels innermost
// (ConvParams::column_index), makes those loads and stores contiguous.
//
// Every host entry point: validate (devices included) -> device guard -> allocate -> launch on the current
// stream -> launch check (execution.cuh's launch).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <type_traits>

#include "../columns_driver.h"
#include "../sampling.h"
#include "execution.cuh"

namespace deform_conv {
namespace cuda {
namespace {

constexpr int kThreads = 256;  // a multiple of the warp: the coordinate kernel's shuffles need whole warps
constexpr int kWarp = 32;

int64_t blocks_for(int64_t threads) {
  // Grid-stride loops cover the rest; 2^20 blocks keep every SM busy on any GPU.
  return std::max<int64_t>(1, std::min<int64_t>((threads + kThreads - 1) / kThreads, int64_t(1) << 20));
}

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
  if (fits_int32(p, images)) {
    note_index_bits(32);
    f(int32_t(0));
  } else {
    note_index_bits(64);
    f(int64_t(0));
  }
}

// ConvParams' sizes in the kernels' index type, so that their arithmetic runs in it.
template <typename index_t>
struct Geometry {
  index_t in_channels, height, width, image_pixels, kernel_w, taps, out_w, out_pixels;
  index_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  index_t groups, offset_groups, per_offset_group, per_group;

  explicit Geometry(const ConvParams& p)
      : in_channels(p.in_channels), height(p.height), width(p.width), image_pixels(p.height * p.width),
        kernel_w(p.kernel_w), taps(p.taps()), out_w(p.out_w), out_pixels(p.out_pixels()), stride_h(p.stride_h),
        stride_w(p.stride_w), pad_h(p.pad_h), pad_w(p.pad_w), dilation_h(p.dilation_h), dilation_w(p.dilation_w),
        groups(p.groups), offset_groups(p.offset_groups), per_offset_group(p.channels_per_offset_group()),
        per_group(p.in_channels_per_group()) {}

  // = ConvParams::offset_index and mask_index.
  DC_HOST_DEVICE index_t offset_index(index_t n, index_t group, index_t tap, index_t pixel) const {
    return ((n * offset_groups + group) * taps + tap) * 2 * out_pixels + pixel;
  }
  DC_HOST_DEVICE index_t mask_index(index_t n, index_t group, index_t tap, index_t pixel) const {
    return ((n * offset_groups + group) * taps + tap) * out_pixels + pixel;
  }
  // = ConvParams::column_index for input channel `channel`, whichever weight group holds it.
  DC_HOST_DEVICE index_t column_index(index_t n_local, index_t pixel, index_t tap, index_t channel) const {
    const index_t g = channel / per_group;
    return (((n_local * out_pixels + pixel) * groups + g) * taps + tap) * per_group +
           (channel - g * per_group);
  }
  // Of the channels-last input [B, H, W, C_in] and its gradient.
  DC_HOST_DEVICE index_t input_index(index_t n, index_t image_pixel, index_t channel) const {
    return (n * image_pixels + image_pixel) * in_channels + channel;
  }
};

// One sampling point, decoded from its flat index ((n_local * out_pixels + pixel) * offset_groups + group) * taps
// + tap, with its coordinates read from the offset and its mask factor (1 without a mask).
template <typename acc_t, typename index_t>
struct Point {
  index_t n_local, n, pixel, group, tap;
  BilinearPoint<acc_t, index_t> b;
  acc_t mask;

  template <typename scalar_t>
  DC_HOST_DEVICE Point(const Geometry<index_t>& g, const scalar_t* offset, const scalar_t* mask_or_null, index_t first,
                       index_t point) {
    tap = point % g.taps;
    index_t rest = point / g.taps;
    group = rest % g.offset_groups;
    rest /= g.offset_groups;
    pixel = rest % g.out_pixels;
    n_local = rest / g.out_pixels;
    n = first + n_local;
    const index_t oy = pixel / g.out_w, i = tap / g.kernel_w;
    const index_t ox = pixel - oy * g.out_w, j = tap - i * g.kernel_w;
    const scalar_t* dy = offset + g.offset_index(n, group, tap, pixel);
    const acc_t y = static_cast<acc_t>(oy * g.stride_h - g.pad_h + i * g.dilation_h) + static_cast<acc_t>(dy[0]);
    const acc_t x = static_cast<acc_t>(ox * g.stride_w - g.pad_w + j * g.dilation_w) +
                    static_cast<acc_t>(dy[g.out_pixels]);
    b = bilinear_point(y, x, g.height, g.width);
    mask = mask_or_null != nullptr ? static_cast<acc_t>(mask_or_null[g.mask_index(n, group, tap, pixel)]) : acc_t(1);
  }
  DC_HOST_DEVICE index_t first_channel(const Geometry<index_t>& g) const { return group * g.per_offset_group; }
};

// V consecutive elements, loaded and stored as one access of V * sizeof(T) bytes.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vector {
  T v[V];
};

template <int V, typename T>
DC_DEVICE Vector<T, V> load_vector(const T* address) {
  return *reinterpret_cast<const Vector<T, V>*>(address);
}

template <int V, typename T>
DC_DEVICE void store_vector(T* address, const Vector<T, V>& value) {
  *reinterpret_cast<Vector<T, V>*>(address) = value;
}

// How the threads share the work of one launch: `lanes` (2^lanes_log2) threads a point, V channels a load.
struct Split {
  int lanes_log2;
};

template <typename scalar_t, typename index_t, int V>
DC_KERNEL void fill_columns_kernel(Geometry<index_t> g, Split split, const scalar_t* __restrict__ input,
                                   const scalar_t* __restrict__ offset, const scalar_t* __restrict__ mask,
                                   index_t first, index_t points, scalar_t* __restrict__ columns) {
  using acc_t = at::opmath_type<scalar_t>;
  const index_t thread = blockIdx.x * index_t(blockDim.x) + threadIdx.x;
  const index_t lanes = index_t(1) << split.lanes_log2, lane = thread & (lanes - 1);
  const index_t step = (index_t(blockDim.x) * gridDim.x) >> split.lanes_log2;
  for (index_t point = thread >> split.lanes_log2; point < points; point += step) {
    const Point<acc_t, index_t> s(g, offset, mask, first, point);
    const index_t end = s.first_channel(g) + g.per_offset_group;
    for (index_t c = s.first_channel(g) + lane * V; c < end; c += lanes * V) {
      acc_t value[V];
#pragma unroll
      for (int k = 0; k < V; ++k) value[k] = sum_start<acc_t>(s.b.nan);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (!s.b.valid(q)) continue;
        const Vector<scalar_t, V> v = load_vector<V>(input + g.input_index(s.n, s.b.pixel(q, g.width), c));
        const acc_t w = s.b.weight(q);
#pragma unroll
        for (int k = 0; k < V; ++k) value[k] += w * static_cast<acc_t>(v.v[k]);
      }
      Vector<scalar_t, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        // The mask multiplies the interpolated value, so a non-finite mask propagates as a multiplication would.
        out.v[k] = static_cast<scalar_t>(mask != nullptr ? value[k] * s.mask : value[k]);
      }
      store_vector<V>(columns + g.column_index(s.n_local, s.pixel, s.tap, c), out);
    }
  }
}

// d loss / d value, d y and d x of each point: its lanes sum over the point's channels, then a fixed-order
// butterfly over the lanes (deterministic). The loop runs the same number of times in every lane of a warp
// (points past the end take part with zeros), as a full-warp shuffle requires.
template <typename scalar_t, typename index_t, int V>
DC_KERNEL void coordinate_grads_kernel(Geometry<index_t> g, Split split, const scalar_t* __restrict__ input,
                                       const scalar_t* __restrict__ offset, const scalar_t* __restrict__ mask,
                                       const scalar_t* __restrict__ grad_columns, index_t first, index_t points,
                                       scalar_t* __restrict__ grad_offset, scalar_t* __restrict__ grad_mask) {
  using acc_t = at::opmath_type<scalar_t>;
  const index_t thread = blockIdx.x * index_t(blockDim.x) + threadIdx.x;
  const index_t lanes = index_t(1) << split.lanes_log2, lane = thread & (lanes - 1);
  const index_t per_warp = kWarp >> split.lanes_log2;  // points a warp takes at once
  const index_t warp_step = ((index_t(blockDim.x) * gridDim.x) / kWarp) * per_warp;
  for (index_t base = (thread / kWarp) * per_warp; base < points; base += warp_step) {
    const index_t point = base + (thread % kWarp) / lanes;
    const bool active = point < points;
    // A lane past the end decodes the last point (valid addresses) and adds nothing.
    const Point<acc_t, index_t> s(g, offset, mask, first, active ? point : points - 1);
    acc_t grad_value = 0, grad_y = 0, grad_x = 0;
    if (active) {
      grad_value = grad_y = grad_x = sum_start<acc_t>(s.b.nan);
      const index_t end = s.first_channel(g) + g.per_offset_group;
      for (index_t c = s.first_channel(g) + lane * V; c < end; c += lanes * V) {
        const Vector<scalar_t, V> grad = load_vector<V>(grad_columns + g.column_index(s.n_local, s.pixel, s.tap, c));
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (!s.b.valid(q)) continue;
          const Vector<scalar_t, V> v = load_vector<V>(input + g.input_index(s.n, s.b.pixel(q, g.width), c));
          acc_t dot = 0;
#pragma unroll
          for (int k = 0; k < V; ++k) dot += static_cast<acc_t>(grad.v[k]) * static_cast<acc_t>(v.v[k]);
          grad_value += s.b.weight(q) * dot;
          grad_y += s.b.weight_dy(q) * dot;
          grad_x += s.b.weight_dx(q) * dot;
        }
      }
    }
    for (int delta = static_cast<int>(lanes) / 2; delta > 0; delta /= 2) {
      grad_value += warp_xor(grad_value, delta);
      grad_y += warp_xor(grad_y, delta);
      grad_x += warp_xor(grad_x, delta);
    }
    if (active && lane == 0) {
      if (mask != nullptr) grad_mask[g.mask_index(s.n, s.group, s.tap, s.pixel)] = static_cast<scalar_t>(grad_value);
      scalar_t* g_dy = grad_offset + g.offset_index(s.n, s.group, s.tap, s.pixel);
      g_dy[0] = static_cast<scalar_t>(coordinate_grad(s.b, s.mask, grad_y));
      g_dy[g.out_pixels] = static_cast<scalar_t>(coordinate_grad(s.b, s.mask, grad_x));
    }
  }
}

// The input gradient, default mode: each point's lanes scatter (weight * mask * grad_column) into its in-image
// neighbours with atomics in the accumulation type. The order of the additions is not fixed.
template <typename scalar_t, typename index_t, int V>
DC_KERNEL void input_grad_atomic_kernel(Geometry<index_t> g, Split split, const scalar_t* __restrict__ offset,
                                        const scalar_t* __restrict__ mask, const scalar_t* __restrict__ grad_columns,
                                        index_t first, index_t points, at::opmath_type<scalar_t>* __restrict__ grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  const index_t thread = blockIdx.x * index_t(blockDim.x) + threadIdx.x;
  const index_t lanes = index_t(1) << split.lanes_log2, lane = thread & (lanes - 1);
  const index_t step = (index_t(blockDim.x) * gridDim.x) >> split.lanes_log2;
  for (index_t point = thread >> split.lanes_log2; point < points; point += step) {
    const Point<acc_t, index_t> s(g, offset, mask, first, point);
    if (!s.b.inside) continue;  // outside the image, or NaN: reads no pixel, so adds nothing
    const index_t end = s.first_channel(g) + g.per_offset_group;
    for (index_t c = s.first_channel(g) + lane * V; c < end; c += lanes * V) {
      const Vector<scalar_t, V> grad = load_vector<V>(grad_columns + g.column_index(s.n_local, s.pixel, s.tap, c));
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (!s.b.valid(q)) continue;
        acc_t* target = grad_input + g.input_index(s.n, s.b.pixel(q, g.width), c);
        const acc_t w = s.b.weight(q);
#pragma unroll
        for (int k = 0; k < V; ++k) atomic_add(target + k, w * (static_cast<acc_t>(grad.v[k]) * s.mask));
      }
    }
  }
}

// The input gradient under torch.use_deterministic_algorithms(True), as a gather: every (point, corner) pair is an
// entry keyed by the input pixel it reads, ((n_local * offset_groups + group) * H*W + pixel), or by `keys` (past
// every real key) when the corner lies outside the image. A stable sort of the keys lists each pixel's entries in
// entry order; one lane group a pixel then sums its entries in that order and writes the sum once. No atomics, so
// the bits are the same in every run, whatever order the blocks run in.
template <typename scalar_t, typename index_t>
DC_KERNEL void entry_keys_kernel(Geometry<index_t> g, const scalar_t* __restrict__ offset,
                                 const scalar_t* __restrict__ mask, index_t first, index_t points, index_t keys,
                                 int64_t* __restrict__ entry_keys) {
  using acc_t = at::opmath_type<scalar_t>;
  const index_t step = index_t(blockDim.x) * gridDim.x;
  for (index_t point = blockIdx.x * index_t(blockDim.x) + threadIdx.x; point < points; point += step) {
    const Point<acc_t, index_t> s(g, offset, mask, first, point);
    const index_t pixels_before = (s.n_local * g.offset_groups + s.group) * g.image_pixels;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      entry_keys[4 * point + q] = s.b.valid(q) ? pixels_before + s.b.pixel(q, g.width) : keys;
    }
  }
}

template <typename scalar_t, typename index_t>
DC_KERNEL void input_grad_gather_kernel(Geometry<index_t> g, Split split, const scalar_t* __restrict__ offset,
                                        const scalar_t* __restrict__ mask, const scalar_t* __restrict__ grad_columns,
                                        const int64_t* __restrict__ sorted_entries,
                                        const int64_t* __restrict__ key_starts, index_t first, index_t keys,
                                        at::opmath_type<scalar_t>* __restrict__ grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  const index_t thread = blockIdx.x * index_t(blockDim.x) + threadIdx.x;
  const index_t lanes = index_t(1) << split.lanes_log2, lane = thread & (lanes - 1);
  const index_t step = (index_t(blockDim.x) * gridDim.x) >> split.lanes_log2;
  for (index_t key = thread >> split.lanes_log2; key < keys; key += step) {
    const index_t begin = static_cast<index_t>(key_starts[key]), end = static_cast<index_t>(key_starts[key + 1]);
    if (begin == end) continue;  // no point reads this pixel: its gradient stays 0
    const index_t image_pixel = key % g.image_pixels, rest = key / g.image_pixels;
    const index_t group = rest % g.offset_groups, n = first + rest / g.offset_groups;
    const index_t channels_end = (group + 1) * g.per_offset_group;
    for (index_t c = group * g.per_offset_group + lane; c < channels_end; c += lanes) {
      acc_t sum = 0;
      for (index_t e = begin; e < end; ++e) {
        const index_t entry = static_cast<index_t>(sorted_entries[e]);
        const Point<acc_t, index_t> s(g, offset, mask, first, entry / 4);
        const int q = static_cast<int>(entry % 4);
        const acc_t grad = static_cast<acc_t>(grad_columns[g.column_index(s.n_local, s.pixel, s.tap, c)]);
        sum += s.b.weight(q) * (grad * s.mask);
      }
      grad_input[g.input_index(n, image_pixel, c)] += sum;
    }
  }
}

#define DEFORM_CONV_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)

template <typename scalar_t>
const scalar_t* mask_pointer(const SamplingTensors& t) {
  return t.mask.defined() ? t.mask.const_data_ptr<scalar_t>() : nullptr;
}

// 16 bytes a load where the channel counts and the addresses allow it, else one element.
template <typename scalar_t>
constexpr int kWideVector = 16 / sizeof(scalar_t);

template <typename scalar_t>
bool wide_vectors_fit(const ConvParams& p, std::initializer_list<const void*> pointers) {
  constexpr int v = kWideVector<scalar_t>;
  bool fit = p.channels_per_offset_group() % v == 0 && p.in_channels_per_group() % v == 0;
  for (const void* pointer : pointers) fit = fit && reinterpret_cast<uintptr_t>(pointer) % (v * sizeof(scalar_t)) == 0;
  return fit;
}

// The smallest power of two of lanes that covers an offset group's `vectors` channel vectors, at most a warp.
Split split_for(int64_t vectors) {
  int log2 = 0;
  while (log2 < 5 && (int64_t(1) << log2) < vectors) ++log2;
  return Split{log2};
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

void fill(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images, at::Tensor& columns) {
  DEFORM_CONV_DISPATCH(t.input.scalar_type(), "deform_conv2d_cuda", [&] {
    const bool wide = wide_vectors_fit<scalar_t>(p, {t.input.const_data_ptr(), columns.const_data_ptr()});
    with_index_and_vector<scalar_t>(p, images, wide, [&](auto index, auto vector) {
      using index_t = decltype(index);
      constexpr int V = decltype(vector)::value;
      const Split split = split_for(p.channels_per_offset_group() / V);
      const int64_t points = points_of(p, images);
      launch(fill_columns_kernel<scalar_t, index_t, V>, blocks_for(points << split.lanes_log2), kThreads,
             Geometry<index_t>(p), split, t.input.const_data_ptr<scalar_t>(), t.offset.const_data_ptr<scalar_t>(),
             mask_pointer<scalar_t>(t), index_t(first), index_t(points), columns.mutable_data_ptr<scalar_t>());
    });
  });
}

void coordinate_grads(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                      const at::Tensor& grad_columns, at::Tensor& grad_offset, at::Tensor& grad_mask) {
  DEFORM_CONV_DISPATCH(t.input.scalar_type(), "deform_conv2d_backward_cuda", [&] {
    const bool wide = wide_vectors_fit<scalar_t>(p, {t.input.const_data_ptr(), grad_columns.const_data_ptr()});
    with_index_and_vector<scalar_t>(p, images, wide, [&](auto index, auto vector) {
      using index_t = decltype(index);
      constexpr int V = decltype(vector)::value;
      const Split split = split_for(p.channels_per_offset_group() / V);
      const int64_t points = points_of(p, images), per_warp = kWarp >> split.lanes_log2;
      launch(coordinate_grads_kernel<scalar_t, index_t, V>, blocks_for((points + per_warp - 1) / per_warp * kWarp),
             kThreads, Geometry<index_t>(p), split, t.input.const_data_ptr<scalar_t>(),
             t.offset.const_data_ptr<scalar_t>(), mask_pointer<scalar_t>(t), grad_columns.const_data_ptr<scalar_t>(),
             index_t(first), index_t(points), grad_offset.mutable_data_ptr<scalar_t>(),
             grad_mask.defined() ? grad_mask.mutable_data_ptr<scalar_t>() : nullptr);
    });
  });
}

void input_grad_deterministic(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                              const at::Tensor& grad_columns, at::Tensor& grad_input) {
  const int64_t points = points_of(p, images), keys = images * p.offset_groups * p.height * p.width;
  at::Tensor entry_keys = at::empty({4 * points}, t.offset.options().dtype(at::kLong));
  DEFORM_CONV_DISPATCH(t.input.scalar_type(), "deform_conv2d_backward_cuda", [&] {
    with_index_type(p, images, [&](auto index) {
      using index_t = decltype(index);
      launch(entry_keys_kernel<scalar_t, index_t>, blocks_for(points), kThreads, Geometry<index_t>(p),
             t.offset.const_data_ptr<scalar_t>(), mask_pointer<scalar_t>(t), index_t(first), index_t(points),
             index_t(keys), entry_keys.mutable_data_ptr<int64_t>());
    });
  });
  // Stable: entries of one key keep their order, so the sums below add in a fixed order.
  const auto [sorted_keys, sorted_entries] = at::sort(entry_keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor key_starts = at::searchsorted(sorted_keys, at::arange(keys + 1, sorted_keys.options()));
  DEFORM_CONV_DISPATCH(t.input.scalar_type(), "deform_conv2d_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_index_type(p, images, [&](auto index) {
      using index_t = decltype(index);
      const Split split = split_for(p.channels_per_offset_group());
      launch(input_grad_gather_kernel<scalar_t, index_t>, blocks_for(keys << split.lanes_log2), kThreads,
             Geometry<index_t>(p), split, t.offset.const_data_ptr<scalar_t>(), mask_pointer<scalar_t>(t),
             grad_columns.const_data_ptr<scalar_t>(), sorted_entries.const_data_ptr<int64_t>(),
             key_starts.const_data_ptr<int64_t>(), index_t(first), index_t(keys), grad_input.mutable_data_ptr<acc_t>());
    });
  });
}

void input_grad(const ConvParams& p, const SamplingTensors& t, int64_t first, int64_t images,
                const at::Tensor& grad_columns, at::Tensor& grad_input) {
  if (at::globalContext().deterministicAlgorithms()) {
    input_grad_deterministic(p, t, first, images, grad_columns, grad_input);
    return;
  }
  DEFORM_CONV_DISPATCH(t.input.scalar_type(), "deform_conv2d_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const bool wide = wide_vectors_fit<scalar_t>(p, {grad_columns.const_data_ptr()});
    with_index_and_vector<scalar_t>(p, images, wide, [&](auto index, auto vector) {
      using index_t = decltype(index);
      constexpr int V = decltype(vector)::value;
      const Split split = split_for(p.channels_per_offset_group() / V);
      const int64_t points = points_of(p, images);
      launch(input_grad_atomic_kernel<scalar_t, index_t, V>, blocks_for(points << split.lanes_log2), kThreads,
             Geometry<index_t>(p), split, t.offset.const_data_ptr<scalar_t>(), mask_pointer<scalar_t>(t),
             grad_columns.const_data_ptr<scalar_t>(), index_t(first), index_t(points),
             grad_input.mutable_data_ptr<acc_t>());
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
  const DeviceGuard guard(input.device());
  return forward_with(kPasses, p, input, offset, weight, mask, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& offset, const at::Tensor& weight,
    const std::optional<at::Tensor>& mask, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
    bool bias_defined) {
  const ConvParams p = make_conv_params(input, offset, weight, mask, std::nullopt, stride, padding, dilation);
  check_grad_output(p, grad_output, input);
  const DeviceGuard guard(input.device());
  return backward_with(kPasses, p, grad_output, input, offset, weight, mask, bias_defined);
}

}  // namespace
}  // namespace cuda
}  // namespace deform_conv

DC_REGISTER_CUDA_KERNELS(m) {
  m.impl("deform_conv2d", &deform_conv::cuda::forward);
  m.impl("deform_conv2d_backward", &deform_conv::cuda::backward);
}
