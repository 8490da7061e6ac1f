#include "brgemm.h"

#include <ATen/core/Tensor.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <string>

#include "half_gemm.h"
#include "scratch.h"
#include "transpose.h"

namespace deform_conv {
namespace cpu {
namespace {

// The grad_weights GEMM's tasks: blocks of output channels (at most this many) by panels of weight columns.
// Each task reads its panel of the columns in full, so the columns are read once per block of output channels:
// the blocks are as large as leave every thread 4 tasks, down to 32 channels. (With 8 tasks a thread, S1's 64
// output channels were cut in two blocks on two threads, and its columns read twice: its backward took 20-22 ms
// there against 17.4-17.6 ms with one block, 9 tasks.)
constexpr int64_t kMaxWeightRowBlock = 256;
constexpr int64_t kMinWeightRowBlock = 32;
constexpr int64_t kWeightPanel = 64;

// The columns-gradient GEMM's tasks: tiles of this many pixels.
constexpr int64_t kPixelTile = 128;

void gemm_block(int64_t m, int64_t n, int64_t k, const float* a, int64_t ld_a, const float* b, int64_t ld_b, float* c,
                int64_t ld_c, bool accumulate) {
#ifdef CPUBLAS_BRGEMM_F32F32F32
  at::native::cpublas::brgemm(m, n, k, ld_a, ld_b, ld_c, /*add_C=*/accumulate, a, b, c, /*is_vnni=*/false);
#else
  TORCH_CHECK(false, "deform_conv: ATen has no float32 batch-reduce GEMM (batch_reduce_gemm_works is false)");
#endif
}

}  // namespace

bool batch_reduce_gemm_works() {
#if defined(CPUBLAS_BRGEMM_F32F32F32) && (defined(__x86_64__) || defined(_M_X64))
  // ATen's float32 brgemm runs oneDNN's microkernels where oneDNN is built in and enabled and the CPU has AVX2
  // (ATen's own dispatch level, which ATEN_CPU_CAPABILITY may lower); elsewhere it falls back to one BLAS call
  // per tile, a slow way to do a GEMM.
  if (!at::hasMKLDNN() || !at::globalContext().userEnabledMkldnn()) return false;
  static const bool wide_vectors = [] {
    const std::string capability = at::get_cpu_capability();
    return capability == "AVX2" || capability == "AVX512";
  }();
  return wide_vectors;
#else
  return false;
#endif
}

void gemm_on_this_thread(int64_t m, int64_t n, int64_t k, const float* a, int64_t ld_a, const float* b,
                         int64_t ld_b, float* c, int64_t ld_c, bool accumulate) {
  if (k == 0 && !accumulate) {
    for (int64_t i = 0; i < m; ++i) std::fill(c + i * ld_c, c + i * ld_c + n, 0.f);
    return;
  }
  for (int64_t k0 = 0; k0 < k; k0 += kDepthBlock) {
    gemm_block(m, n, std::min(kDepthBlock, k - k0), a + k0, ld_a, b + k0 * ld_b, ld_b, c, ld_c, accumulate || k0 > 0);
  }
}

void release_gemm_context() {
#ifdef CPUBLAS_BRGEMM_F32F32F32
  at::native::cpublas::brgemm_release(/*is_vnni=*/false);
#endif
}

namespace {

// The grad_weights GEMM's tasks: (group, block of rows, panel of columns) of grad_weights [C_out, taps * C_in/G].
struct WeightGradientTasks {
  struct Task {
    int64_t group, first_row, rows, first_column, width;
  };
  int64_t out_per_group, per_group, panels, row_block, row_blocks, count;

