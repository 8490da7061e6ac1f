#include "depthwise.h"

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "layout.h"
#include "sampling_point.h"
#include "thread_images.h"

namespace deform_conv {
namespace cpu {
namespace {

// The weight's gradient sums over every (image, output pixel) row. Rows are cut into at most this many
// blocks of consecutive rows, each summed on its own and then added in block order: the result does not
// depend on the number of threads.
constexpr int64_t kMaxWeightBlocks = 256;

// out[c] = sum over the taps t of weight[t * weight_stride + c] * the value of taps[t]'s point b in channel
// `channel` + c (corner_value, times mask[t * mask_stride] where there is a mask), c < len, summed tap after tap
// from 0. A block of channels keeps its sums in registers through the taps, up to six vectors of them beside a tap's
// corner weights, mask and weights (sixteen AVX2 registers hold them): every block goes through the taps once, so
// blocks as wide as the channels allow (96 channels of AVX2 vectors in two blocks of six, not three of four; 64 in
// two of four: a block of six and single vectors ran no faster on H6). Each loop is compiled with a mask and without
// one, so that no vector waits on the mask's test. (S4, H6, H7's forwards 5-17% faster so by minimum, 5-11% by
// median, on the 2-core Zen 3 EPYC.)
template <typename scalar_t>
inline void sum_of_taps(const PointBlock<scalar_t>* taps, int64_t tap_count, int64_t b, int64_t channel,
                        const scalar_t* mask, int64_t mask_stride, const scalar_t* weight, int64_t weight_stride,
                        int64_t len, scalar_t* __restrict__ out) {
  const auto with_mask = [&](const auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    // Channels [c, c + vectors * the lanes of V): V a vector of floats or a scalar.
    const auto sum_block = [&](const auto vectors, const auto& tag, int64_t c) {
      constexpr int kVectors = decltype(vectors)::value;
      using V = std::decay_t<decltype(tag)>;
      constexpr int64_t kLanes = sizeof(V) / sizeof(scalar_t);
      V sum[kVectors];
      for (int k = 0; k < kVectors; ++k) sum[k] = V{};
      for (int64_t tap = 0; tap < tap_count; ++tap) {
        const Corners<scalar_t> corner = taps[tap].template corners<scalar_t>(b);
        const scalar_t m = kMasked ? mask[tap * mask_stride] : scalar_t(1);
        const scalar_t* w = weight + tap * weight_stride + c;
#pragma GCC unroll 8
        for (int k = 0; k < kVectors; ++k) {
          V v0, v1, v2, v3, wk;
          std::memcpy(&v0, corner.pixel[0] + channel + c + k * kLanes, sizeof(V));
          std::memcpy(&v1, corner.pixel[1] + channel + c + k * kLanes, sizeof(V));
          std::memcpy(&v2, corner.pixel[2] + channel + c + k * kLanes, sizeof(V));
          std::memcpy(&v3, corner.pixel[3] + channel + c + k * kLanes, sizeof(V));
          std::memcpy(&wk, w + k * kLanes, sizeof(V));
          sum[k] = sum[k] + wk * corner_value(corner, v0, v1, v2, v3, kMasked, m);
        }
      }
      for (int k = 0; k < kVectors; ++k) std::memcpy(out + c + k * kLanes, &sum[k], sizeof(V));
    };
#if defined(__GNUC__)
    if constexpr (std::is_same_v<scalar_t, float>) {
      constexpr int64_t kSix = 6 * kBlockLanes, kFour = 4 * kBlockLanes, kTwo = 2 * kBlockLanes;
      int64_t c = 0;
      for (; c + kSix <= len && len - c != 2 * kFour; c += kSix) {
        sum_block(std::integral_constant<int, 6>{}, BlockLanes{}, c);
      }
      for (; c + kFour <= len; c += kFour) sum_block(std::integral_constant<int, 4>{}, BlockLanes{}, c);
      for (; c + kTwo <= len; c += kTwo) sum_block(std::integral_constant<int, 2>{}, BlockLanes{}, c);
      for_float_blocks(len - c, [&, c](const auto& tag, int64_t block) {
        sum_block(std::integral_constant<int, 1>{}, tag, c + block);
      });
      return;
    }
#endif
    for (int64_t c = 0; c < len; ++c) sum_block(std::integral_constant<int, 1>{}, scalar_t{}, c);
  };
  if (mask != nullptr) {
    with_mask(std::true_type{});
  } else {
    with_mask(std::false_type{});
  }
}

// rows [len, C] (+ add[c]) into the channels-first image `out` [C, pixels], from its pixel 0: layout.h's
// rows_to_channels_first in float32 (rounded once to a half-type out_t), value by value in float64.
template <typename scalar_t, typename out_t>
void write_channels_first(const scalar_t* rows, int64_t len, int64_t channels, const scalar_t* add, out_t* out,
                          int64_t pixels) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    rows_to_channels_first(rows, len, channels, add, out, pixels);
  } else {
    for (int64_t c = 0; c < channels; ++c) {
      for (int64_t i = 0; i < len; ++i) {
        const scalar_t value = rows[i * channels + c];
        out[c * pixels + i] = static_cast<out_t>(add != nullptr ? value + add[c] : value);
      }
    }
  }
}

// The depthwise forward sums its rows channels-last in a buffer of this many rows, which stays in the cache, and turns
// them over into the output from there: turned in a pass of their own, the rows went to memory and back (S4's
// forward, 8 images of 128 channels, 28x28, ran 5-6% slower so on a 2-core Zen 3 EPYC); turned 16 rows at a time,
// each channel's row of a float32 output was written 64 bytes at a time, not 256 (S4, H6 and H7's forwards ran 0-6%
// slower by minimum and 2-10% by median so, on 1 and 2 threads, same machine).
constexpr int64_t kRowsPerWrite = 4 * kPointBlock;

// out[n, c, pixel] = sum over taps of weight[tap, c] * mask * bilinear(input[n, ..., c]) (+ bias[c]) for rows
// (n, pixel) in [begin, end), in runs of kRowsPerWrite rows of one image, each in blocks of kPointBlock points.
template <typename scalar_t, typename out_t>
void forward_rows_body(const ConvParams& p, const InputImages<scalar_t>& images, const SamplingInputs<scalar_t>& in,
                       const scalar_t* weight_tc, const scalar_t* bias, int64_t begin, int64_t end, out_t* out) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels, per_group = p.channels_per_offset_group();
  const scalar_t* zeros = zero_row<scalar_t>(channels);
  std::vector<scalar_t> rows(kRowsPerWrite * channels);
  TaskImages<scalar_t> task_images(images, ScratchSlot::turned_image);
  TapPoints<scalar_t> walk(p, in);
  for (int64_t row = begin; row < end;) {
    const int64_t n = row / pixels, run_first = row % pixels;
    const int64_t run = std::min({kRowsPerWrite, end - row, pixels - run_first});  // rows [row, row + run)
    const scalar_t* image = task_images.image(n);
    for (int64_t first = run_first; first < run_first + run; first += kPointBlock) {
      const int64_t len = std::min(kPointBlock, run_first + run - first);
      walk.start_block(first, len);
      for (int64_t group = 0; group < p.offset_groups; ++group) {
        walk.compute_group(n, group, first, len, corner_source(image, channels, zeros));
        const int64_t c0 = group * per_group;
        for (int64_t b = 0; b < len; ++b) {
          const scalar_t* mask = in.mask != nullptr ? in.mask + p.mask_index(n, group, 0, first + b) : nullptr;
          sum_of_taps(walk.taps, p.taps(), b, c0, mask, pixels, weight_tc + c0, channels, per_group,
                      rows.data() + (first - run_first + b) * channels + c0);
        }
      }
    }
    write_channels_first(rows.data(), run, channels, bias, out + n * channels * pixels + run_first, pixels);
    row += run;
  }
}
DC_CPU_KERNEL(forward_rows)

