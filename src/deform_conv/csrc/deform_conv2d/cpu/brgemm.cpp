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

}  // namespace

FloatBackwardFactors::FloatBackwardFactors(const ConvParams& p, const at::Tensor& grad_output, int64_t first,
                                           int64_t images, const at::Tensor& weight_matrix)
    : grad_out(grad_output.narrow(0, first, images).contiguous()),
      weight(weight_matrix.contiguous()) {}

void FloatBackwardFactors::add_weight_gradient(const ConvParams& p, int64_t images, const float* columns,
                                               float* grad_weights) const {
  const int64_t pixels = p.out_pixels(), row = p.taps() * p.in_channels;
  const int64_t per_group = p.taps() * p.in_channels_per_group();
  const float* grad = grad_out.const_data_ptr<float>();
  // grad_weights[c, k] += sum over images n and pixels of grad_output[n, c, pixel] * columns[n, pixel, g, k],
  // for output channel c of group g. Each task owns a block of rows and a panel of columns of grad_weights.
  const WeightGradientTasks tasks(p);
  at::parallel_for(0, tasks.count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const auto [g, c0, rows, k0, width] = tasks.task(task);
      for (int64_t n = 0; n < images; ++n) {
        gemm_on_this_thread(rows, width, pixels, grad + (n * p.out_channels + c0) * pixels, pixels,
                            columns + n * pixels * row + g * per_group + k0, row, grad_weights + c0 * per_group + k0,
                            per_group, /*accumulate=*/true);
      }
    }
    release_gemm_context();
  });
}

void FloatBackwardFactors::column_gradient_tile(const ConvParams& p, int64_t n, int64_t first_pixel, int64_t len,
                                                float* turned, float* grad_columns, int64_t ld) const {
  const int64_t pixels = p.out_pixels(), per_group = p.taps() * p.in_channels_per_group();
  const int64_t out_per_group = p.out_channels_per_group();
  transpose(grad_out.const_data_ptr<float>() + n * p.out_channels * pixels + first_pixel, p.out_channels, len, pixels,
            turned, p.out_channels);
  for (int64_t g = 0; g < p.groups; ++g) {
    gemm_on_this_thread(len, per_group, out_per_group, turned + g * out_per_group, p.out_channels,
                        weight.const_data_ptr<float>() + g * out_per_group * per_group, per_group,
                        grad_columns + g * per_group, ld, /*accumulate=*/false);
  }
}

bool FloatBackwardFactors::apply(const ConvParams& p) {
  return batch_reduce_gemm_works() && kPixelTile * turned_per_pixel(p) * int64_t(sizeof(float)) <= kMaxKeptScratchBytes;
}

// The half types' tile holds one group's grad_output.
bool half_backward_gemms_fit(const ConvParams& p) {
  return kPixelTile * even(p.out_channels_per_group()) * int64_t(sizeof(uint16_t)) <= kMaxKeptScratchBytes;
}

template <typename half_t>
HalfBackwardFactors<half_t>::HalfBackwardFactors(const ConvParams& p, const HalfGemm& gemm_,
                                                 const at::Tensor& grad_output, int64_t first, int64_t images,
                                                 const at::Tensor& weight_matrix)
    : gemm(gemm_), depth(even(p.out_pixels())), group_depth(even(p.out_channels_per_group())),
      panels(ceil_div(p.taps() * p.in_channels_per_group(), kPanelWidth)),
      slot(group_depth * packed_width(kPanelWidth)) {
  const int64_t pixels = p.out_pixels(), per_group = p.taps() * p.in_channels_per_group();
  const int64_t out_per_group = p.out_channels_per_group();
  grad_out = grad_output.narrow(0, first, images).contiguous().view({images, p.out_channels, pixels});
  if (depth != pixels) {
    at::Tensor padded = grad_out.new_zeros({images, p.out_channels, depth});
    padded.narrow(2, 0, pixels).copy_(grad_out);
    grad_out = padded;
  }
  const at::Tensor weight_c = weight_matrix.contiguous();
  weight = weight_c.new_empty({p.groups * panels * slot});
  at::parallel_for(0, p.groups * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / panels, n0 = t % panels * kPanelWidth;
      pack_weight_panel(gemm, out_per_group, std::min(kPanelWidth, per_group - n0),
                        weight_c.const_data_ptr<half_t>() + g * out_per_group * per_group + n0, per_group,
                        weight.mutable_data_ptr<half_t>() + t * slot);
    }
  });
}

template <typename half_t>
void HalfBackwardFactors<half_t>::add_weight_gradient(const ConvParams& p, int64_t images, const half_t* columns,
                                                      float* grad_weights) const {
  const int64_t pixels = p.out_pixels(), row = p.taps() * p.in_channels;
  const int64_t per_group = p.taps() * p.in_channels_per_group();
  const half_t* grad = grad_out.const_data_ptr<half_t>();
  const WeightGradientTasks tasks(p);
  at::parallel_for(0, tasks.count, 1, [&](int64_t begin, int64_t end) {
    half_t* packed = static_cast<half_t*>(
        scratch_bytes(ScratchSlot::half_factors, kDepthBlock * packed_width(kWeightPanel) * int64_t(sizeof(half_t))));
    for (int64_t task = begin; task < end; ++task) {
      const auto [g, c0, rows, k0, width] = tasks.task(task);
      for (int64_t n = 0; n < images; ++n) {
        for (int64_t p0 = 0; p0 < pixels; p0 += kDepthBlock) {
          const int64_t block = std::min(kDepthBlock, pixels - p0);
          pack_weight_panel(gemm, block, width, columns + (n * pixels + p0) * row + g * per_group + k0, row, packed);
          half_gemm_on_this_thread(gemm, rows, width, even(block), grad + (n * p.out_channels + c0) * depth + p0,
                                   depth, packed, grad_weights + c0 * per_group + k0, per_group, /*accumulate=*/true);
        }
      }
    }
    release_half_gemm_context(gemm);
  });
}

