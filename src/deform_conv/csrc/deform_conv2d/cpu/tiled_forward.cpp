#include "tiled_forward.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <unistd.h>

#include <algorithm>
#include <numeric>
#include <type_traits>

#include "../columns_driver.h"
#include "brgemm.h"
#include "half_conversion.h"
#include "half_gemm.h"
#include "layout.h"
#include "sampling_passes.h"
#include "scratch.h"
#include "thread_images.h"
#include "transpose.h"

namespace deform_conv {
namespace cpu {
namespace {

// One tile's columns and product, at most: half of a 1 MiB L2 cache, from which the GEMM reads each depth block of
// the columns once per panel.
constexpr int64_t kTileBytes = int64_t(512) << 10;
// Pixels per tile, at least: each tile's GEMMs stream the whole weight through the cache, for 2 * pixels
// multiply-adds per weight element read. Fewer pixels, and the GEMMs wait on memory (a layer of 512 channels
// at 3x3, 18 KiB of columns per pixel, ran 2.3x slower than on the driver's path with 14-pixel tiles); such
// float32 layers take the driver's path, whose GEMM covers whole images (the half types' take larger tiles).
constexpr int64_t kMinTilePixels = 32;
// Pixels per tile, at least, where a half-type layer's tiles would not fit: on AMX its GEMMs run several times
// faster than float32's, and with each tile streaming the whole weight they would wait on memory. Whole images up to
// this many pixels instead, the GEMMs taking the tile's columns a depth block at a time. 512 channels at 3x3 and
// 14x14, 2 images, bfloat16 on the Xeon (2 threads): 2.10 ms on the driver's path, 1.60 ms so (with the weight
// packed by one transpose, half_gemm.h); tiles of 128 or 512 pixels were slower on 4 shapes of 5.
constexpr int64_t kMinLargeLayerTilePixels = 256;

bool is_half_type(at::ScalarType dtype) { return dtype == at::kBFloat16 || dtype == at::kHalf; }

// Output pixels of an image are cut into `tiles` tiles of `pixels` (the last one may be shorter).
struct Tiling {
  int64_t pixels, tiles;
};

// Floats of a tile's columns per pixel: the half types' columns are in their own type (two to a float).
int64_t column_floats_per_pixel(const ConvParams& p, at::ScalarType dtype) {
  const int64_t row_size = p.taps() * p.in_channels;
  return is_half_type(dtype) ? ceil_div(row_size, 2) : row_size;
}

// Bytes per pixel of a tile: its columns, and its product in float32.
int64_t tile_bytes_per_pixel(const ConvParams& p, at::ScalarType dtype) {
  return (column_floats_per_pixel(p, dtype) + p.out_channels) * static_cast<int64_t>(sizeof(float));
}

// A tile's bytes: kTileBytes, or twice that where the weight is larger than a 2 MiB L2 cache (or more) holds beside
// a tile. Each tile's GEMMs then stream the whole weight from the next cache, and twice the pixels a tile halve
// that: 256 channels at 28x28 (2.4 MB of float32 weight) took 1.23-1.24x conv2d's forward time with 1 MiB tiles
// against 1.29-1.37x with 512 KiB on a Sapphire Rapids Xeon; a layer whose weight fits (0.9 MB) ran 4% slower with
// them. CPUs with a smaller L2 keep kTileBytes. The half types' tiles hold four times as many bytes: their GEMMs
// take a tile's columns a depth block at a time, and ran faster on larger tiles (bfloat16 on the Xeon, 2 threads,
// tiles of 1, 2, 4 and 8 times the bytes: S1 3.27, 3.11, 3.09, 3.03 ms; S2 2.77, 2.65, 2.61, 2.55 ms; S5 1.55 at
// once, 1.46 at four times and 1.64 at eight, with whole images).
int64_t tile_bytes(const ConvParams& p, at::ScalarType dtype) {
#if defined(_SC_LEVEL2_CACHE_SIZE)
  static const int64_t l2_bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);  // 0 or -1 where the C library does not know it
#else
  constexpr int64_t l2_bytes = 0;
#endif
  constexpr int64_t kLargeL2 = int64_t(2) << 20;
  const int64_t weight_bytes =
      p.out_channels * p.taps() * p.in_channels_per_group() * static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t bytes = l2_bytes >= kLargeL2 && weight_bytes > kLargeL2 ? 2 * kTileBytes : kTileBytes;
  return is_half_type(dtype) ? 4 * bytes : bytes;
}

// Whether tiles of kMinTilePixels hold the layer's float32 columns and product in kTileBytes.
bool fits_tiles(const ConvParams& p) { return tile_bytes_per_pixel(p, at::kFloat) * kMinTilePixels <= kTileBytes; }

// Pixels per tile, at least: kMinTilePixels, or for a half-type layer whose tiles would not fit, whole images up to
// kMinLargeLayerTilePixels.
int64_t least_tile_pixels(const ConvParams& p, at::ScalarType dtype) {
  return is_half_type(dtype) && !fits_tiles(p) ? std::min(p.out_pixels(), kMinLargeLayerTilePixels) : kMinTilePixels;
}

// As large as tile_bytes allows, but small enough (down to least_tile_pixels) that every thread gets a tile.
Tiling tiling(const ConvParams& p, at::ScalarType dtype, int64_t threads) {
  const int64_t least = least_tile_pixels(p, dtype);
  const int64_t most = std::max<int64_t>(1, tile_bytes(p, dtype) / tile_bytes_per_pixel(p, dtype));
  const int64_t enough = std::max(least, ceil_div(p.out_pixels(), ceil_div(threads, p.batch)));
  int64_t tiles = ceil_div(p.out_pixels(), std::max(std::min(least, p.out_pixels()), std::min(most, enough)));
  // A whole number of tasks per thread where the tiles stay large enough: at::parallel_for hands each thread one
  // share of the tasks, and 3 images of 5 tiles on 2 threads left one thread idle while the other ran its eighth.
  const int64_t step = threads / std::gcd(p.batch, threads);
  const int64_t balanced = ceil_div(tiles, step) * step;
  if (ceil_div(p.out_pixels(), balanced) >= least) tiles = balanced;
  return {ceil_div(p.out_pixels(), tiles), tiles};
}

// The input in channels-last memory, in `dtype`: its own (the native half path's corners are widened as the
// sampling loads them), or float32 for a half-type input on the float32 path: itself if it is already, else turned
// in this thread's scratch memory.
at::Tensor input_channels_last(const at::Tensor& input, at::ScalarType dtype) {
  return in_channels_last(input, dtype, [](at::IntArrayRef sizes, const at::TensorOptions& options) {
    return scratch(ScratchSlot::channels_last_input, sizes, options);
  });
}

// The weight [C_out, C_in/G, kh, kw] as the GEMMs read it: for each group, its output channels in panels of
// kPanelWidth (the last one may be narrower), each panel a contiguous [taps * C_in/G, width] matrix whose rows
// follow the columns (taps outer, channels inner). A GEMM then reads its factor as one contiguous stream instead
// of one short piece per row a whole weight row apart, which starves it once the weight is larger than the cache.
// float32: panel c of group g starts at (g * C_out/G + c) * taps * C_in/G. The half types: each panel packed for
// the half GEMM (pack_vnni_panels, or pack_weight_panel) in a slot of panel_slot() elements, panel c of group g in slot
// g * panels_per_group + c / kPanelWidth.
struct WeightPanels {
  at::Tensor data;
  int64_t panels_per_group, slot;
};

int64_t panel_slot(const ConvParams& p) {
  return p.taps() * p.in_channels_per_group() * packed_width(std::min(kPanelWidth, p.out_channels_per_group()));
}

// The weight's panels, each [taps * C_in/G, width] (see WeightPanels; of float32 or the half type alike), panel c
// of group g at (g * C_out/G + c) * taps * C_in/G: first the rows in the columns' order (weight_in_column_order),
// then each panel's rows by blocked transposes (a half-type weight on the float32 path widened by them). (ATen's
// copies of the permuted weight took 0.7 ms of S2's bfloat16 forward on the Xeon, 2 threads: 15% of it.)
template <typename scalar_t, typename weight_t>
at::Tensor unpacked_panels(const ConvParams& p, const at::Tensor& weight) {
  const int64_t per_group = p.taps() * p.in_channels_per_group(), out_per_group = p.out_channels_per_group();
  // [C_out, taps * C_in/G] in memory
  const at::Tensor turned = weight_in_column_order(weight.contiguous(), weight.scalar_type());
  const weight_t* rows = turned.const_data_ptr<weight_t>();
  at::Tensor panels = weight.new_empty({p.out_channels * per_group}, weight.options().dtype(
                                                                          c10::CppTypeToScalarType<scalar_t>::value));
  scalar_t* to = panels.mutable_data_ptr<scalar_t>();
  // Tasks: up to kPanelRowsPerTask rows of a panel (S1: its 576 in 3 tasks, S2: 2304 in 9 for each of 4 panels).
  constexpr int64_t kPanelRowsPerTask = 256;
  const int64_t panels_per_group = ceil_div(out_per_group, kPanelWidth);
  const int64_t depth_blocks = ceil_div(per_group, kPanelRowsPerTask);
  at::parallel_for(0, p.groups * panels_per_group * depth_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t panel = task / depth_blocks, k0 = task % depth_blocks * kPanelRowsPerTask;
      const int64_t g = panel / panels_per_group, c = panel % panels_per_group * kPanelWidth;
      const int64_t width = std::min(kPanelWidth, out_per_group - c);
      const int64_t depth = std::min(kPanelRowsPerTask, per_group - k0);
      const int64_t first_row = g * out_per_group + c;
      transpose(rows + first_row * per_group + k0, width, depth, per_group, to + first_row * per_group + k0 * width,
                width);
    }
  });
  return panels;
}

