#include "sampling_passes.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <numeric>

#include "sampling_point.h"

namespace deform_conv {
namespace cpu {
namespace {

// Address of the columns' element for channel c (of weight group g).
inline int64_t column_index(const ConvParams& p, int64_t n_local, int64_t g, int64_t pixel, int64_t tap, int64_t c) {
  return p.column_index(n_local, pixel, g, tap, c - g * p.in_channels_per_group());
}

// Calls f(n_local, pixel, points, group, tap, sample, image) for every sampling point of the chunk's rows
// [row_begin, row_end), a row being one (image, output pixel); `image` is that image's channels-last input.
template <typename scalar_t, typename F>
inline void for_each_point_of_rows(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image,
                                   int64_t row_begin, int64_t row_end, F&& f) {
  const int64_t pixels = p.out_pixels();
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t n_local = row / pixels, pixel = row % pixels, n = first_image + n_local;
    const RowPoints<scalar_t> points(p, in, n, pixel);
    const scalar_t* image = in.input + n * p.height * p.width * p.in_channels;
    for (int64_t group = 0; group < p.offset_groups; ++group) {
      for (int64_t i = 0, tap = 0; i < p.kernel_h; ++i) {
        for (int64_t j = 0; j < p.kernel_w; ++j, ++tap) {
          f(n_local, pixel, points, group, tap, points.sample(group, i, j), image);
        }
      }
    }
  }
}

template <typename scalar_t>
DC_CPU_DISPATCH void fill_rows(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image,
                               int64_t row_begin, int64_t row_end, scalar_t* columns) {
  const int64_t channels = p.in_channels, per_offset_group = p.channels_per_offset_group();
  const int64_t pixels = p.out_pixels();
  for_each_point_of_rows(p, in, first_image, row_begin, row_end,
                         [&](int64_t n_local, int64_t pixel, const RowPoints<scalar_t>& points, int64_t group,
                             int64_t tap, const BilinearSample<scalar_t>& s, const scalar_t* image) {
    const scalar_t m = points.mask(group, tap);
    const int64_t c_begin = group * per_offset_group, row = n_local * pixels + pixel - row_begin;
    for_each_weight_group_piece(p, c_begin, c_begin + per_offset_group, [&](int64_t g, int64_t c0, int64_t c1) {
      interpolate(s, image + c0, channels, c1 - c0, in.mask != nullptr, m,
                  columns + column_index(p, 0, g, row, tap, c0));
    });
  });
}

template <typename scalar_t>
DC_CPU_DISPATCH void coordinate_rows(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image,
                                     int64_t row_begin, int64_t row_end, const scalar_t* grad_columns,
                                     scalar_t* grad_offset, scalar_t* grad_mask) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels, per_offset_group = p.channels_per_offset_group();
  for_each_point_of_rows(p, in, first_image, row_begin, row_end,
                         [&](int64_t n_local, int64_t pixel, const RowPoints<scalar_t>& points, int64_t group,
                             int64_t tap, const BilinearSample<scalar_t>& s, const scalar_t* image) {
    // d loss / d value, d y and d x, before the mask's factor.
    scalar_t grad_value = sum_start(s), grad_y = sum_start(s), grad_x = sum_start(s);
    if (s.count > 0) {
      const int64_t c_begin = group * per_offset_group;
      for_each_weight_group_piece(p, c_begin, c_begin + per_offset_group, [&](int64_t g, int64_t c0, int64_t c1) {
        scalar_t dot[4];
        neighbour_dots(s, image + c0, channels, c1 - c0, grad_columns + column_index(p, n_local, g, pixel, tap, c0),
                       dot);
        for (int q = 0; q < s.count; ++q) {
          grad_value += s.weight[q] * dot[q];
          grad_y += s.weight_dy[q] * dot[q];
          grad_x += s.weight_dx[q] * dot[q];
        }
      });
    }
    const scalar_t m = points.mask(group, tap);
    const int64_t at = points.offset_index(group, tap);
    grad_offset[at] = coordinate_grad(s, m, grad_y, p.border_gradient);
    grad_offset[at + pixels] = coordinate_grad(s, m, grad_x, p.border_gradient);
    if (grad_mask != nullptr) grad_mask[points.mask_index(group, tap)] = grad_value;
  });
}

// Tasks are (image, block of channels) pairs: each owns the part of grad_input it writes.
template <typename scalar_t>
DC_CPU_DISPATCH void input_grad_tasks(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image,
                                      int64_t blocks, int64_t task_begin, int64_t task_end,
                                      const scalar_t* grad_columns, scalar_t* grad_input) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels, per_offset_group = p.channels_per_offset_group();
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t n_local = task / blocks, block = task % blocks, n = first_image + n_local;
    const int64_t block_begin = block * channels / blocks, block_end = (block + 1) * channels / blocks;
    scalar_t* image_grad = grad_input + n * p.height * p.width * channels;
    for (int64_t pixel = 0; pixel < pixels; ++pixel) {
      const RowPoints<scalar_t> points(p, in, n, pixel);
      for (int64_t group = 0; group < p.offset_groups; ++group) {
        const int64_t c_begin = std::max(block_begin, group * per_offset_group);
        const int64_t c_end = std::min(block_end, (group + 1) * per_offset_group);
        if (c_begin >= c_end) continue;
        for (int64_t i = 0, tap = 0; i < p.kernel_h; ++i) {
          for (int64_t j = 0; j < p.kernel_w; ++j, ++tap) {
            const BilinearSample<scalar_t> s = points.sample(group, i, j);
            if (s.count == 0) continue;
            const scalar_t m = points.mask(group, tap);
            for_each_weight_group_piece(p, c_begin, c_end, [&](int64_t g, int64_t c0, int64_t c1) {
              const scalar_t* __restrict__ grad = grad_columns + column_index(p, n_local, g, pixel, tap, c0);
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
  }
}

}  // namespace

template <typename scalar_t>
void fill_columns(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image, int64_t images,
                  scalar_t* columns) {
  at::parallel_for(0, images * p.out_pixels(), kRowsPerTask, [&](int64_t begin, int64_t end) {
    fill_rows(p, in, first_image, begin, end, columns + begin * p.taps() * p.in_channels);
  });
}

template <typename scalar_t>
void fill_column_rows(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image,
                      int64_t row_begin, int64_t row_end, scalar_t* columns) {
  fill_rows(p, in, first_image, row_begin, row_end, columns);
}

template <typename scalar_t>
void coordinate_and_mask_grads(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image,
                               int64_t images, const scalar_t* grad_columns, scalar_t* grad_offset,
                               scalar_t* grad_mask) {
  at::parallel_for(0, images * p.out_pixels(), kRowsPerTask, [&](int64_t begin, int64_t end) {
    coordinate_rows(p, in, first_image, begin, end, grad_columns, grad_offset, grad_mask);
  });
}

template <typename scalar_t>
void accumulate_input_grad(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image,
                           int64_t images, const scalar_t* grad_columns, scalar_t* grad_input) {
  // As few channel blocks (of at least 8 channels) as make images * blocks a multiple of the thread count:
  // at::parallel_for hands each thread one fixed share of the tasks, which are then equal, and each block
  // repeats the sampling arithmetic for every point. The result does not depend on the blocking: each element
  // of grad_input lies in exactly one block and sums its terms in the same order.
  const int64_t threads = at::get_num_threads();
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(threads / std::gcd(images, threads), p.in_channels / 8));
  at::parallel_for(0, images * blocks, 1, [&](int64_t begin, int64_t end) {
    input_grad_tasks(p, in, first_image, blocks, begin, end, grad_columns, grad_input);
  });
}

#define DEFORM_CONV_INSTANTIATE(T)                                                                              \
  template void fill_columns<T>(const ConvParams&, const SamplingInputs<T>&, int64_t, int64_t, T*);            \
  template void fill_column_rows<T>(const ConvParams&, const SamplingInputs<T>&, int64_t, int64_t, int64_t, T*); \
  template void coordinate_and_mask_grads<T>(const ConvParams&, const SamplingInputs<T>&, int64_t, int64_t,    \
                                             const T*, T*, T*);                                                \
  template void accumulate_input_grad<T>(const ConvParams&, const SamplingInputs<T>&, int64_t, int64_t,        \
                                         const T*, T*);
DEFORM_CONV_INSTANTIATE(float)
DEFORM_CONV_INSTANTIATE(double)
#undef DEFORM_CONV_INSTANTIATE

}  // namespace cpu
}  // namespace deform_conv
