#include "half_gemm.h"

#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <type_traits>
#include <utility>
#include <vector>

#include "brgemm.h"
#include "transpose.h"

namespace deform_conv {
namespace cpu {
namespace {

// Rows of the weight per GEMM call: kDepthBlock, as for float32 (brgemm.h); each block is packed on its own, so
// the call for a block reads one packed matrix whatever oneDNN's layout. Columns of a packed panel: at most
// kPanelWidth.

#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(CPUBLAS_BRGEMM_F16F16F32)
#define DC_HALF_BRGEMM 1
#endif

template <typename half_t>
void brgemm_call(int64_t m, int64_t n, int64_t k, int64_t ld_a, int64_t ld_b, int64_t ld_c, bool add_c,
                 const half_t* a, const half_t* b, float* c, bool vnni) {
#ifdef DC_HALF_BRGEMM
  at::native::cpublas::brgemm(m, n, k, ld_a, ld_b, ld_c, add_c, a, b, c, vnni);
#else
  TORCH_CHECK(false, "deform_conv: ATen has no half-precision batch-reduce GEMM (torch < 2.9)");
#endif
}

// One candidate's answer on a product whose every sum is exact in float32: small integers, which both half
// types hold exactly. A wrong layout mixes rows and columns and gives other sums.
template <typename half_t>
bool computes_exactly(const HalfGemm& gemm) {
  constexpr int64_t m = 3, n = 16, k = 6;
  std::vector<half_t> a(m * k), b(k * n), packed(k * packed_width(n));
  std::vector<float> expected(m * n, 0.f), c(m * n, -1.f);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < k; ++r) a[i * k + r] = half_t(float((i + 1) * (r % 4) - 3 + r));
  }
  for (int64_t r = 0; r < k; ++r) {
    for (int64_t j = 0; j < n; ++j) b[r * n + j] = half_t(float((j % 7) - 3 + 2 * r));
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t r = 0; r < k; ++r) expected[i * n + j] += float(a[i * k + r]) * float(b[r * n + j]);
    }
  }
  try {
    pack_weight_panel(gemm, k, n, b.data(), n, packed.data());
    half_gemm_on_this_thread(gemm, m, n, k, a.data(), k, packed.data(), c.data(), n, /*accumulate=*/false);
    release_half_gemm_context(gemm);
  } catch (const std::exception&) {  // ATen or oneDNN refuses: it cannot run this layout here (oneDNN's errors are
    return false;                    // not c10::Error: "could not generate a kernel" with its ISA limited)
  }
  return c == expected;
}

// Whether ATen packs a panel for `gemm` (Layout::aten_packed) in VNNI pairs: panels of a whole depth block and of
// a short one, at each packed width, compared bit for bit.
template <typename half_t>
bool aten_packs_vnni_pairs(const HalfGemm& gemm) {
  for (const auto [k, width] : {std::pair<int64_t, int64_t>{kDepthBlock, 16}, {kDepthBlock, 24}, {kDepthBlock, 40},
                                {kDepthBlock, 64}, {6, 64}, {72, 40}}) {
    const int64_t ld = packed_width(width);
    std::vector<half_t> b(k * width), packed(k * ld), expected(k * ld, half_t(0.f));
    for (int64_t r = 0; r < k; ++r) {
      for (int64_t j = 0; j < width; ++j) {
        b[r * width + j] = half_t(float((r * 7 + j * 3) % 251 - 125));  // exact in both half types
        expected[r / 2 * 2 * ld + 2 * j + r % 2] = b[r * width + j];
      }
    }
    try {
      pack_weight_panel(gemm, k, width, b.data(), width, packed.data());
    } catch (const std::exception&) {
      return false;
    }
    if (std::memcmp(packed.data(), expected.data(), packed.size() * sizeof(half_t)) != 0) return false;
  }
  return true;
}