// The half types' panels where the GEMM reads VNNI pairs: each task turns the rows of 16 output channels to the
// columns' order (taps_outer) into a buffer that stays in the L2 cache, and packs them at once as 16 columns of
// their panel (pack_panel_columns). The weight is read once and its panels written once, with no turned copy of the
// whole weight (S3's is 4.7 MB; its forward on the Xeon was no faster measurably than turning it whole first).
template <typename scalar_t>
void pack_vnni_panels(const ConvParams& p, const at::Tensor& weight, const HalfGemm& gemm, int64_t slot,
                      scalar_t* packed) {
  constexpr int64_t kColumnsPerTask = 16;
  const int64_t taps = p.taps(), per_channel = p.in_channels_per_group(), per_group = taps * per_channel;
  const int64_t out_per_group = p.out_channels_per_group(), panels_per_group = ceil_div(out_per_group, kPanelWidth);
  const at::Tensor weight_c = weight.contiguous();
  const scalar_t* w = weight_c.const_data_ptr<scalar_t>();
  constexpr int64_t kTasksPerPanel = kPanelWidth / kColumnsPerTask;
  at::parallel_for(0, p.groups * panels_per_group * kTasksPerPanel, 1, [&](int64_t begin, int64_t end) {
    scalar_t* rows = static_cast<scalar_t*>(
        scratch_bytes(ScratchSlot::half_factors, kColumnsPerTask * per_group * int64_t(sizeof(scalar_t))));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t panel = task / kTasksPerPanel, j0 = task % kTasksPerPanel * kColumnsPerTask;
      const int64_t g = panel / panels_per_group, c = panel % panels_per_group * kPanelWidth;
      const int64_t width = std::min(kPanelWidth, out_per_group - c);
      if (j0 >= width) continue;
      const int64_t count = std::min(kColumnsPerTask, width - j0);
      taps_outer(w + (g * out_per_group + c + j0) * per_group, count, per_channel, taps, rows);
      pack_panel_columns(gemm, per_group, count, rows, per_group, j0, packed_width(width), packed + panel * slot);
    }
  });
}