template <typename half_t>
void HalfBackwardFactors<half_t>::column_gradient_tile(const ConvParams& p, int64_t n, int64_t first_pixel,
                                                       int64_t len, half_t* turned, float* grad_columns,
                                                       int64_t ld) const {
  const int64_t out_per_group = p.out_channels_per_group(), per_group = p.taps() * p.in_channels_per_group();
  const half_t* grad = grad_out.const_data_ptr<half_t>();
  const half_t* packed = weight.const_data_ptr<half_t>();
  for (int64_t g = 0; g < p.groups; ++g) {
    transpose(grad + (n * p.out_channels + g * out_per_group) * depth + first_pixel, out_per_group, len, depth,
              turned, group_depth);
    if (group_depth > out_per_group) {
      for (int64_t i = 0; i < len; ++i) turned[i * group_depth + out_per_group] = half_t(0.f);
    }
    for (int64_t n0 = 0; n0 < per_group; n0 += kPanelWidth) {
      half_gemm_on_this_thread(gemm, len, std::min(kPanelWidth, per_group - n0), group_depth, turned, group_depth,
                               packed + (g * panels + n0 / kPanelWidth) * slot, grad_columns + g * per_group + n0, ld,
                               /*accumulate=*/false);
    }
  }
}

template struct HalfBackwardFactors<c10::BFloat16>;
template struct HalfBackwardFactors<c10::Half>;

namespace {

// The backward's two GEMMs on `factors` (FloatBackwardFactors, HalfBackwardFactors), in tasks that each own their
// results: the weight's gradient from `columns`, then the columns' gradient into grad_columns (float32's overwrite
// their columns), each task a tile of kPixelTile pixels of one image.
template <typename Factors, typename column_t>
void backward_gemms_in_tasks(const ConvParams& p, const Factors& factors, int64_t images, const column_t* columns,
                             float* grad_columns, float* grad_weights) {
  factors.add_weight_gradient(p, images, columns, grad_weights);
  const int64_t pixels = p.out_pixels(), row = p.taps() * p.in_channels, tiles = ceil_div(pixels, kPixelTile);
  at::parallel_for(0, images * tiles, 1, [&](int64_t begin, int64_t end) {
    using turned_t = typename Factors::turned_t;
    turned_t* turned = static_cast<turned_t*>(
        scratch_bytes(ScratchSlot::tile, kPixelTile * factors.turned_per_pixel(p) * int64_t(sizeof(turned_t))));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / tiles, first_pixel = task % tiles * kPixelTile;
      factors.column_gradient_tile(p, n, first_pixel, std::min(kPixelTile, pixels - first_pixel), turned,
                                   grad_columns + (n * pixels + first_pixel) * row, row);
    }
    factors.release();
  });
}

}  // namespace

bool backward_gemms(const ConvParams& p, const at::Tensor& grad_output, int64_t first, int64_t images,
                    const at::Tensor& weight_matrix, const at::Tensor& columns, at::Tensor& grad_columns,
                    at::Tensor& grad_weights) {
  TORCH_INTERNAL_ASSERT(columns.is_same(grad_columns), "deform_conv: float32 columns are their own gradient");
  if (grad_output.scalar_type() != at::kFloat || grad_weights.scalar_type() != at::kFloat ||
      !FloatBackwardFactors::apply(p)) {
    return false;
  }
  float* cols = grad_columns.mutable_data_ptr<float>();  // the columns, overwritten by their gradient
  backward_gemms_in_tasks(p, FloatBackwardFactors(p, grad_output, first, images, weight_matrix), images, cols, cols,
                          grad_weights.mutable_data_ptr<float>());
  return true;
}

template <typename half_t>
bool half_backward_gemms(const ConvParams& p, const at::Tensor& grad_output, int64_t first, int64_t images,
                         const at::Tensor& weight_matrix, const at::Tensor& columns, at::Tensor& grad_columns,
                         at::Tensor& grad_weights) {
  const at::ScalarType dtype = c10::CppTypeToScalarType<half_t>::value;
  const HalfGemm gemm = half_gemm_for(dtype);
  if (grad_output.scalar_type() != dtype || weight_matrix.scalar_type() != dtype ||
      grad_weights.scalar_type() != at::kFloat || columns.scalar_type() != dtype ||
      grad_columns.scalar_type() != at::kFloat || !HalfBackwardFactors<half_t>::apply(p, gemm)) {
    return false;
  }
  backward_gemms_in_tasks(p, HalfBackwardFactors<half_t>(p, gemm, grad_output, first, images, weight_matrix), images,
                          columns.const_data_ptr<half_t>(), grad_columns.mutable_data_ptr<float>(),
                          grad_weights.mutable_data_ptr<float>());
  return true;
}

template bool half_backward_gemms<c10::BFloat16>(const ConvParams&, const at::Tensor&, int64_t, int64_t,
                                                 const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&);
template bool half_backward_gemms<c10::Half>(const ConvParams&, const at::Tensor&, int64_t, int64_t,
                                             const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&);

}  // namespace cpu
}  // namespace deform_conv
