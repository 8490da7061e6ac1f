// The three passes over the sampling points on the CPU. They share one data layout:
//
//   input    channels-last  [batch, height, width, in_channels]        (channels innermost: contiguous gathers)
//   offset   contiguous     [batch, 2 * offset_groups * taps, out_h, out_w]
//   mask     contiguous     [batch, offset_groups * taps, out_h, out_w] (or absent)
//   columns  contiguous     [images, out_h, out_w, groups, taps, in_channels / groups] (ConvParams::column_index)
//
// `images` consecutive images starting at `first_image` form one chunk.
#pragma once

#include <cstdint>

#include "../conv_params.h"

namespace deform_conv {
namespace cpu {

// image_t: the input's type, scalar_t's or, for float, a half type whose values the passes widen as they load them
// (the tiled forward of the half types: half the bytes of a float32 image to read).
template <typename scalar_t, typename image_t = scalar_t>
struct SamplingInputs {
  const image_t* input;    // channels-last [batch, height, width, in_channels]
  const scalar_t* offset;  // [batch, 2 * offset_groups * taps, out_h, out_w]
  const scalar_t* mask;    // [batch, offset_groups * taps, out_h, out_w], nullptr without a mask
};

// columns[n, pixel, g, tap, c] = mask * bilinear(input[n, :, :, channel]) at the tap's sampling point. column_t
// is scalar_t, or for float a half type: each column sampled in float and rounded once to it (the half types'
// GEMMs read them so).
template <typename scalar_t, typename column_t, typename image_t = scalar_t>
void fill_columns(const ConvParams& p, const SamplingInputs<scalar_t, image_t>& in, int64_t first_image,
                  int64_t images, column_t* columns);

// The same for rows [row_begin, row_end) of the chunk only (a row is one (image, output pixel), numbered from
// the chunk's first image), written from `columns` on: `columns` holds row row_begin's columns. Serial: for
// callers that parallelise themselves. column_t as for fill_columns; image_t as SamplingInputs says.
template <typename scalar_t, typename column_t, typename image_t = scalar_t>
void fill_column_rows(const ConvParams& p, const SamplingInputs<scalar_t, image_t>& in, int64_t first_image,
                      int64_t row_begin, int64_t row_end, column_t* columns);

// From the columns' gradient: d loss / d offset and d loss / d mask of the chunk's images
// (grad_mask is nullptr without a mask). Each sampling point sums over its offset group's channels. image_t as
// SamplingInputs says (the half types' backward: their image read as it is, the sums in float).
template <typename scalar_t, typename image_t = scalar_t>
void coordinate_and_mask_grads(const ConvParams& p, const SamplingInputs<scalar_t, image_t>& in, int64_t first_image,
                               int64_t images, const scalar_t* grad_columns, scalar_t* grad_offset,
                               scalar_t* grad_mask);

// From the columns' gradient: adds d loss / d input of the chunk's images into grad_input, channels-last
// [batch, height, width, in_channels]. Race-free without atomics and deterministic: each task owns one
// image and one block of channels, and visits the sampling points in a fixed order. It reads the offsets and the
// mask, not the input (in.input may be nullptr).
template <typename scalar_t>
void accumulate_input_grad(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image,
                           int64_t images, const scalar_t* grad_columns, scalar_t* grad_input);

// Both passes above for output pixels [pixel_begin, pixel_end) of image n alone, on the calling thread, from their
// columns' gradient (grad_columns holds their rows): the tiled backward (tiled_backward.h), whose tile
// of that gradient stays in cache. The coordinates' gradient of those points, and their terms added to image n's
// input gradient in the order the whole image's pass adds them (pixel by pixel, tap by tap): the same sums.
template <typename image_t>
void tile_grads(const ConvParams& p, const SamplingInputs<float, image_t>& in, int64_t n, int64_t pixel_begin,
                int64_t pixel_end, const float* grad_columns, float* grad_offset, float* grad_mask,
                float* grad_input);

}  // namespace cpu
}  // namespace deform_conv