// For point b of a tap (its corners k), its offset group's channels [0, len) from `channel`, in one pass over them:
// partial[c] += g[c] * (value_c * m), the weight's gradient (the column's value m * value_c, times grad_out g), and
// dot[q] = the sum over c of (w[c] * g[c]) * pixel_q[channel + c], in cpu_lanes.h's lane order, for the
// coordinates' and the mask's gradients. The same operations, so the same bits, as interpolate_corners, the loop
// over the channels and corner_dots one after the other, which take the layers whose offset groups' channels do not
// come in runs of 16, and float64 (false returned, nothing done). One pass reads the corners and grad_out once
// (S4's forward and backward 3-5% faster so on a 2-core Zen 3 EPYC).
template <typename scalar_t>
inline bool point_grads_in_one_pass(const Corners<scalar_t>& k, int64_t channel, int64_t len,
                                    const scalar_t* __restrict__ g, const scalar_t* __restrict__ w, scalar_t m,
                                    scalar_t* __restrict__ partial, scalar_t dot[4]) {
#if defined(__GNUC__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (len % kSumLanes != 0) return false;
    constexpr int kBlocks = kSumLanes / kBlockLanes;
    BlockLanes sums[4][kBlocks] = {};
    for (int64_t d0 = 0; d0 < len; d0 += kSumLanes) {
#pragma GCC unroll 4
      for (int j = 0; j < kBlocks; ++j) {
        const int64_t c = d0 + j * kBlockLanes;
        BlockLanes v0, v1, v2, v3, g_j, w_j, partial_j;  // (an array of corners, GCC kept in memory)
        std::memcpy(&v0, k.pixel[0] + channel + c, sizeof(BlockLanes));
        std::memcpy(&v1, k.pixel[1] + channel + c, sizeof(BlockLanes));
        std::memcpy(&v2, k.pixel[2] + channel + c, sizeof(BlockLanes));
        std::memcpy(&v3, k.pixel[3] + channel + c, sizeof(BlockLanes));
        std::memcpy(&g_j, g + c, sizeof(BlockLanes));
        std::memcpy(&w_j, w + c, sizeof(BlockLanes));
        std::memcpy(&partial_j, partial + c, sizeof(BlockLanes));
        const BlockLanes value = corner_value(k, v0, v1, v2, v3, false, 1.0f);
        partial_j = partial_j + g_j * (value * m);
        std::memcpy(partial + c, &partial_j, sizeof(BlockLanes));
        const BlockLanes grad_column = w_j * g_j;
        sums[0][j] += grad_column * v0;
        sums[1][j] += grad_column * v1;
        sums[2][j] += grad_column * v2;
        sums[3][j] += grad_column * v3;
      }
    }
    for (int q = 0; q < 4; ++q) dot[q] = total_of_blocks(sums[q]);
    return true;
  }