// The panels in scalar_t from a weight of weight_t: the same type, or a half type widened for the float32 path.
template <typename scalar_t, typename weight_t>
WeightPanels weight_panels(const ConvParams& p, const at::Tensor& weight, const HalfGemm& gemm) {
  const int64_t per_group = p.taps() * p.in_channels_per_group(), out_per_group = p.out_channels_per_group();
  const int64_t panels_per_group = ceil_div(out_per_group, kPanelWidth);
  if constexpr (std::is_same_v<scalar_t, float>) {
    (void)gemm;
    return {unpacked_panels<scalar_t, weight_t>(p, weight), panels_per_group, 0};
  } else {
    const int64_t slot = panel_slot(p);
    at::Tensor packed = weight.new_empty({p.groups * panels_per_group * slot});
    scalar_t* to = packed.mutable_data_ptr<scalar_t>();
    if (gemm.packs_vnni_pairs) {
      pack_vnni_panels(p, weight, gemm, slot, to);
      return {packed, panels_per_group, slot};
    }
    const at::Tensor unpacked = unpacked_panels<scalar_t, scalar_t>(p, weight);
    const scalar_t* from = unpacked.const_data_ptr<scalar_t>();
    at::parallel_for(0, p.groups * panels_per_group, 1, [&](int64_t begin, int64_t end) {
      for (int64_t panel = begin; panel < end; ++panel) {
        const int64_t g = panel / panels_per_group, c = panel % panels_per_group * kPanelWidth;
        const int64_t width = std::min(kPanelWidth, out_per_group - c);
        pack_weight_panel(gemm, per_group, width, from + (g * out_per_group + c) * per_group, width,
                          to + panel * slot);
      }
    });
    return {packed, panels_per_group, slot};
  }
}