// Whether this CPU's cores run AVX512-BF16's dot products of pairs at twice float32's multiply-add rate, so that
// bfloat16 GEMMs on its microkernels outrun float32's: AMD's (Zen 4 and later; every AMD core with AVX512-BF16).
// On a 2-core Zen 4 EPYC, conv2d and matmul ran 1.9-2.5 times as fast in bfloat16 as in float32, and our bfloat16
// layers on these microkernels 1.5-2.2 times our float32 forward (benchmarks/results/cpu_bfloat16_zen4.md).
// Intel's cores run them at float32's rate: on a Sapphire Rapids Xeon with oneDNN limited to AVX512-BF16
// (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), bfloat16 layers on them ran at 0.60-0.77 times float32's speed forward and
// 0.63-0.93 forward+backward, where the float32 path ran them at 0.77-1.02 and 0.83-0.95
// (benchmarks/results/cpu_bfloat16_avx512bf16.md).
[[maybe_unused]] bool pairs_outrun_float32_here() {  // (unused where ATen has no half brgemm)
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  if (std::strcmp(vendor, "AuthenticAMD") != 0 || eax < 7) return false;
  if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) == 0) return false;
  return ((eax >> 5) & 1u) != 0;  // CPUID.(EAX=7, ECX=1):EAX[5], AVX512_BF16
#else
  return false;
#endif
}

template <typename half_t>
HalfGemm probe() {
  // AMX (AMX-FP16 for float16), with ATen packing for it.
  HalfGemm amx{HalfGemm::Layout::aten_packed, true};
  if (computes_exactly<half_t>(amx)) {
    amx.packs_vnni_pairs = aten_packs_vnni_pairs<half_t>(amx);
    return amx;
  }
  // Without AMX, bfloat16 on AVX512-BF16's microkernels where they outrun float32 (above), the weight in VNNI pairs
  // (ATen packs only for AMX). Not float16 on AVX512-FP16's: on the Sapphire Rapids Xeon, oneDNN limited to them,
  // float16 layers took 1.4-1.9 times as long as in float32.
  if constexpr (std::is_same_v<half_t, c10::BFloat16>) {
    const HalfGemm pairs{HalfGemm::Layout::vnni_pairs, true, true};
    if (pairs_outrun_float32_here() && computes_exactly<half_t>(pairs)) return pairs;
  }
  return {};
}

}  // namespace

HalfGemmChoice half_gemm_choice() {
  const char* value = std::getenv("DEFORM_CONV_CPU_HALF_GEMM");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return HalfGemmChoice::automatic;
  if (std::strcmp(value, "float32") == 0) return HalfGemmChoice::float32;
  if (std::strcmp(value, "portable") == 0) return HalfGemmChoice::portable;
  TORCH_CHECK(false, "deform_conv: DEFORM_CONV_CPU_HALF_GEMM must be auto, float32 or portable, got '", value, "'");
}

HalfGemm half_gemm_for(c10::ScalarType dtype) {
  TORCH_CHECK(dtype == c10::kBFloat16 || dtype == c10::kHalf, "deform_conv: half_gemm_for(", dtype, ")");
  switch (half_gemm_choice()) {
    case HalfGemmChoice::float32:
      return {};
    case HalfGemmChoice::portable:
      return {HalfGemm::Layout::plain, false};
    case HalfGemmChoice::automatic:
      break;
  }
#if defined(DC_HALF_BRGEMM) && (defined(__x86_64__) || defined(_M_X64))
  // oneDNN off (torch.backends.mkldnn.enabled = False): ATen would not call it; probed the first time it is on.
  if (!at::hasMKLDNN() || !at::globalContext().userEnabledMkldnn()) return {};
  if (dtype == c10::kBFloat16) {
    static const HalfGemm bfloat16 = probe<c10::BFloat16>();
    return bfloat16;
  }
  static const HalfGemm float16 = probe<c10::Half>();
  return float16;
#else
  return {};
#endif
}

