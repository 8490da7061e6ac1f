#include "tiled_forward.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <numeric>

#include "brgemm.h"
#include "sampling_passes.h"
#include "scratch.h"
#include "transpose.h"

namespace deform_conv {
namespace cpu {
namespace {

// One tile's columns and product, at most: half of a 1 MiB L2 cache, from which the GEMM reads the columns once
// per panel.
constexpr int64_t kTileBytes = int64_t(512) << 10;
// Pixels per tile, at least: each tile's GEMMs stream the whole weight through the cache, for 2 * pixels
// multiply-adds per weight element read. Fewer pixels, and the GEMMs wait on memory (a layer of 512 channels
// at 3x3, 18 KiB of columns per pixel, ran 2.3x slower than on the driver's path with 14-pixel tiles); such
// layers take the driver's path, whose GEMM covers whole images.
constexpr int64_t kMinTilePixels = 32;
// A thread turns the images it works on to channels-last itself when they are at most this large; it keeps the
// buffer (scratch.h), so the bound is per worker thread.
constexpr int64_t kMaxTurnedImageBytes = int64_t(4) << 20;
// Output channels per GEMM: four AVX-512 vectors of float32.
constexpr int64_t kPanelWidth = 64;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Output pixels of an image are cut into `tiles` tiles of `pixels` (the last one may be shorter).
struct Tiling {
  int64_t pixels, tiles;
};

// Bytes per pixel of a tile: its columns and its product.
int64_t tile_bytes_per_pixel(const ConvParams& p) {
  return (p.taps() * p.in_channels + p.out_channels) * static_cast<int64_t>(sizeof(float));
}

// As large as kTileBytes allows, but small enough (down to kMinTilePixels) that every thread gets a tile.
Tiling tiling(const ConvParams& p, int64_t threads) {
  const int64_t most = std::max<int64_t>(1, kTileBytes / tile_bytes_per_pixel(p));
  const int64_t enough = std::max(kMinTilePixels, ceil_div(p.out_pixels(), ceil_div(threads, p.batch)));
  int64_t tiles = ceil_div(p.out_pixels(), std::min(most, enough));
  // A whole number of tasks per thread where the tiles stay large enough: at::parallel_for hands each thread one
  // share of the tasks, and 3 images of 5 tiles on 2 threads left one thread idle while the other ran its eighth.
  const int64_t step = threads / std::gcd(p.batch, threads);
  const int64_t balanced = ceil_div(tiles, step) * step;
  if (ceil_div(p.out_pixels(), balanced) >= kMinTilePixels) tiles = balanced;
  return {ceil_div(p.out_pixels(), tiles), tiles};
}

// The input in channels-last memory: itself if it is already, else a copy in this thread's scratch memory.
at::Tensor channels_last(const at::Tensor& input) {
  if (input.is_contiguous(at::MemoryFormat::ChannelsLast)) return input;
  return scratch(ScratchSlot::channels_last_input, input.sizes(), input.options()).copy_(input);
}

// The weight [C_out, C_in/G, kh, kw] as the GEMMs read it: for each group, its output channels in panels of
// kPanelWidth (the last one may be narrower), each panel a contiguous [taps * C_in/G, width] matrix whose rows
// follow the columns (taps outer, channels inner). Panel c of group g starts at (g * C_out/G + c) * taps * C_in/G.
// A GEMM then reads its factor as one contiguous stream instead of one short piece per row a whole weight row
// apart, which starves it once the weight is larger than the cache.
at::Tensor weight_panels(const ConvParams& p, const at::Tensor& weight) {
  const int64_t per_group = p.taps() * p.in_channels_per_group(), out_per_group = p.out_channels_per_group();
  // [G, taps * C_in/G, C_out/G]
  const at::Tensor by_group =
      weight.permute({0, 2, 3, 1}).reshape({p.groups, out_per_group, per_group}).transpose(1, 2).contiguous();
  if (out_per_group <= kPanelWidth) return by_group;
  at::Tensor panels = at::empty({p.out_channels * per_group}, weight.options());
  for (int64_t g = 0; g < p.groups; ++g) {
    for (int64_t c = 0; c < out_per_group; c += kPanelWidth) {
      const int64_t width = std::min(kPanelWidth, out_per_group - c);
      panels.narrow(0, (g * out_per_group + c) * per_group, per_group * width)
          .view({per_group, width})
          .copy_(by_group[g].narrow(1, c, width));
    }
  }
  return panels;
}

}  // namespace

bool tiled_forward_applies(const ConvParams& p, const at::Tensor& input) {
  return input.scalar_type() == at::kFloat && tile_bytes_per_pixel(p) * kMinTilePixels <= kTileBytes &&
         batch_reduce_gemm_works();
}

at::Tensor tiled_forward(const ConvParams& p, const at::Tensor& input, const at::Tensor& offset,
                         const std::optional<at::Tensor>& mask, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  at::Tensor output = at::empty({p.batch, p.out_channels, p.out_h, p.out_w}, input.options());
  if (output.numel() == 0) return output;

  const int64_t per_group = p.taps() * p.in_channels_per_group(), out_per_group = p.out_channels_per_group();
  const int64_t row_size = p.taps() * p.in_channels, pixels = p.out_pixels();
  const int64_t image_size = p.height * p.width * p.in_channels;
  const Tiling tiles = tiling(p, at::get_num_threads());
  const int64_t tile_floats = (row_size + p.out_channels) * tiles.pixels;

  // Each thread turns the images it works on to channels-last itself, into a buffer that stays in its cache
  // (an image whose tiles two threads share is turned by both). That pays where most images are one thread's
  // alone; otherwise the input is turned once, up front, by all threads.
  const bool turn_per_thread = input.is_contiguous() && p.batch >= at::get_num_threads() &&
                               image_size * int64_t(sizeof(float)) <= kMaxTurnedImageBytes;
  const at::Tensor input_cl = turn_per_thread ? input : channels_last(input);
  const at::Tensor offset_c = offset.contiguous();
  const at::Tensor mask_c = mask.has_value() ? mask->contiguous() : at::Tensor();
  const at::Tensor panels = weight_panels(p, weight);
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* images = input_cl.const_data_ptr<float>();
  const float* offsets = offset_c.const_data_ptr<float>();
  const float* masks = mask_c.defined() ? mask_c.const_data_ptr<float>() : nullptr;
  const float* weights = panels.const_data_ptr<float>();
  const float* bias_ptr = bias_c.defined() ? bias_c.const_data_ptr<float>() : nullptr;
  float* out = output.mutable_data_ptr<float>();

  at::parallel_for(0, p.batch * tiles.tiles, 1, [&](int64_t begin, int64_t end) {
    float* columns = static_cast<float*>(
        scratch_bytes(ScratchSlot::tile, (tile_floats + (turn_per_thread ? image_size : 0)) * int64_t(sizeof(float))));
    float* product = columns + row_size * tiles.pixels;  // [tile pixels, C_out]
    float* turned = product + p.out_channels * tiles.pixels;  // this thread's image, channels-last
    int64_t turned_image = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / tiles.tiles, first = task % tiles.tiles * tiles.pixels;
      const int64_t len = std::min(tiles.pixels, pixels - first);
      if (turn_per_thread && n != turned_image) {
        transpose(images + n * image_size, p.in_channels, p.height * p.width, p.height * p.width, turned,
                  p.in_channels);
        turned_image = n;
      }
      // Image n alone, as image 0.
      const SamplingInputs<float> in{turn_per_thread ? turned : images + n * image_size,
                                     offsets + p.offset_index(n, 0, 0, 0),
                                     masks != nullptr ? masks + p.mask_index(n, 0, 0, 0) : nullptr};
      fill_column_rows(p, in, /*first_image=*/0, first, first + len, columns);
      // product[:, group g's panel] = columns[:, group g] x panel
      for (int64_t g = 0; g < p.groups; ++g) {
        for (int64_t c = 0; c < out_per_group; c += kPanelWidth) {
          const int64_t width = std::min(kPanelWidth, out_per_group - c);
          gemm_on_this_thread(len, width, per_group, columns + g * per_group, row_size,
                              weights + (g * out_per_group + c) * per_group, width, product + g * out_per_group + c,
                              p.out_channels, /*accumulate=*/false);
        }
      }
      // The product [len, C_out] into output[n, :, first : first + len], with the bias.
      transpose(product, len, p.out_channels, p.out_channels, out + n * p.out_channels * pixels + first, pixels,
                bias_ptr);
    }
    release_gemm_context();
  });
  return output;
}

}  // namespace cpu
}  // namespace deform_conv
