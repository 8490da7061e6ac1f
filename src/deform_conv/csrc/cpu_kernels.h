// What the CPU kernels of every op share: the instruction sets their inner loops are compiled for, and torch's
// thread count.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <type_traits>

#if defined(__clang__) && defined(_OPENMP)
#include <omp.h>
#endif

// The kernels' loops over a range of rows or tasks are compiled for the widest vectors the CPU has, and
// `flatten` inlines every call into them (the helpers, and the lambdas they take), so that the inner loops are
// compiled for that instruction set: without it the compiler may keep a helper out of line, compiled for baseline
// x86-64, and the wide loop would only call it. Which instruction set, DC_CPU_VECTOR_BITS says (the loader sets
// it: _jit/variant.py):
// - unset: the portable library (`deform-conv build --portable`, the install-time build). Each loop is compiled
//   three times, for baseline x86-64, AVX2 and AVX-512, and the dynamic loader picks the best for the CPU it runs
//   on (an ifunc): an entry copied to any x86-64 machine runs there with its widest vectors.
// - 512, 256 or 128: the library built for the machine it runs on (what `import deform_conv` builds). Each loop
//   is compiled once, for AVX-512, AVX2 or baseline x86-64: a third of the code to generate, so a shorter build.
//   512 with DC_CPU_AVX512_BF16: AVX-512 with AVX512-BF16, whose instruction rounds floats to bfloat16 (cpu_lanes.h).
//   The loader loads such a library only on a CPU with that instruction set; begin_cpu_call() makes any other
//   caller get an error, not an illegal instruction.
// The copies for different instruction sets give the same bits: a sum over channels is taken in the 16 lanes
// cpu_lanes.h fixes, not in as many as a vector holds (an omp simd reduction would), and no loop is contracted
// (-ffp-contract=off).
// (Clang compiles the library for one instruction set as GCC does, but no portable library: it makes no copies.)
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#if !defined(DC_CPU_VECTOR_BITS) && !defined(__clang__)
#define DC_CPU_DISPATCH __attribute__((target_clones("default", "avx2", "avx512f"), flatten))
#elif !defined(DC_CPU_VECTOR_BITS)
#define DC_CPU_DISPATCH
#elif DC_CPU_VECTOR_BITS == 512 && defined(DC_CPU_AVX512_BF16)
// The loops are compiled for AVX-512 alone, and store_lanes issues AVX512-BF16's two instructions itself
// (cpu_lanes.h): naming AVX512-BF16 in the target turns on AVX512BW too, with which GCC 12 left the family's
// bfloat16 loops scalar (DCNv3's bfloat16 forward ran 1.8x slower).
#define DC_CPU_ISA "avx512f"
#define DC_CPU_ISA_NAME "avx512f, avx512bw, avx512dq, avx512vl and avx512bf16"
#define DC_CPU_HAS_ISA                                                                                     \
  (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&                               \
   __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&                              \
   __builtin_cpu_supports("avx512bf16"))
#elif DC_CPU_VECTOR_BITS == 512
#define DC_CPU_ISA "avx512f"
#elif DC_CPU_VECTOR_BITS == 256
#define DC_CPU_ISA "avx2"
#elif DC_CPU_VECTOR_BITS != 128
#error "DC_CPU_VECTOR_BITS must be 512, 256 or 128"
#endif
#if defined(DC_CPU_ISA) && !defined(DC_CPU_HAS_ISA)
#define DC_CPU_HAS_ISA __builtin_cpu_supports(DC_CPU_ISA)
#define DC_CPU_ISA_NAME DC_CPU_ISA
#endif
#if defined(DC_CPU_ISA)
#define DC_CPU_DISPATCH __attribute__((target(DC_CPU_ISA), flatten))
#elif !defined(DC_CPU_DISPATCH)
#define DC_CPU_DISPATCH __attribute__((flatten))
#endif
#else
#define DC_CPU_DISPATCH
#endif

// `flatten` alone: every call inlined, for the compiler's baseline instruction set.
#if defined(__GNUC__)
#define DC_FLATTEN __attribute__((flatten))
#else
#define DC_FLATTEN
#endif

// A kernel whose float64 instantiation is compiled once, for baseline x86-64 (flattened all the same: its inner
// loops stay loops, not calls), while the other dtypes get DC_CPU_DISPATCH's wide copies: float64 serves exact
// checks and gradcheck, not speed, more copies of every kernel cost seconds of every build, and one copy gives the
// same bits on every x86-64 CPU. The kernel is written as the template `name##_body<scalar_t>(...)`;
// DC_CPU_KERNEL(name) defines `name<scalar_t>(...)`. Its arguments are passed on by value (pointers, the small
// parameter structs), so that a pointer passed as an lvalue and one computed in the call do not instantiate two
// copies of the kernel.
#define DC_CPU_KERNEL(name)                                                                                  \
  template <typename scalar_t, typename... Args>                                                             \
  DC_CPU_DISPATCH void name##_wide(Args... args) {                                                           \
    name##_body<scalar_t>(args...);                                                                          \
  }                                                                                                          \
  template <typename scalar_t, typename... Args>                                                             \
  DC_FLATTEN void name##_once(Args... args) {                                                                \
    name##_body<scalar_t>(args...);                                                                          \
  }                                                                                                          \
  template <typename scalar_t, typename... Args>                                                             \
  void name(Args... args) {                                                                                  \
    if constexpr (std::is_same_v<scalar_t, double>) {                                                        \
      name##_once<scalar_t>(args...);                                                                        \
    } else {                                                                                                 \
      name##_wide<scalar_t>(args...);                                                                        \
    }                                                                                                        \
  }

namespace deform_conv {

// What every CPU entry point of an op does first, before any of its kernels runs:
// - In a library compiled for one instruction set (DC_CPU_ISA), it raises on a CPU without that instruction set
//   instead of executing an illegal instruction.
// - With GCC the library runs its parallel loops on the OpenMP runtime torch loaded (_jit/compile.py: link_flags),
//   which torch.set_num_threads sets. Clang emits calls only LLVM's runtime has, so a Clang build has a runtime of
//   its own: it is given torch's thread count on every call, which is per calling thread and cheap to set.
inline void begin_cpu_call() {
#if defined(DC_CPU_ISA)
  static const bool supported = DC_CPU_HAS_ISA;
  TORCH_CHECK(supported, "deform_conv: this library's CPU kernels were compiled for " DC_CPU_ISA_NAME ", which this CPU "
              "does not have. Remedy: import deform_conv on this machine to build its own (or copy an entry built "
              "with `deform-conv build --portable`, which runs on any x86-64 CPU).");
#endif
#if defined(__clang__) && defined(_OPENMP)
  const int threads = at::get_num_threads();
  if (omp_get_max_threads() != threads) omp_set_num_threads(threads);
#endif
}

}  // namespace deform_conv
