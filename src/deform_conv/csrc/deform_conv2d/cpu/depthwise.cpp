#include "depthwise.h"

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "layout.h"
#include "sampling_point.h"

namespace deform_conv {
namespace cpu {
namespace {

// The weight's gradient sums over every (image, output pixel) row. Rows are cut into at most this many
// blocks of consecutive rows, each summed on its own and then added in block order: the result does not
// depend on the number of threads.
constexpr int64_t kMaxWeightBlocks = 256;

// out[row, c] = sum over taps of weight[tap, c] * mask * bilinear(input[..., c]), out channels-last [B*P, C].
template <typename scalar_t>
void forward_rows_body(const ConvParams& p, const SamplingInputs<scalar_t>& in, const scalar_t* weight_tc,
                                  int64_t begin, int64_t end, scalar_t* out) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels, per_group = p.channels_per_offset_group();
  std::vector<scalar_t> sampled(per_group);
  for (int64_t row = begin; row < end; ++row) {
    const int64_t n = row / pixels, pixel = row % pixels;
    const RowPoints<scalar_t> points(p, in, n, pixel);
    const scalar_t* image = in.input + n * p.height * p.width * channels;
    scalar_t* __restrict__ acc = out + row * channels;
    std::fill(acc, acc + channels, scalar_t(0));
    for (int64_t group = 0; group < p.offset_groups; ++group) {
      const int64_t c0 = group * per_group;
      for (int64_t i = 0, tap = 0; i < p.kernel_h; ++i) {
        for (int64_t j = 0; j < p.kernel_w; ++j, ++tap) {
          interpolate(points.sample(group, i, j), image + c0, channels, per_group, in.mask != nullptr,
                      points.mask(group, tap), sampled.data());
          const scalar_t* __restrict__ w = weight_tc + tap * channels + c0;
          const scalar_t* __restrict__ v = sampled.data();
          for (int64_t c = 0; c < per_group; ++c) acc[c0 + c] += w[c] * v[c];
        }
      }
    }
  }
}
DC_CPU_KERNEL(forward_rows)

// grad_offset, grad_mask and the blocks' partial weight gradients [blocks, taps, C] from grad_out [B*P, C].
template <typename scalar_t>
void coordinate_and_weight_grads_body(const ConvParams& p, const SamplingInputs<scalar_t>& in,
                                                 const scalar_t* weight_tc, const scalar_t* grad_out,
                                                 int64_t rows_per_block, int64_t block_begin, int64_t block_end,
                                                 scalar_t* grad_offset, scalar_t* grad_mask,
                                                 scalar_t* weight_partials) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels, per_group = p.channels_per_offset_group();
  const int64_t rows = p.batch * pixels;
  std::vector<scalar_t> sampled(per_group), grad_column(per_group);
  for (int64_t block = block_begin; block < block_end; ++block) {
    scalar_t* partial = weight_partials + block * p.taps() * channels;
    std::fill(partial, partial + p.taps() * channels, scalar_t(0));
    for (int64_t row = block * rows_per_block; row < std::min(rows, (block + 1) * rows_per_block); ++row) {
      const int64_t n = row / pixels, pixel = row % pixels;
      const RowPoints<scalar_t> points(p, in, n, pixel);
      const scalar_t* image = in.input + n * p.height * p.width * channels;
      for (int64_t group = 0; group < p.offset_groups; ++group) {
        const int64_t c0 = group * per_group;
        const scalar_t* __restrict__ g_out = grad_out + row * channels + c0;
        for (int64_t tap = 0; tap < p.taps(); ++tap) {
          const BilinearSample<scalar_t> s = points.sample(group, tap / p.kernel_w, tap % p.kernel_w);
          const scalar_t m = points.mask(group, tap);
          const scalar_t* __restrict__ w = weight_tc + tap * channels + c0;
          // The column's value is m * sampled; its gradient is weight * grad_out.
          interpolate(s, image + c0, channels, per_group, false, scalar_t(1), sampled.data());
          scalar_t* __restrict__ partial_tap = partial + tap * channels + c0;
          scalar_t* __restrict__ gc = grad_column.data();
          const scalar_t* __restrict__ v = sampled.data();
#pragma omp simd
          for (int64_t c = 0; c < per_group; ++c) {
            gc[c] = w[c] * g_out[c];
            partial_tap[c] += g_out[c] * (v[c] * m);
          }
          const scalar_t* sampled_row = v;
          scalar_t grad_value;
          lane_dots<1>(static_cast<const scalar_t*>(gc), &sampled_row, per_group, &grad_value);
          scalar_t dot[4] = {0, 0, 0, 0}, grad_y = sum_start(s), grad_x = sum_start(s);
          if (s.count > 0) neighbour_dots(s, image + c0, channels, per_group, gc, dot);
          for (int q = 0; q < s.count; ++q) {
            grad_y += s.weight_dy[q] * dot[q];
            grad_x += s.weight_dx[q] * dot[q];
          }
          const int64_t at = points.offset_index(group, tap);
          grad_offset[at] = coordinate_grad(s, m, grad_y, p.border_gradient);
          grad_offset[at + pixels] = coordinate_grad(s, m, grad_x, p.border_gradient);
          if (grad_mask != nullptr) grad_mask[points.mask_index(group, tap)] = grad_value;
        }
      }
    }
  }
}
DC_CPU_KERNEL(coordinate_and_weight_grads)

// Adds d loss / d input into grad_input (channels-last): each task owns one image and one block of channels.
template <typename scalar_t>
void input_grad_body(const ConvParams& p, const SamplingInputs<scalar_t>& in, const scalar_t* weight_tc,
                                const scalar_t* grad_out, int64_t blocks, int64_t begin, int64_t end,
                                scalar_t* grad_input) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels, per_group = p.channels_per_offset_group();
  for (int64_t task = begin; task < end; ++task) {
    const int64_t n = task / blocks, block = task % blocks;
    const int64_t block_begin = block * channels / blocks, block_end = (block + 1) * channels / blocks;
    scalar_t* image_grad = grad_input + n * p.height * p.width * channels;
    for (int64_t pixel = 0; pixel < pixels; ++pixel) {
      const RowPoints<scalar_t> points(p, in, n, pixel);
      const scalar_t* g_out = grad_out + (n * pixels + pixel) * channels;
      for (int64_t group = 0; group < p.offset_groups; ++group) {
        const int64_t c_begin = std::max(block_begin, group * per_group);
        const int64_t c_end = std::min(block_end, (group + 1) * per_group);
        if (c_begin >= c_end) continue;
        for (int64_t tap = 0; tap < p.taps(); ++tap) {
          const BilinearSample<scalar_t> s = points.sample(group, tap / p.kernel_w, tap % p.kernel_w);
          const scalar_t m = points.mask(group, tap);
          const scalar_t* __restrict__ w = weight_tc + tap * channels;
          for (int q = 0; q < s.count; ++q) {
            scalar_t* __restrict__ dst = image_grad + s.pixel[q] * channels;
            const scalar_t k = m * s.weight[q];
            for (int64_t c = c_begin; c < c_end; ++c) dst[c] += k * (w[c] * g_out[c]);
          }
        }
      }
    }
  }
}
DC_CPU_KERNEL(input_grad)

