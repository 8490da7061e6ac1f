// GEMMs on ATen's batch-reduce GEMM for float32 (at::native::cpublas::brgemm: oneDNN's microkernels, each call
// on the calling thread alone), and the CPU backward's GEMMs built from it (and from the half types' GEMMs). Called per tile from our own parallel
// loops, they find their operands in cache; on the 2-core EPYC of the benchmarks they reach about 110 GFLOP/s
// per core, where MKL's sgemm reaches 80-95.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../conv_params.h"
#include "half_gemm.h"

namespace deform_conv {
namespace cpu {

// Rows of b per GEMM call, float32 and half types alike: a 64-column panel of them (128 KiB in float32) stays in
// L2 next to the rows of a.
constexpr int64_t kDepthBlock = 512;
// Output channels per GEMM panel: four AVX-512 vectors of float32 (oneDNN packs half-type panels to leading
// dimensions of 16 to 64, so a packed panel is at most this wide too).
constexpr int64_t kPanelWidth = 64;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether the GEMM runs on oneDNN's microkernels here: this library compiled against a torch that has it (ATen's
// CPUBLAS_BRGEMM_F32F32F32, torch >= 2.9), ATen built with oneDNN, x86 with AVX2, and oneDNN enabled
// (torch.backends.mkldnn.enabled, which may change between calls). Where it is false, float32 layers take the
// driver's path, whose GEMMs (ATen's) split their sums by thread count. The op brgemm_available() returns it, so
// that tests and `deform-conv doctor` ask the library rather than guess from torch's version and the CPU.
bool batch_reduce_gemm_works();

// c[m, n] = a[m, k] x b[k, n] (or c += with `accumulate`), row-major with leading dimensions ld_*, on the calling
// thread. k is summed in blocks of 512 rows of b, each block's sum added to c in order.
void gemm_on_this_thread(int64_t m, int64_t n, int64_t k, const float* a, int64_t ld_a, const float* b,
                         int64_t ld_b, float* c, int64_t ld_c, bool accumulate);

// Frees a thread's GEMM state once its run of GEMMs ends, as ATen asks (float32 holds none today).
void release_gemm_context();

// The backward's GEMMs for images [first, first + images) of a float32 layer, where the GEMM runs on oneDNN:
// grad_weights [C_out, taps * C_in/G] += each group's grad_output x its columns; then the columns
// [images, out_pixels, taps * C_in] are overwritten by their gradient, each group's grad_output transposed x its
// weight. Deterministic: every element is summed by one task in a fixed order, whatever the thread count.
// Returns false, doing nothing, where it does not apply.
// `columns` and `grad_columns` are the same tensor (the columns' gradient overwrites them).
bool backward_gemms(const ConvParams& p, const at::Tensor& grad_output, int64_t first, int64_t images,
                    const at::Tensor& weight_matrix, const at::Tensor& columns, at::Tensor& grad_columns,
                    at::Tensor& grad_weights);

// The same GEMMs for a bfloat16 or float16 (half_t) layer, on half GEMMs where the CPU has them (half_gemm.h):
// the columns come filled in half_t (each rounded once, as in the native forward), grad_output and the weight are
// the layer's, in half_t, every sum stays in float32, and the columns' gradient goes to grad_columns, float32.
// Returns false, doing nothing, where there is no native half GEMM, half_backward_gemms_fit says no, or a tensor
// is not in those dtypes.
template <typename half_t>
bool half_backward_gemms(const ConvParams& p, const at::Tensor& grad_output, int64_t first, int64_t images,
                         const at::Tensor& weight_matrix, const at::Tensor& columns, at::Tensor& grad_columns,
                         at::Tensor& grad_weights);

// Whether a layer's grad_output tiles fit half_backward_gemms' scratch memory.
bool half_backward_gemms_fit(const ConvParams& p);

// Output pixels of one image per tile of the columns' gradient (the backward's second GEMM).
constexpr int64_t kPixelTile = 128;

// The float32 backward's factors for images [first, first + images) (backward_gemms, tiled_backward.h), with the
// interface of HalfBackwardFactors below: grad_output [images, C_out, pixels] and the weight [C_out, taps * C_in/G],
// contiguous. add_weight_gradient: each task a block of output channels by a panel of the columns, summing image
// after image; column_gradient_tile: the tile's grad_output turned into `turned` [len, C_out], times each group's
// weight.
struct FloatBackwardFactors {
  using turned_t = float;  // column_gradient_tile's `turned`
  at::Tensor grad_out, weight;