#endif
  return false;
}

// grad_offset, grad_mask and the blocks' partial weight gradients [blocks, taps, C] from grad_out [B*P, C].
template <typename scalar_t>
void coordinate_and_weight_grads_body(const ConvParams& p, const InputImages<scalar_t>& images,
                                      const SamplingInputs<scalar_t>& in, const scalar_t* weight_tc,
                                      const scalar_t* grad_out, int64_t rows_per_block, int64_t block_begin,
                                      int64_t block_end, scalar_t* grad_offset, scalar_t* grad_mask,
                                      scalar_t* weight_partials) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels, per_group = p.channels_per_offset_group();
  const int64_t rows = p.batch * pixels;
  const bool masked = in.mask != nullptr;
  const scalar_t* zeros = zero_row<scalar_t>(channels);
  std::vector<scalar_t> sampled(per_group), grad_column(per_group);
  BlockDots<scalar_t> dots(p.taps());
  TaskImages<scalar_t> task_images(images, ScratchSlot::turned_image);
  TapPoints<scalar_t> walk(p, in);
  for (int64_t block = block_begin; block < block_end; ++block) {
    scalar_t* partial = weight_partials + block * p.taps() * channels;
    std::fill(partial, partial + p.taps() * channels, scalar_t(0));
    const int64_t rows_end = std::min(rows, (block + 1) * rows_per_block);
    for (int64_t row = block * rows_per_block; row < rows_end;) {
      const int64_t n = row / pixels, first = row % pixels;
      const int64_t len = std::min({kPointBlock, rows_end - row, pixels - first});
      const scalar_t* image = task_images.image(n);
      walk.start_block(first, len);
      for (int64_t group = 0; group < p.offset_groups; ++group) {
        walk.compute_group(n, group, first, len, corner_source(image, channels, zeros));
        const int64_t c0 = group * per_group;
        for (int64_t b = 0; b < len; ++b) {
          const scalar_t* __restrict__ g_out = grad_out + (row + b) * channels + c0;
          for (int64_t tap = 0; tap < p.taps(); ++tap) {
            const PointBlock<scalar_t>& points = walk.taps[tap];
            const Corners<scalar_t> corners = points.template corners<scalar_t>(b);
            const int64_t mask_at = p.mask_index(n, group, tap, first + b);
            const scalar_t m = masked ? in.mask[mask_at] : scalar_t(1);
            const scalar_t* __restrict__ w = weight_tc + tap * channels + c0;
            // The column's value is m * sampled; its gradient is weight * grad_out.
            scalar_t* __restrict__ partial_tap = partial + tap * channels + c0;
            scalar_t dot[4] = {};
            if (!point_grads_in_one_pass(corners, c0, per_group, g_out, w, m, partial_tap, dot)) {
              interpolate_corners(corners, c0, per_group, false, scalar_t(1), sampled.data());
              scalar_t* __restrict__ gc = grad_column.data();
              const scalar_t* __restrict__ v = sampled.data();
#pragma omp simd
              for (int64_t c = 0; c < per_group; ++c) {
                gc[c] = w[c] * g_out[c];
                partial_tap[c] += g_out[c] * (v[c] * m);
              }
              if (points.inside[b]) corner_dots(corners, c0, per_group, static_cast<const scalar_t*>(gc), dot);
            }
            dots.set(tap, b, dot);
          }
        }
        walk.write_coordinate_grads(n, group, first, len, dots, grad_offset, grad_mask);
      }
      row += len;
    }
  }
}
DC_CPU_KERNEL(coordinate_and_weight_grads)