// scalar_t: the columns' and the GEMMs' type; image_t: the input's, the weight's and the output's. The same, or
// float32 columns from a half-type image (a half type without a native GEMM here): the image and the weight widened
// as they are turned, the output rounded as it is turned back, each once -- the bits of the float32 path on the
// widened tensors, without widened copies of them.
template <typename scalar_t, typename image_t>
at::Tensor tiled_forward_in(const ConvParams& p, const at::Tensor& input, const at::Tensor& offset,
                            const std::optional<at::Tensor>& mask, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  constexpr bool kHalf = !std::is_same_v<scalar_t, float>;
  constexpr at::ScalarType kColumnType = c10::CppTypeToScalarType<scalar_t>::value;
  at::Tensor output = input.new_empty({p.batch, p.out_channels, p.out_h, p.out_w});
  if (output.numel() == 0) return output;

  const HalfGemm gemm = kHalf ? half_gemm_for(kColumnType) : HalfGemm{};
  const int64_t per_group = p.taps() * p.in_channels_per_group(), out_per_group = p.out_channels_per_group();
  const int64_t row_size = p.taps() * p.in_channels, pixels = p.out_pixels();
  const int64_t plane = p.height * p.width, image_size = plane * p.in_channels;
  const Tiling tiles = tiling(p, kColumnType, at::get_num_threads());
  // Per thread: the tile's float32 product, then its columns (the half types': sampled in float32 and rounded once
  // as they are written), then the thread's turned image (in the columns' type).
  const int64_t column_floats = column_floats_per_pixel(p, kColumnType) * tiles.pixels;
  const int64_t tile_floats = p.out_channels * tiles.pixels + column_floats;

  // Each thread turns the images it works on to channels-last itself, into the scratch memory beside its tile
  // (thread_images.h), or the input is turned once, up front, by all threads.
  const bool turn_per_thread = turns_per_thread(input, sizeof(scalar_t));
  const int64_t turn_floats = turn_per_thread ? ceil_div(image_size * int64_t(sizeof(scalar_t)), sizeof(float)) : 0;
  const at::Tensor input_c = turn_per_thread ? input : input_channels_last(input, kColumnType);
  // The sampling reads float32 offsets and masks (a few values per pixel, widened up front for the half types).
  const at::Tensor offset_c = float32_contiguous(offset);
  const at::Tensor mask_c = mask.has_value() ? float32_contiguous(*mask) : at::Tensor();
  const WeightPanels panels = weight_panels<scalar_t, image_t>(p, weight, gemm);
  const at::Tensor bias_c = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* offsets = offset_c.const_data_ptr<float>();
  const float* masks = mask_c.defined() ? mask_c.const_data_ptr<float>() : nullptr;
  const scalar_t* weights = panels.data.const_data_ptr<scalar_t>();
  const float* bias_ptr = bias_c.defined() ? bias_c.const_data_ptr<float>() : nullptr;
  image_t* out = output.mutable_data_ptr<image_t>();

  at::parallel_for(0, p.batch * tiles.tiles, 1, [&](int64_t begin, int64_t end) {
    float* product = static_cast<float*>(  // [tile pixels, C_out]
        scratch_bytes(ScratchSlot::tile, (tile_floats + turn_floats) * int64_t(sizeof(float))));
    float* after_product = product + p.out_channels * tiles.pixels;
    scalar_t* columns = reinterpret_cast<scalar_t*>(after_product);  // [tile pixels, row_size]
    scalar_t* turned = reinterpret_cast<scalar_t*>(after_product + column_floats);  // channels-last image
    int64_t turned_image = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / tiles.tiles, first = task % tiles.tiles * tiles.pixels;
      const int64_t len = std::min(tiles.pixels, pixels - first);
      if (turn_per_thread && n != turned_image) {
        turn_image(input_c.const_data_ptr<image_t>(), n, p.in_channels, plane, turned);
        turned_image = n;
      }
      // Image n alone, as image 0.
      const SamplingInputs<float, scalar_t> in{
          turn_per_thread ? turned : input_c.const_data_ptr<scalar_t>() + n * image_size,
          offsets + p.offset_index(n, 0, 0, 0), masks != nullptr ? masks + p.mask_index(n, 0, 0, 0) : nullptr};
      fill_column_rows(p, in, /*first_image=*/0, first, first + len, columns);
      // product[:, group g's panel] = columns[:, group g] x panel, a depth block of the columns at a time: each
      // block is read by every panel while it is in cache (a large layer's tile of columns outgrows the L2 cache).
      // Each sum adds its blocks in order, as a GEMM over the whole depth would.
      for (int64_t k0 = 0; k0 < per_group; k0 += kDepthBlock) {
        const int64_t depth = std::min(kDepthBlock, per_group - k0);
        for (int64_t g = 0; g < p.groups; ++g) {
          for (int64_t c = 0; c < out_per_group; c += kPanelWidth) {
            const int64_t width = std::min(kPanelWidth, out_per_group - c);
            const scalar_t* a = columns + g * per_group + k0;
            float* to = product + g * out_per_group + c;
            if constexpr (kHalf) {
              const scalar_t* panel = weights + (g * panels.panels_per_group + c / kPanelWidth) * panels.slot;
              half_gemm_on_this_thread(gemm, len, width, depth, a, row_size, panel + k0 * packed_width(width), to,
                                       p.out_channels, /*accumulate=*/k0 > 0);
            } else {
              const scalar_t* panel = weights + (g * out_per_group + c) * per_group;
              gemm_on_this_thread(len, width, depth, a, row_size, panel + k0 * width, width, to, p.out_channels,
                                  /*accumulate=*/k0 > 0);
            }
          }
        }
      }
      // The product [len, C_out] into output[n, :, first : first + len], with the bias.
      if constexpr (!std::is_same_v<image_t, float>) {
        transpose_narrowing(product, len, p.out_channels, p.out_channels, out + n * p.out_channels * pixels + first,
                            pixels, bias_ptr);
      } else {
        transpose(product, len, p.out_channels, p.out_channels, out + n * p.out_channels * pixels + first, pixels,
                  bias_ptr);
      }
    }
    if constexpr (kHalf) {
      release_half_gemm_context(gemm);
    } else {
      release_gemm_context();
    }
  });
  return output;
}

