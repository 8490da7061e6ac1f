// What the CPU kernels of every op share: the instruction sets their inner loops are compiled for, and torch's
// thread count.
#pragma once

#include <ATen/Parallel.h>

#include <type_traits>

#if defined(__clang__) && defined(_OPENMP)
#include <omp.h>
#endif

// The kernels' loops over a range of rows or tasks are compiled three times, for baseline x86-64, AVX2 and
// AVX-512, and the dynamic loader picks the best for the CPU it runs on (an ifunc): the library stays one
// portable binary (a prebuilt cache entry may be copied to another machine) yet uses wide vectors. `flatten`
// inlines every call in each copy (the helpers, and the lambdas they take), so the inner loops are compiled for
// that copy's instruction set: without it the compiler may keep a helper out of line, compiled once for
// baseline x86-64, and the wide copies would only wrap it.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define DC_CPU_DISPATCH __attribute__((target_clones("default", "avx2", "avx512f"), flatten))
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
// loops stay loops, not calls), while the other dtypes get the DC_CPU_DISPATCH clones: float64 serves exact checks
// and gradcheck, not speed, and two more copies of every kernel cost seconds of every build (the results are the
// same: no copy reorders any arithmetic). The kernel is written as the template `name##_body<scalar_t>(...)`;
// DC_CPU_KERNEL(name) defines `name<scalar_t>(...)`. Its arguments are passed on by value (pointers, the small
// parameter structs), so that a pointer passed as an lvalue and one computed in the call do not instantiate two
// copies of the kernel.
#define DC_CPU_KERNEL(name)                                                                                  \
  template <typename scalar_t, typename... Args>                                                             \
  DC_CPU_DISPATCH void name##_cloned(Args... args) {                                                         \
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
      name##_cloned<scalar_t>(args...);                                                                      \
    }                                                                                                        \
  }

namespace deform_conv {

// With GCC the library runs its parallel loops on the OpenMP runtime torch loaded (_jit/compile.py: link_flags), which
// torch.set_num_threads sets. Clang emits calls only LLVM's runtime has, so a Clang build has a runtime of its
// own: give it torch's thread count on every call, which is per calling thread and cheap to set.
inline void follow_torch_thread_count() {
#if defined(__clang__) && defined(_OPENMP)
  const int threads = at::get_num_threads();
  if (omp_get_max_threads() != threads) omp_set_num_threads(threads);
#endif
}

}  // namespace deform_conv