// grad_input [B, C, H, W] (out_t: float32 rounded once to a half type) = d loss / d input. Each task owns one image
// and one block of its channels: it sums their gradient channels-last in a buffer of its own and turns it into
// grad_input at its end. (A whole channels-last gradient, zeroed first and turned afterwards, was as fast on S4 and
// held another tensor of the input's size in float32.)
template <typename scalar_t, typename out_t>
void input_grad_body(const ConvParams& p, const SamplingInputs<scalar_t>& in, const scalar_t* weight_tc,
                     const scalar_t* grad_out, int64_t blocks, int64_t begin, int64_t end, out_t* grad_input) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels, per_group = p.channels_per_offset_group();
  const int64_t image_pixels = p.height * p.width;
  const bool masked = in.mask != nullptr;
  std::vector<scalar_t> grad_column(channels), image_grad;
  TapPoints<scalar_t> walk(p, in);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t n = task / blocks, block = task % blocks;
    const int64_t block_begin = block * channels / blocks, block_end = (block + 1) * channels / blocks;
    const int64_t width = block_end - block_begin;  // image_grad holds channels [block_begin, block_end)
    image_grad.assign(image_pixels * width, scalar_t(0));
    for (int64_t first = 0; first < pixels; first += kPointBlock) {
      const int64_t len = std::min(kPointBlock, pixels - first);
      walk.start_block(first, len);
      for (int64_t group = 0; group < p.offset_groups; ++group) {
        const int64_t c_begin = std::max(block_begin, group * per_group);
        const int64_t c_end = std::min(block_end, (group + 1) * per_group);
        if (c_begin >= c_end) continue;
        walk.compute_group(n, group, first, len, corner_source<scalar_t>(image_grad.data(), width, nullptr));
        const int64_t at = c_begin - block_begin;  // channel c_begin in image_grad's pixels
        for (int64_t b = 0; b < len; ++b) {
          const scalar_t* __restrict__ g_out = grad_out + (n * pixels + first + b) * channels;
          for (int64_t tap = 0; tap < p.taps(); ++tap) {
            const PointBlock<scalar_t>& points = walk.taps[tap];
            const scalar_t m = masked ? in.mask[p.mask_index(n, group, tap, first + b)] : scalar_t(1);
            const scalar_t* __restrict__ w = weight_tc + tap * channels;
            scalar_t* dst[4];
            scalar_t k[4];
            if (points.all_corners(b, at, m, dst, k)) {
              add_to_four_corners(dst, k, c_end - c_begin, [&](const auto& tag, int64_t c) {
                using V = std::decay_t<decltype(tag)>;
                V w_c, g_c;
                std::memcpy(&w_c, w + c_begin + c, sizeof(V));
                std::memcpy(&g_c, g_out + c_begin + c, sizeof(V));
                return V(w_c * g_c);  // weight * grad_out, taken once for the four corners
              });
              continue;
            }
            scalar_t* __restrict__ gc = grad_column.data();
#pragma omp simd
            for (int64_t c = c_begin; c < c_end; ++c) gc[c] = w[c] * g_out[c];
            for (int q = 0; q < 4; ++q) {
              if (!points.valid[q][b]) continue;
              scalar_t* dst = reinterpret_cast<scalar_t*>(points.address[q][b]) + at;
              add_scaled(m * points.weight[q][b], gc + c_begin, c_end - c_begin, dst);
            }
          }
        }
      }
    }
    write_channels_first(image_grad.data(), image_pixels, width, static_cast<const scalar_t*>(nullptr),
                         grad_input + (n * channels + block_begin) * image_pixels, image_pixels);
  }
}
DC_CPU_KERNEL(input_grad)