std::string cpu_half_path(c10::ScalarType dtype) {
  TORCH_CHECK(dtype == c10::kBFloat16 || dtype == c10::kHalf,
              "cpu_half_path: dtype must be torch.bfloat16 or torch.float16, got ", dtype);
  const std::string name = dtype == c10::kBFloat16 ? "bfloat16" : "float16";
  const HalfGemm gemm = half_gemm_for(dtype);
  switch (gemm.layout) {
    case HalfGemm::Layout::aten_packed:
      return name + ": native, " + name + " GEMMs on oneDNN's AMX microkernels (weights packed " +
             (gemm.packs_vnni_pairs ? "in VNNI pairs, as ATen packs them)" : "by ATen)");
    case HalfGemm::Layout::vnni_pairs:
      return name + ": native, " + name + " GEMMs on oneDNN's AVX512-BF16 microkernels (weights in VNNI pairs; " +
             "AMD's cores run their dot products of pairs at twice float32's multiply-add rate)";
    case HalfGemm::Layout::plain:
      return name + ": " + name + " GEMMs on ATen's portable GEMM (DEFORM_CONV_CPU_HALF_GEMM=portable)";
    case HalfGemm::Layout::none:
      break;
  }
  if (half_gemm_choice() == HalfGemmChoice::float32) {
    return name + ": computed in float32 (DEFORM_CONV_CPU_HALF_GEMM=float32)";
  }
  if (dtype == c10::kBFloat16) {
    return name + ": computed in float32 (no native bfloat16 GEMM here: it needs AMX, or AVX512-BF16 on AMD's cores, "
                  "and oneDNN on; AVX512-BF16's microkernels on Intel's cores ran slower than float32)";
  }
  return name + ": computed in float32 (no native float16 GEMM here: it needs AMX-FP16 and oneDNN on; AVX512-FP16's "
                "microkernels ran slower than float32)";
}

int64_t packed_width(int64_t width) { return (width + 15) / 16 * 16; }

namespace {

// b [k, width] (half_t, leading dimension ld_b) in VNNI pairs at `packed` ([even(k) / 2, ld] 32-bit words: row 2i's
// element j in the low half of word (i, j), row 2i + 1's in the high half), zero past k rows and width columns: one
// pass over the rows where they lie, a word at a time. (Element by element through a staged copy, the packing of
// the backward's columns for the weight's gradient took 10% of the CPU time of S1's bfloat16 forward+backward on the
// Zen 4 EPYC; so, S1 forward+backward 4% faster, G1 and S3 2%.)
template <typename half_t>
void pack_pairs_of_rows(int64_t k, int64_t width, const half_t* b, int64_t ld_b, int64_t ld, half_t* packed) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed) % sizeof(uint32_t) == 0,
              "deform_conv: pack_pairs_of_rows needs a packed panel aligned to 4 bytes");
  uint32_t* words = reinterpret_cast<uint32_t*>(packed);
  for (int64_t i = 0; i < even(k) / 2; ++i) {
    const uint16_t* __restrict__ low = reinterpret_cast<const uint16_t*>(b + 2 * i * ld_b);
    uint32_t* __restrict__ out = words + i * ld;
    if (2 * i + 1 < k) {
      const uint16_t* __restrict__ high = reinterpret_cast<const uint16_t*>(b + (2 * i + 1) * ld_b);
      for (int64_t j = 0; j < width; ++j) out[j] = uint32_t(low[j]) | uint32_t(high[j]) << 16;
    } else {
      for (int64_t j = 0; j < width; ++j) out[j] = low[j];
    }
    std::fill(out + width, out + ld, 0u);
  }
}

}  // namespace