  explicit WeightGradientTasks(const ConvParams& p)
      : out_per_group(p.out_channels_per_group()), per_group(p.taps() * p.in_channels_per_group()),
        panels(ceil_div(per_group, kWeightPanel)), row_block(std::min(kMaxWeightRowBlock, out_per_group)) {
    while (row_block > kMinWeightRowBlock &&
           p.groups * ceil_div(out_per_group, row_block) * panels < 4 * at::get_num_threads()) {
      row_block = ceil_div(row_block, 2);
    }
    row_blocks = ceil_div(out_per_group, row_block);
    count = p.groups * row_blocks * panels;
  }
  Task task(int64_t t) const {
    const int64_t g = t / (row_blocks * panels), c0 = g * out_per_group + t / panels % row_blocks * row_block;
    const int64_t k0 = t % panels * kWeightPanel;
    return {g, c0, std::min(row_block, (g + 1) * out_per_group - c0), k0, std::min(kWeightPanel, per_group - k0)};
  }
};

// The backward's two GEMMs, in tasks that each own their results, with `multiply(m, n, k, a, ld_a, b, ld_b, c,
// ld_c, accumulate)` (float32 operands and sums, on the calling thread) and `release()` at the end of each
// thread's run.
template <typename Multiply, typename Release>
void backward_gemms_in_tasks(const ConvParams& p, const at::Tensor& grad_output, int64_t first, int64_t images,
                             const at::Tensor& weight_matrix, at::Tensor& columns, at::Tensor& grad_weights,
                             const Multiply& multiply, const Release& release) {
  const at::Tensor grad_out_c = grad_output.narrow(0, first, images).contiguous();  // [images, C_out, pixels]
  const at::Tensor weight_c = weight_matrix.contiguous();                           // [C_out, taps * C_in/G]
  const float* grad_out = grad_out_c.const_data_ptr<float>();
  const float* weight = weight_c.const_data_ptr<float>();
  float* cols = columns.mutable_data_ptr<float>();      // [images, pixels, groups, taps * C_in/G]
  float* grad_w = grad_weights.mutable_data_ptr<float>();  // [C_out, taps * C_in/G]
  const int64_t pixels = p.out_pixels(), row = p.taps() * p.in_channels;
  const int64_t per_group = p.taps() * p.in_channels_per_group(), out_per_group = p.out_channels_per_group();

  // grad_weights[c, k] += sum over images n and pixels of grad_output[n, c, pixel] * columns[n, pixel, g, k],
  // for output channel c of group g. Each task owns a block of rows and a panel of columns of grad_weights.
  const WeightGradientTasks tasks(p);
  at::parallel_for(0, tasks.count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const auto [g, c0, rows, k0, width] = tasks.task(task);
      for (int64_t n = 0; n < images; ++n) {
        multiply(rows, width, pixels, grad_out + (n * p.out_channels + c0) * pixels, pixels,
                 cols + n * pixels * row + g * per_group + k0, row, grad_w + c0 * per_group + k0, per_group,
                 /*accumulate=*/true);
      }
    }
    release();
  });

  // columns[n, pixel, g, :] = sum over output channels c of group g of grad_output[n, c, pixel] * weight[c, :].
  // Each task owns a tile of pixels of one image, whose grad_output it first turns to [pixel, C_out].
  const int64_t tiles = ceil_div(pixels, kPixelTile);
  at::parallel_for(0, images * tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t turned_bytes = kPixelTile * p.out_channels * int64_t(sizeof(float));
    float* turned = static_cast<float*>(scratch_bytes(ScratchSlot::tile, turned_bytes));  // [pixel, C_out]
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / tiles, first_pixel = task % tiles * kPixelTile;
      const int64_t len = std::min(kPixelTile, pixels - first_pixel);
      transpose(grad_out + n * p.out_channels * pixels + first_pixel, p.out_channels, len, pixels, turned,
                p.out_channels);
      for (int64_t g = 0; g < p.groups; ++g) {
        multiply(len, per_group, out_per_group, turned + g * out_per_group, p.out_channels,
                 weight + g * out_per_group * per_group, per_group,
                 cols + (n * pixels + first_pixel) * row + g * per_group, row, /*accumulate=*/false);
      }
    }
    release();
  });
}