  // Whether these GEMMs run here: on oneDNN's batch-reduce GEMM (batch_reduce_gemm_works), with a tile of
  // grad_output that fits a thread's scratch memory (up to 65536 output channels).
  static bool apply(const ConvParams& p);
  // column_gradient_tile's `turned`: values per pixel (C_out).
  static int64_t turned_per_pixel(const ConvParams& p) { return p.out_channels; }

  FloatBackwardFactors(const ConvParams& p, const at::Tensor& grad_output, int64_t first, int64_t images,
                       const at::Tensor& weight_matrix);
  void add_weight_gradient(const ConvParams& p, int64_t images, const float* columns, float* grad_weights) const;
  void column_gradient_tile(const ConvParams& p, int64_t n, int64_t first_pixel, int64_t len, float* turned,
                            float* grad_columns, int64_t ld) const;
  // Frees the calling thread's GEMM state after its run of column_gradient_tile (release_gemm_context).
  void release() const { release_gemm_context(); }
};

// The half types' backward factors for images [first, first + images) (half_backward_gemms, tiled_backward.h):
// grad_output in half_t [images, C_out, depth], depth the pixels rounded up to pairs (a zero past an odd count), and
// each group's weight [C_out/G, taps * C_in/G] packed for the half GEMM in panels of kPanelWidth columns.
template <typename half_t>
struct HalfBackwardFactors {
  using turned_t = half_t;  // column_gradient_tile's `turned`
  HalfGemm gemm;
  int64_t depth, group_depth;  // group_depth: C_out/G rounded up to pairs
  int64_t panels, slot;        // panels per group, each in a slot of this many values
  at::Tensor grad_out, weight;

  // Whether these GEMMs run here on `gemm` (the half GEMM the call read once, half_gemm_for): it is native (or
  // portable, by DEFORM_CONV_CPU_HALF_GEMM), and a tile of one group's grad_output fits a thread's scratch memory.
  static bool apply(const ConvParams& p, const HalfGemm& gemm) {
    return gemm.uses_native_path() && half_backward_gemms_fit(p);
  }
  // column_gradient_tile's `turned`: values per pixel (group_depth).
  static int64_t turned_per_pixel(const ConvParams& p) { return even(p.out_channels_per_group()); }

  HalfBackwardFactors(const ConvParams& p, const HalfGemm& gemm, const at::Tensor& grad_output, int64_t first,
                      int64_t images, const at::Tensor& weight_matrix);
  // grad_weights [C_out, taps * C_in/G] (float32) += each group's grad_output x its columns, `columns` the images'
  // [images, pixels, taps * C_in] in half_t (each rounded once, as the fill writes them): tasks of output channels
  // by panels of columns, each packing its panel 512 pixels at a time, the blocks' sums added in order. Parallel.
  void add_weight_gradient(const ConvParams& p, int64_t images, const half_t* columns, float* grad_weights) const;
  // grad_columns [len, taps * C_in] (float32, rows ld apart) = the columns' gradient of output pixels
  // [first_pixel, first_pixel + len) of image n (of these images), len <= kPixelTile: each group's grad_output
  // turned into `turned` [len, group_depth] and multiplied by its weight. On the calling thread.
  void column_gradient_tile(const ConvParams& p, int64_t n, int64_t first_pixel, int64_t len, half_t* turned,
                            float* grad_columns, int64_t ld) const;
  // Frees the calling thread's state of `gemm` after its run of column_gradient_tile (release_half_gemm_context).
  void release() const { release_half_gemm_context(gemm); }
};

}  // namespace cpu
}  // namespace deform_conv