// The offsets and the mask; the passes read the input through InputImages.
template <typename scalar_t>
SamplingInputs<scalar_t> pointers(const at::Tensor& offset, const at::Tensor& mask) {
  return {nullptr, offset.const_data_ptr<scalar_t>(), mask.defined() ? mask.const_data_ptr<scalar_t>() : nullptr};
}

// The input channels-last in the compute type, turned whole now; undefined where the passes' threads turn it image
// by image instead (thread_images.h; float32 passes only).
at::Tensor input_turned_up_front(const at::Tensor& input, at::ScalarType compute) {
  if (compute == at::kFloat && turns_per_thread(input, sizeof(float))) return at::Tensor();
  return in_channels_last(input, compute);
}

template <typename scalar_t>
InputImages<scalar_t> input_images(const at::Tensor& input, const at::Tensor& input_cl) {
  return input_cl.defined() ? InputImages<scalar_t>::turned_up_front(input_cl)
                            : InputImages<scalar_t>::turned_per_thread(input);
}

// The type the passes compute in: float32 for the half types, whose tensors are widened as they are turned
// (channels_last, layout.h) or, the small ones (offsets, mask, weight, bias), copied widened.
at::ScalarType compute_type(const at::Tensor& input) { return at::toOpMathType(input.scalar_type()); }

at::Tensor contiguous_in(const at::Tensor& t, at::ScalarType dtype) {
  return dtype == at::kFloat ? float32_contiguous(t) : t.to(dtype).contiguous();
}

// weight [C, 1, kh, kw] -> [taps, C]: a tap's weights for all channels are contiguous.
at::Tensor weight_by_tap(const ConvParams& p, const at::Tensor& weight, at::ScalarType dtype) {
  return weight.reshape({p.in_channels, p.taps()}).t().to(dtype).contiguous();
}

// f(out_t()) for the output's dtype: the compute type's own, or a half type computed in float32.
template <typename scalar_t, typename F>
void with_output_type(at::ScalarType dtype, const F& f) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (dtype == at::kBFloat16) return f(c10::BFloat16());
    if (dtype == at::kHalf) return f(c10::Half());
  }
  f(scalar_t());
}

}  // namespace