// Whether a half-type layer's columns and GEMMs are in its own type here (else in float32).
bool native_half(at::ScalarType dtype) { return is_half_type(dtype) && half_gemm_for(dtype).uses_native_path(); }

}  // namespace

bool tiled_forward_applies(const ConvParams& p, const at::Tensor& input) {
  const at::ScalarType dtype = input.scalar_type();
  if (!native_half(dtype)) {
    return (dtype == at::kFloat || is_half_type(dtype)) && fits_tiles(p) && batch_reduce_gemm_works();
  }
  if (p.taps() * p.in_channels_per_group() % 2 != 0) return false;
  // A half-type layer whose tiles would not fit takes tiles of whole images (kMinLargeLayerTilePixels), unless its
  // weight is large against all its rows: the driver's matrix products then read it once (bfloat16 on the Xeon, 2
  // threads: 512 channels at 14x14, one image, 1.10 ms there and 1.28 ms tiled; 1024 channels at 7x7, 2 images,
  // 2.34 ms and 3.42 ms); nor where such a tile and a turned image would outgrow a thread's scratch memory (8192
  // channels at 3x3 take 146 KiB of columns and product a pixel).
  if (fits_tiles(p)) return true;
  const int64_t tile = least_tile_pixels(p, dtype) * tile_bytes_per_pixel(p, dtype);
  return tile + kMaxTurnedImageBytes <= kMaxKeptScratchBytes && !rows_gemm_pays(p, p.batch * p.out_pixels(), dtype);
}

at::Tensor tiled_forward(const ConvParams& p, const at::Tensor& input, const at::Tensor& offset,
                         const std::optional<at::Tensor>& mask, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  const bool native = native_half(input.scalar_type());
  switch (input.scalar_type()) {
    case at::kFloat:
      return tiled_forward_in<float, float>(p, input, offset, mask, weight, bias);
    case at::kBFloat16:
      return native ? tiled_forward_in<c10::BFloat16, c10::BFloat16>(p, input, offset, mask, weight, bias)
                    : tiled_forward_in<float, c10::BFloat16>(p, input, offset, mask, weight, bias);
    case at::kHalf:
      return native ? tiled_forward_in<c10::Half, c10::Half>(p, input, offset, mask, weight, bias)
                    : tiled_forward_in<float, c10::Half>(p, input, offset, mask, weight, bias);
    default:
      TORCH_CHECK(false, "deform_conv: tiled_forward does not serve ", input.scalar_type());
  }
}

}  // namespace cpu
}  // namespace deform_conv