// The tile of grad_output must fit in scratch memory: up to 65536 output channels.
bool grad_output_tile_fits(const ConvParams& p) {
  return kPixelTile * p.out_channels * int64_t(sizeof(float)) <= kMaxKeptScratchBytes;
}

// The half types' tile holds one group's grad_output.
bool half_grad_output_tile_fits(const ConvParams& p) {
  return kPixelTile * even(p.out_channels_per_group()) * int64_t(sizeof(uint16_t)) <= kMaxKeptScratchBytes;
}

// The same GEMMs on half_t factors, as the layer holds them: the columns as the fill wrote them (each rounded
// once), grad_output and the weight (packed once) in half_t. Each task packs its panel of the columns 512 rows at
// a time as it multiplies them, in blocks of kDepthBlock rows of depth, odd depths padded with a zero, the blocks'
// sums added in order, in float32.
template <typename half_t>
void half_backward_gemms_in_tasks(const ConvParams& p, const HalfGemm& gemm, const at::Tensor& grad_output,
                                  int64_t first, int64_t images, const at::Tensor& weight_matrix,
                                  const at::Tensor& columns, at::Tensor& grad_columns, at::Tensor& grad_weights) {
  const int64_t pixels = p.out_pixels(), row = p.taps() * p.in_channels, depth = even(pixels);
  const int64_t per_group = p.taps() * p.in_channels_per_group(), out_per_group = p.out_channels_per_group();
  // [images, C_out, depth]: the rows the grad_weights GEMM reads, a zero past an odd pixel count (a copy then).
  at::Tensor grad_out_h = grad_output.narrow(0, first, images).contiguous().view({images, p.out_channels, pixels});
  if (depth != pixels) {
    at::Tensor padded = grad_out_h.new_zeros({images, p.out_channels, depth});
    padded.narrow(2, 0, pixels).copy_(grad_out_h);
    grad_out_h = padded;
  }
  // Each group's weight [C_out/G, taps * C_in/G] as panels of kPanelWidth columns, packed over all its rows.
  const at::Tensor weight_c = weight_matrix.contiguous();
  const int64_t panels = ceil_div(per_group, kPanelWidth), slot = even(out_per_group) * packed_width(kPanelWidth);
  at::Tensor weight_packed = weight_c.new_empty({p.groups * panels * slot});
  at::parallel_for(0, p.groups * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / panels, n0 = t % panels * kPanelWidth;
      pack_weight_panel(gemm, out_per_group, std::min(kPanelWidth, per_group - n0),
                        weight_c.const_data_ptr<half_t>() + g * out_per_group * per_group + n0, per_group,
                        weight_packed.mutable_data_ptr<half_t>() + t * slot);
    }
  });
  const half_t* grad_out = grad_out_h.const_data_ptr<half_t>();
  const half_t* cols_h = columns.const_data_ptr<half_t>();
  const half_t* weight = weight_packed.const_data_ptr<half_t>();
  float* cols = grad_columns.mutable_data_ptr<float>();
  float* grad_w = grad_weights.mutable_data_ptr<float>();

  const WeightGradientTasks tasks(p);
  at::parallel_for(0, tasks.count, 1, [&](int64_t begin, int64_t end) {
    half_t* packed = static_cast<half_t*>(
        scratch_bytes(ScratchSlot::half_factors, kDepthBlock * packed_width(kWeightPanel) * int64_t(sizeof(half_t))));
    for (int64_t task = begin; task < end; ++task) {
      const auto [g, c0, rows, k0, width] = tasks.task(task);
      for (int64_t n = 0; n < images; ++n) {
        for (int64_t p0 = 0; p0 < pixels; p0 += kDepthBlock) {
          const int64_t block = std::min(kDepthBlock, pixels - p0);
          pack_weight_panel(gemm, block, width, cols_h + (n * pixels + p0) * row + g * per_group + k0, row, packed);
          half_gemm_on_this_thread(gemm, rows, width, even(block), grad_out + (n * p.out_channels + c0) * depth + p0,
                                   depth, packed, grad_w + c0 * per_group + k0, per_group, /*accumulate=*/true);
        }
      }
    }
    release_half_gemm_context(gemm);
  });

  // columns[n, pixel, g, :] = grad_output[n, group g's channels, pixel] x weight[g]: each task a tile of pixels of
  // one image, each group's grad_output turned to [pixel, even(C_out/G)], a zero past an odd count.
  const int64_t tiles = ceil_div(pixels, kPixelTile), group_depth = even(out_per_group);
  at::parallel_for(0, images * tiles, 1, [&](int64_t begin, int64_t end) {
    half_t* turned = static_cast<half_t*>(
        scratch_bytes(ScratchSlot::tile, kPixelTile * group_depth * int64_t(sizeof(half_t))));  // [pixel, C_out/G]
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / tiles, first_pixel = task % tiles * kPixelTile;
      const int64_t len = std::min(kPixelTile, pixels - first_pixel);
      for (int64_t g = 0; g < p.groups; ++g) {
        transpose(grad_out + (n * p.out_channels + g * out_per_group) * depth + first_pixel, out_per_group, len,
                  depth, turned, group_depth);
        if (group_depth > out_per_group) {
          for (int64_t i = 0; i < len; ++i) turned[i * group_depth + out_per_group] = half_t(0.f);
        }
        for (int64_t n0 = 0; n0 < per_group; n0 += kPanelWidth) {
          half_gemm_on_this_thread(gemm, len, std::min(kPanelWidth, per_group - n0), group_depth, turned,
                                   group_depth, weight + (g * panels + n0 / kPanelWidth) * slot,
                                   cols + (n * pixels + first_pixel) * row + g * per_group + n0, row,
                                   /*accumulate=*/false);
        }
      }
    }
    release_half_gemm_context(gemm);
  });
}

}  // namespace

