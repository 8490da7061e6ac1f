// The half types' GEMMs (bfloat16 and float16 factors, float32 sums) on ATen's batch-reduce GEMM, where it runs
// them on oneDNN's microkernels faster than float32's: AMX (AMX-FP16 for float16), and for bfloat16 AVX512-BF16 on
// AMD's cores (half_gemm.cpp's probe says where they ran slower: AVX512-BF16 on Intel's cores, AVX512-FP16). Whether
// the CPU has them, and whether ATen packs the weight for AMX in VNNI pairs, is decided once per process by running
// them on a small product whose result is known exactly: where oneDNN refuses or computes anything else, the half
// types are computed in float32 as before (deform_conv_cpu.cpp).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace deform_conv {
namespace cpu {

// DEFORM_CONV_CPU_HALF_GEMM, read on every call: "auto" (or unset) takes the native path where the CPU has one;
// "float32" computes the half types in float32 everywhere; "portable" takes the half path even without native
// microkernels, its GEMMs on ATen's portable half-precision GEMM -- slow, for tests of the path on any CPU.
enum class HalfGemmChoice { automatic, float32, portable };
HalfGemmChoice half_gemm_choice();

// How this process multiplies half-type factors, for one dtype.
struct HalfGemm {
  // none: no native GEMM here, the half types run in float32; aten_packed: AMX, the weight packed by ATen;
  // vnni_pairs: AVX512-BF16 (bfloat16 on AMD's cores), the weight in VNNI pairs packed here; plain: ATen's portable
  // GEMM (DEFORM_CONV_CPU_HALF_GEMM=portable).
  enum class Layout { none, aten_packed, vnni_pairs, plain };
  Layout layout = Layout::none;
  bool vnni = false;  // passed to ATen's brgemm: whether it may run oneDNN's microkernels
  // Whether a packed panel holds the rows in VNNI pairs, element (r, j) at r/2 * 2ld + 2j + r%2 (ld its packed
  // width): Layout::vnni_pairs, and ATen's packing for AMX where the probe finds that it writes them so.
  bool packs_vnni_pairs = false;
  bool uses_native_path() const { return layout != Layout::none; }
};

// The GEMM the next call of a `dtype` (kBFloat16 or kHalf) layer uses: probed once, but following
// DEFORM_CONV_CPU_HALF_GEMM and torch.backends.mkldnn.enabled on every call.
HalfGemm half_gemm_for(c10::ScalarType dtype);

// What half_gemm_for says, in words naming the instruction set: torch.ops.deform_conv.cpu_half_path(dtype), which
// `deform-conv doctor` prints.
std::string cpu_half_path(c10::ScalarType dtype);

// The weight's leading dimension in its packed form: the panel's width rounded up to 16 (oneDNN's packing takes
// 16, 32, 48 or 64; panels are at most 64 wide).
int64_t packed_width(int64_t width);

// Rows of the packed weight: the depth rounded up to pairs.
inline int64_t even(int64_t k) { return k + k % 2; }

// b [k, width] (row-major, leading dimension ld_b) into `packed` [even(k), packed_width(width)] in the layout `gemm`
// reads, zero past k rows and width columns.
template <typename half_t>
void pack_weight_panel(const HalfGemm& gemm, int64_t k, int64_t width, const half_t* b, int64_t ld_b, half_t* packed);

// Columns [j0, j0 + count) of a packed panel (its packed width ld, at `packed`) from their rows `rows` [count, k]
// (leading dimension ld_rows; k and ld_rows even), where gemm.packs_vnni_pairs: each pair of the panel's rows is
// then a column of rows' 32-bit words, and one transpose of those words packs them, bit for bit as
// pack_weight_panel would. Columns past j0 + count up to the next multiple of 16 (the packing's padding, for the
// last columns of a panel) are zeroed.
template <typename half_t>
void pack_panel_columns(const HalfGemm& gemm, int64_t k, int64_t count, const half_t* rows, int64_t ld_rows,
                        int64_t j0, int64_t ld, half_t* packed);

// c[m, n] = a[m, k] x packed[k, n] (or c += with `accumulate`), k even, a row-major with leading dimension ld_a,
// `packed` from pack_weight_panel or pack_panel_columns, c float32; on the calling thread.
template <typename half_t>
void half_gemm_on_this_thread(const HalfGemm& gemm, int64_t m, int64_t n, int64_t k, const half_t* a, int64_t ld_a,
                              const half_t* packed, float* c, int64_t ld_c, bool accumulate);

// Frees a thread's GEMM state (AMX's tile configuration) once its run of GEMMs ends, as ATen asks.
void release_half_gemm_context(const HalfGemm& gemm);

}  // namespace cpu
}  // namespace deform_conv