template <typename half_t>
void pack_weight_panel(const HalfGemm& gemm, int64_t k, int64_t width, const half_t* b, int64_t ld_b, half_t* packed) {
  TORCH_CHECK(width <= kPanelWidth, "deform_conv: pack_weight_panel(width=", width, ")");
  const int64_t ld = packed_width(width);
  switch (gemm.layout) {
    case HalfGemm::Layout::vnni_pairs:
      pack_pairs_of_rows(k, width, b, ld_b, ld, packed);
      return;
    case HalfGemm::Layout::plain:  // the rows as they are, zero past k rows (to pairs) and width columns
      for (int64_t r = 0; r < even(k); ++r) {
        half_t* to = packed + r * ld;
        if (r < k) {
          std::copy(b + r * ld_b, b + r * ld_b + width, to);
        } else {
          std::fill(to, to + width, half_t(0.f));
        }
        std::fill(to + width, to + ld, half_t(0.f));
      }
      return;
    case HalfGemm::Layout::aten_packed:
      break;
    case HalfGemm::Layout::none:
      TORCH_CHECK(false, "deform_conv: no half-precision GEMM to pack for");
  }
  // ATen's packing. Where it packs blocks of an even number of rows as wide as the packed panel, it reads them where
  // they lie and writes every element of the panel; otherwise the panel starts from zeros, and each block of rows is
  // first copied to [even(rows), width], the row past an odd k zero.
  const bool packs_in_place = k % 2 == 0 && width == ld;
  if (!packs_in_place) std::fill(packed, packed + even(k) * ld, half_t(0.f));
  thread_local std::vector<half_t> staged;
  staged.resize(kDepthBlock * kPanelWidth);
  constexpr at::ScalarType kType = c10::CppTypeToScalarType<half_t>::value;
  for (int64_t k0 = 0; k0 < k; k0 += kDepthBlock) {
    const int64_t rows = std::min(kDepthBlock, k - k0), padded = even(rows);
    if (packs_in_place) {
      at::native::cpublas::pack(rows, width, ld_b, ld, kType, kType, b + k0 * ld_b, packed + k0 * ld);
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      std::copy(b + (k0 + r) * ld_b, b + (k0 + r) * ld_b + width, staged.data() + r * width);
    }
    std::fill(staged.data() + rows * width, staged.data() + padded * width, half_t(0.f));
    at::native::cpublas::pack(padded, width, width, ld, kType, kType, staged.data(), packed + k0 * ld);
  }
}

template <typename half_t>
void pack_panel_columns(const HalfGemm& gemm, int64_t k, int64_t count, const half_t* rows, int64_t ld_rows,
                        int64_t j0, int64_t ld, half_t* packed) {
  TORCH_CHECK(gemm.packs_vnni_pairs && j0 + count <= ld && ld <= packed_width(kPanelWidth) && k % 2 == 0 &&
                  ld_rows % 2 == 0 && reinterpret_cast<uintptr_t>(rows) % sizeof(uint32_t) == 0 &&
                  reinterpret_cast<uintptr_t>(packed) % sizeof(uint32_t) == 0,
              "deform_conv: pack_panel_columns(k=", k, ", count=", count, ", ld_rows=", ld_rows, ", j0=", j0,
              ", ld=", ld, ")");
  uint32_t* words = reinterpret_cast<uint32_t*>(packed);
  const int64_t padded_to = std::min(ld, packed_width(j0 + count));
  if (j0 + count < padded_to) {
    for (int64_t r = 0; r < k / 2; ++r) std::fill(words + r * ld + j0 + count, words + r * ld + padded_to, 0u);
  }
  transpose(reinterpret_cast<const uint32_t*>(rows), count, k / 2, ld_rows / 2, words + j0, ld);
}

template <typename half_t>
void half_gemm_on_this_thread(const HalfGemm& gemm, int64_t m, int64_t n, int64_t k, const half_t* a, int64_t ld_a,
                              const half_t* packed, float* c, int64_t ld_c, bool accumulate) {
  const int64_t ld = packed_width(n);
  for (int64_t k0 = 0; k0 < k; k0 += kDepthBlock) {
    brgemm_call(m, n, std::min(kDepthBlock, k - k0), ld_a, ld, ld_c, accumulate || k0 > 0, a + k0, packed + k0 * ld, c,
                gemm.vnni);
  }
}

void release_half_gemm_context(const HalfGemm& gemm) {
#ifdef DC_HALF_BRGEMM
  if (gemm.vnni) at::native::cpublas::brgemm_release(/*is_vnni=*/true);
#endif
}

#define DEFORM_CONV_INSTANTIATE(T)                                                                          \
  template void pack_weight_panel<T>(const HalfGemm&, int64_t, int64_t, const T*, int64_t, T*);            \
  template void pack_panel_columns<T>(const HalfGemm&, int64_t, int64_t, const T*, int64_t, int64_t, int64_t, T*); \
  template void half_gemm_on_this_thread<T>(const HalfGemm&, int64_t, int64_t, int64_t, const T*, int64_t,  \
                                            const T*, float*, int64_t, bool);
DEFORM_CONV_INSTANTIATE(c10::BFloat16)
DEFORM_CONV_INSTANTIATE(c10::Half)
#undef DEFORM_CONV_INSTANTIATE

}  // namespace cpu
}  // namespace deform_conv