bool backward_gemms(const ConvParams& p, const at::Tensor& grad_output, int64_t first, int64_t images,
                    const at::Tensor& weight_matrix, const at::Tensor& columns, at::Tensor& grad_columns,
                    at::Tensor& grad_weights) {
  TORCH_INTERNAL_ASSERT(columns.is_same(grad_columns), "deform_conv: float32 columns are their own gradient");
  if (grad_output.scalar_type() != at::kFloat || grad_weights.scalar_type() != at::kFloat ||
      !grad_output_tile_fits(p) || !batch_reduce_gemm_works()) {
    return false;
  }
  backward_gemms_in_tasks(p, grad_output, first, images, weight_matrix, grad_columns, grad_weights,
                          gemm_on_this_thread, release_gemm_context);
  return true;
}

bool half_backward_gemms_fit(const ConvParams& p) { return half_grad_output_tile_fits(p); }

template <typename half_t>
bool half_backward_gemms(const ConvParams& p, const at::Tensor& grad_output, int64_t first, int64_t images,
                         const at::Tensor& weight_matrix, const at::Tensor& columns, at::Tensor& grad_columns,
                         at::Tensor& grad_weights) {
  const at::ScalarType dtype = c10::CppTypeToScalarType<half_t>::value;
  const HalfGemm gemm = half_gemm_for(dtype);
  if (grad_output.scalar_type() != dtype || weight_matrix.scalar_type() != dtype ||
      grad_weights.scalar_type() != at::kFloat || columns.scalar_type() != dtype ||
      grad_columns.scalar_type() != at::kFloat || !half_grad_output_tile_fits(p) || !gemm.uses_native_path()) {
    return false;
  }
  half_backward_gemms_in_tasks<half_t>(p, gemm, grad_output, first, images, weight_matrix, columns, grad_columns,
                                       grad_weights);
  return true;
}

template bool half_backward_gemms<c10::BFloat16>(const ConvParams&, const at::Tensor&, int64_t, int64_t,
                                                 const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&);
template bool half_backward_gemms<c10::Half>(const ConvParams&, const at::Tensor&, int64_t, int64_t,
                                             const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&);

}  // namespace cpu
}  // namespace deform_conv
