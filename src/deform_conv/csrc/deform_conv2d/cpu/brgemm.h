// GEMMs on ATen's batch-reduce GEMM for float32 (at::native::cpublas::brgemm: oneDNN's microkernels, each call
// on the calling thread alone), and the CPU backward's GEMMs built from it (and from the half types' GEMMs). Called per tile from our own parallel
// loops, they find their operands in cache; on the 2-core EPYC of the benchmarks they reach about 110 GFLOP/s
// per core, where MKL's sgemm reaches 80-95.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../conv_params.h"

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

}  // namespace cpu
}  // namespace deform_conv
