// The CPU kernels' parallel loops and torch's thread count.
#pragma once

#include <ATen/Parallel.h>

#if defined(__clang__) && defined(_OPENMP)
#include <omp.h>
#endif

namespace deform_conv {

// With GCC the library runs its parallel loops on the OpenMP runtime torch loaded (_compile.link_flags), which
// torch.set_num_threads sets. Clang emits calls only LLVM's runtime has, so a Clang build has a runtime of its
// own: give it torch's thread count on every call, which is per calling thread and cheap to set.
inline void follow_torch_thread_count() {
#if defined(__clang__) && defined(_OPENMP)
  const int threads = at::get_num_threads();
  if (omp_get_max_threads() != threads) omp_set_num_threads(threads);
#endif
}

}  // namespace deform_conv