at::Tensor depthwise_forward(const ConvParams& p, const at::Tensor& input, const at::Tensor& offset,
                             const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                             const std::optional<at::Tensor>& bias) {
  at::Tensor output = input.new_empty({p.batch, p.out_channels, p.out_h, p.out_w});
  if (output.numel() == 0) return output;
  const at::ScalarType compute = compute_type(input);
  const at::Tensor input_cl = input_turned_up_front(input, compute);
  const at::Tensor offset_c = contiguous_in(offset, compute);
  const at::Tensor mask_c = mask.has_value() ? contiguous_in(*mask, compute) : at::Tensor();
  const at::Tensor weight_tc = weight_by_tap(p, weight, compute);
  const at::Tensor bias_c = bias.has_value() ? bias->to(compute).contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(compute, "deform_conv2d_depthwise_cpu", [&] {
    const InputImages<scalar_t> images = input_images<scalar_t>(input, input_cl);
    const SamplingInputs<scalar_t> in = pointers<scalar_t>(offset_c, mask_c);
    with_output_type<scalar_t>(output.scalar_type(), [&](auto out_type) {
      using out_t = decltype(out_type);
      at::parallel_for(0, p.batch * p.out_pixels(), kRowsPerTask, [&](int64_t begin, int64_t end) {
        forward_rows<scalar_t>(p, images, in, weight_tc.const_data_ptr<scalar_t>(),
                               bias_c.defined() ? bias_c.const_data_ptr<scalar_t>() : nullptr, begin, end,
                               output.mutable_data_ptr<out_t>());
      });
    });
  });
  return output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>
depthwise_backward(const ConvParams& p, const at::Tensor& grad_output, const at::Tensor& input,
                   const at::Tensor& offset, const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                   bool bias_defined) {
  const at::ScalarType compute = compute_type(input);
  const at::TensorOptions options = input.options().dtype(compute);
  // Every value of these three is written where there are rows (output pixels: conv_params checks that an image
  // has one), and they are empty where there are none (a batch of no images).
  at::Tensor grad_input = input.new_empty({p.batch, p.in_channels, p.height, p.width});
  at::Tensor grad_offset = offset.new_empty(offset.sizes(), options);
  at::Tensor grad_mask = mask.has_value() ? mask->new_empty(mask->sizes(), options) : at::Tensor();
  at::Tensor grad_weight_tc = weight.new_zeros({p.taps(), p.in_channels}, options);

  const at::Tensor grad_out_cl = in_channels_last(grad_output, compute);  // [B, H_out, W_out, C] in memory
  std::optional<at::Tensor> grad_bias;
  if (bias_defined) grad_bias = grad_out_cl.sum({0, 2, 3}).to(input.scalar_type());
  const int64_t rows = p.batch * p.out_pixels();
  if (rows > 0) {
    const at::Tensor input_cl = input_turned_up_front(input, compute);
    const at::Tensor offset_c = contiguous_in(offset, compute);
    const at::Tensor mask_c = mask.has_value() ? contiguous_in(*mask, compute) : at::Tensor();
    const at::Tensor weight_tc = weight_by_tap(p, weight, compute);
    const int64_t weight_blocks = std::min(kMaxWeightBlocks, rows);
    const int64_t rows_per_block = (rows + weight_blocks - 1) / weight_blocks;
    at::Tensor weight_partials =
        weight.new_empty({(rows + rows_per_block - 1) / rows_per_block, p.taps(), p.in_channels}, options);
    AT_DISPATCH_FLOATING_TYPES(compute, "deform_conv2d_depthwise_backward_cpu", [&] {
      const InputImages<scalar_t> images = input_images<scalar_t>(input, input_cl);
      const SamplingInputs<scalar_t> in = pointers<scalar_t>(offset_c, mask_c);
      at::parallel_for(0, weight_partials.size(0), 1, [&](int64_t begin, int64_t end) {
        coordinate_and_weight_grads<scalar_t>(p, images, in, weight_tc.const_data_ptr<scalar_t>(),
                                              grad_out_cl.const_data_ptr<scalar_t>(), rows_per_block, begin, end,
                                              grad_offset.mutable_data_ptr<scalar_t>(),
                                              grad_mask.defined() ? grad_mask.mutable_data_ptr<scalar_t>() : nullptr,
                                              weight_partials.mutable_data_ptr<scalar_t>());
      });
      // Tasks are (image, block of channels) pairs: each owns the part of grad_input it writes.
      const int64_t channel_blocks = std::max<int64_t>(
          1, std::min<int64_t>((2 * at::get_num_threads() + p.batch - 1) / p.batch, p.in_channels / 16));
      with_output_type<scalar_t>(grad_input.scalar_type(), [&](auto out_type) {
        using out_t = decltype(out_type);
        at::parallel_for(0, p.batch * channel_blocks, 1, [&](int64_t begin, int64_t end) {
          input_grad<scalar_t>(p, in, weight_tc.const_data_ptr<scalar_t>(), grad_out_cl.const_data_ptr<scalar_t>(),
                               channel_blocks, begin, end, grad_input.mutable_data_ptr<out_t>());
        });
      });
      // Block by block, in order: the same sum whatever the number of threads.
      const scalar_t* partials = weight_partials.const_data_ptr<scalar_t>();
      scalar_t* sum = grad_weight_tc.mutable_data_ptr<scalar_t>();
      const int64_t size = p.taps() * p.in_channels;
      for (int64_t b = 0; b < weight_partials.size(0); ++b) {
        for (int64_t i = 0; i < size; ++i) sum[i] += partials[b * size + i];
      }
    });
  }
  const at::ScalarType dtype = input.scalar_type();
  std::optional<at::Tensor> grad_mask_result;
  if (grad_mask.defined()) grad_mask_result = grad_mask.to(dtype);
  return {grad_input, grad_offset.to(dtype),
          grad_weight_tc.t().reshape({p.out_channels, 1, p.kernel_h, p.kernel_w}).to(dtype).contiguous(),
          grad_mask_result, grad_bias};
}

}  // namespace cpu
}  // namespace deform_conv
