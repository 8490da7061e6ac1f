#include "sampling_passes.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "sampling_point.h"

namespace deform_conv {
namespace cpu {
namespace {

// Address of columns[n_local, g, pixel, tap, c - g * in_channels_per_group].
inline int64_t column_index(const ConvParams& p, int64_t n_local, int64_t g, int64_t pixel, int64_t tap, int64_t c) {
  const int64_t per_group = p.in_channels_per_group();
  return (((n_local * p.groups + g) * p.out_pixels() + pixel) * p.taps() + tap) * per_group + (c - g * per_group);
}

}  // namespace

template <typename scalar_t>
void fill_columns(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image, int64_t images,
                  scalar_t* columns) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels;
  const int64_t per_offset_group = p.channels_per_offset_group();
  at::parallel_for(0, images * pixels, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n_local = row / pixels, pixel = row % pixels, n = first_image + n_local;
      const scalar_t* image = in.input + n * p.height * p.width * channels;
      for (int64_t group = 0; group < p.offset_groups; ++group) {
        for (int64_t tap = 0; tap < p.taps(); ++tap) {
          const BilinearSample<scalar_t> s = sample_point(p, in, n, pixel, group, tap);
          const bool masked = in.mask != nullptr;
          const scalar_t m = masked ? in.mask[mask_index(p, n, pixel, group, tap)] : scalar_t(1);
          const int64_t c_begin = group * per_offset_group;
          for_each_weight_group_piece(p, c_begin, c_begin + per_offset_group, [&](int64_t g, int64_t c0, int64_t c1) {
            interpolate(s, image + c0, channels, c1 - c0, masked, m,
                        columns + column_index(p, n_local, g, pixel, tap, c0));
          });
        }
      }
    }
  });
}

template <typename scalar_t>
void coordinate_and_mask_grads(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image,
                               int64_t images, const scalar_t* grad_columns, scalar_t* grad_offset,
                               scalar_t* grad_mask) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels;
  const int64_t per_offset_group = p.channels_per_offset_group();
  at::parallel_for(0, images * pixels, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n_local = row / pixels, pixel = row % pixels, n = first_image + n_local;
      const scalar_t* image = in.input + n * p.height * p.width * channels;
      for (int64_t group = 0; group < p.offset_groups; ++group) {
        for (int64_t tap = 0; tap < p.taps(); ++tap) {
          const BilinearSample<scalar_t> s = sample_point(p, in, n, pixel, group, tap);
          // d loss / d value, d loss / d y and d loss / d x, before the mask's factor.
          scalar_t grad_value = 0, grad_y = 0, grad_x = 0;
          const int64_t c_begin = group * per_offset_group;
          for_each_weight_group_piece(p, c_begin, c_begin + per_offset_group, [&](int64_t g, int64_t c0, int64_t c1) {
            if (s.count == 0) return;
            scalar_t dot[4];
            neighbour_dots(s, image + c0, channels, c1 - c0,
                           grad_columns + column_index(p, n_local, g, pixel, tap, c0), dot);
            for (int q = 0; q < s.count; ++q) {
              grad_value += s.weight[q] * dot[q];
              grad_y += s.weight_dy[q] * dot[q];
              grad_x += s.weight_dx[q] * dot[q];
            }
          });
          const int64_t offset_channel = 2 * (group * p.taps() + tap);
          scalar_t* g_dy = grad_offset + (n * 2 * p.offset_groups * p.taps() + offset_channel) * pixels + pixel;
          if (in.mask != nullptr) {
            const int64_t m_index = mask_index(p, n, pixel, group, tap);
            const scalar_t m = in.mask[m_index];
            g_dy[0] = m * grad_y;
            g_dy[pixels] = m * grad_x;
            grad_mask[m_index] = grad_value;
          } else {
            g_dy[0] = grad_y;
            g_dy[pixels] = grad_x;
          }
        }
      }
    }
  });
}

template <typename scalar_t>
void accumulate_input_grad(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image,
                           int64_t images, const scalar_t* grad_columns, scalar_t* grad_input) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels;
  const int64_t per_offset_group = p.channels_per_offset_group();
  // Enough channel blocks that every thread has a task even for one image. The result does not depend on
  // the blocking: each element of grad_input lies in exactly one block and sums its terms in the same order.
  const int64_t blocks =
      std::max<int64_t>(1, std::min<int64_t>((2 * at::get_num_threads() + images - 1) / images, channels / 8));
  at::parallel_for(0, images * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n_local = task / blocks, block = task % blocks, n = first_image + n_local;
      const int64_t block_begin = block * channels / blocks, block_end = (block + 1) * channels / blocks;
      scalar_t* image_grad = grad_input + n * p.height * p.width * channels;
      for (int64_t pixel = 0; pixel < pixels; ++pixel) {
        for (int64_t group = 0; group < p.offset_groups; ++group) {
          const int64_t c_begin = std::max(block_begin, group * per_offset_group);
          const int64_t c_end = std::min(block_end, (group + 1) * per_offset_group);
          if (c_begin >= c_end) continue;
          for (int64_t tap = 0; tap < p.taps(); ++tap) {
            const BilinearSample<scalar_t> s = sample_point(p, in, n, pixel, group, tap);
            if (s.count == 0) continue;
            const scalar_t m = in.mask != nullptr ? in.mask[mask_index(p, n, pixel, group, tap)] : scalar_t(1);
            for_each_weight_group_piece(p, c_begin, c_end, [&](int64_t g, int64_t c0, int64_t c1) {
              const scalar_t* grad = grad_columns + column_index(p, n_local, g, pixel, tap, c0);
              for (int q = 0; q < s.count; ++q) {
                scalar_t* __restrict__ dst = image_grad + s.pixel[q] * channels + c0;
                const scalar_t w = m * s.weight[q];
                for (int64_t c = 0; c < c1 - c0; ++c) dst[c] += w * grad[c];
              }
            });
          }
        }
      }
    }
  });
}

#define DEFORM_CONV_INSTANTIATE(T)                                                                              \
  template void fill_columns<T>(const ConvParams&, const SamplingInputs<T>&, int64_t, int64_t, T*);            \
  template void coordinate_and_mask_grads<T>(const ConvParams&, const SamplingInputs<T>&, int64_t, int64_t,    \
                                             const T*, T*, T*);                                                \
  template void accumulate_input_grad<T>(const ConvParams&, const SamplingInputs<T>&, int64_t, int64_t,        \
                                         const T*, T*);
DEFORM_CONV_INSTANTIATE(float)
DEFORM_CONV_INSTANTIATE(double)
#undef DEFORM_CONV_INSTANTIATE

}  // namespace cpu
}  // namespace deform_conv