template <typename scalar_t>
SamplingInputs<scalar_t> pointers(const at::Tensor& input_cl, const at::Tensor& offset, const at::Tensor& mask) {
  return {input_cl.const_data_ptr<scalar_t>(), offset.const_data_ptr<scalar_t>(),
          mask.defined() ? mask.const_data_ptr<scalar_t>() : nullptr};
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

// out [B, C, H, W] (contiguous, in its dtype) = rows [B, H, W, C] (contiguous) + bias[c] where given.
void rows_to_channels_first(const at::Tensor& rows, const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const at::Tensor add = bias.has_value() ? bias->to(rows.scalar_type()).contiguous() : at::Tensor();
  if (rows.scalar_type() == at::kFloat &&
      channels_first(rows, out, add.defined() ? add.const_data_ptr<float>() : nullptr)) {
    return;
  }
  out.copy_(rows.permute({0, 3, 1, 2}));
  if (add.defined()) out.add_(add.view({1, -1, 1, 1}));
}

}  // namespace

at::Tensor depthwise_forward(const ConvParams& p, const at::Tensor& input, const at::Tensor& offset,
                             const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                             const std::optional<at::Tensor>& bias) {
  at::Tensor output = input.new_empty({p.batch, p.out_channels, p.out_h, p.out_w});
  if (output.numel() == 0) return output;
  const at::ScalarType compute = compute_type(input);
  // The pass's rows [B, H_out, W_out, C] (channels-last), turned into the output with the bias added.
  at::Tensor rows = input.new_empty({p.batch, p.out_h, p.out_w, p.out_channels}, input.options().dtype(compute));
  const at::Tensor input_cl = in_channels_last(input, compute);
  const at::Tensor offset_c = contiguous_in(offset, compute);
  const at::Tensor mask_c = mask.has_value() ? contiguous_in(*mask, compute) : at::Tensor();
  const at::Tensor weight_tc = weight_by_tap(p, weight, compute);
  AT_DISPATCH_FLOATING_TYPES(compute, "deform_conv2d_depthwise_cpu", [&] {
    const SamplingInputs<scalar_t> in = pointers<scalar_t>(input_cl, offset_c, mask_c);
    at::parallel_for(0, p.batch * p.out_pixels(), kRowsPerTask, [&](int64_t begin, int64_t end) {
      forward_rows<scalar_t>(p, in, weight_tc.const_data_ptr<scalar_t>(), begin, end,
                             rows.mutable_data_ptr<scalar_t>());
    });
  });
  rows_to_channels_first(rows, bias, output);
  return output;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>
depthwise_backward(const ConvParams& p, const at::Tensor& grad_output, const at::Tensor& input,
                   const at::Tensor& offset, const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                   bool bias_defined) {
  const at::ScalarType compute = compute_type(input);
  const at::TensorOptions options = input.options().dtype(compute);
  at::Tensor grad_input_cl = input.new_zeros({p.batch, p.height, p.width, p.in_channels}, options);  // channels-last
  at::Tensor grad_offset = offset.new_zeros(offset.sizes(), options);
  at::Tensor grad_mask = mask.has_value() ? mask->new_zeros(mask->sizes(), options) : at::Tensor();
  at::Tensor grad_weight_tc = weight.new_zeros({p.taps(), p.in_channels}, options);

  const at::Tensor grad_out_cl = in_channels_last(grad_output, compute);  // [B, H_out, W_out, C] in memory
  std::optional<at::Tensor> grad_bias;
  if (bias_defined) grad_bias = grad_out_cl.sum({0, 2, 3}).to(input.scalar_type());
  const int64_t rows = p.batch * p.out_pixels();
  if (rows > 0) {
    const at::Tensor input_cl = in_channels_last(input, compute);
    const at::Tensor offset_c = contiguous_in(offset, compute);
    const at::Tensor mask_c = mask.has_value() ? contiguous_in(*mask, compute) : at::Tensor();
    const at::Tensor weight_tc = weight_by_tap(p, weight, compute);
    const int64_t blocks = std::min(kMaxWeightBlocks, rows);
    const int64_t rows_per_block = (rows + blocks - 1) / blocks;
    at::Tensor weight_partials =
        weight.new_empty({(rows + rows_per_block - 1) / rows_per_block, p.taps(), p.in_channels}, options);
    AT_DISPATCH_FLOATING_TYPES(compute, "deform_conv2d_depthwise_backward_cpu", [&] {
      const SamplingInputs<scalar_t> in = pointers<scalar_t>(input_cl, offset_c, mask_c);
      at::parallel_for(0, weight_partials.size(0), 1, [&](int64_t begin, int64_t end) {
        coordinate_and_weight_grads<scalar_t>(p, in, weight_tc.const_data_ptr<scalar_t>(),
                                              grad_out_cl.const_data_ptr<scalar_t>(), rows_per_block, begin, end,
                                              grad_offset.mutable_data_ptr<scalar_t>(),
                                              grad_mask.defined() ? grad_mask.mutable_data_ptr<scalar_t>() : nullptr,
                                              weight_partials.mutable_data_ptr<scalar_t>());
      });
      // Tasks are (image, block of channels) pairs: each owns the part of grad_input it writes.
      const int64_t blocks = std::max<int64_t>(
          1, std::min<int64_t>((2 * at::get_num_threads() + p.batch - 1) / p.batch, p.in_channels / 16));
      at::parallel_for(0, p.batch * blocks, 1, [&](int64_t begin, int64_t end) {
        input_grad<scalar_t>(p, in, weight_tc.const_data_ptr<scalar_t>(), grad_out_cl.const_data_ptr<scalar_t>(),
                             blocks, begin, end, grad_input_cl.mutable_data_ptr<scalar_t>());
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
  at::Tensor grad_input = input.new_empty({p.batch, p.in_channels, p.height, p.width});
  rows_to_channels_first(grad_input_cl, std::nullopt, grad_input);
  std::optional<at::Tensor> grad_mask_result;
  if (grad_mask.defined()) grad_mask_result = grad_mask.to(dtype);
  return {grad_input, grad_offset.to(dtype),
          grad_weight_tc.t().reshape({p.out_channels, 1, p.kernel_h, p.kernel_w}).to(dtype).contiguous(),
          grad_mask_result, grad_bias};
}

}  // namespace cpu
}  // namespace deform_conv
