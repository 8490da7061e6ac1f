// The simulation library's registration: the schemas again in namespace deform_conv_sim (schemas.h), the
// simulation's own two ops, and every op's CUDA backend (cuda/impl_ops.h: the CUDA library's host code, compiled
// here against the simulation) for CPU tensors. The one unit of the simulation library that sees torch/library.h.
#include <torch/library.h>

#include "../cuda/impl_ops.h"
#include "../schemas.h"
#include "simt.h"

namespace {

void configure(int64_t int32_limit, bool shuffle_blocks, int64_t seed, int64_t budget_bytes, int64_t max_blocks,
               bool level_checks) {
  TORCH_CHECK(int32_limit >= 1 && int32_limit <= (int64_t(1) << 30), "int32_limit must be in [1, 2^30], got ",
              int32_limit);
  TORCH_CHECK(budget_bytes >= 0, "budget_bytes must be >= 0, got ", budget_bytes);
  TORCH_CHECK(max_blocks >= 0, "max_blocks must be >= 0, got ", max_blocks);
  deform_conv::sim::options() = {int32_limit, shuffle_blocks, static_cast<uint64_t>(seed), budget_bytes, max_blocks,
                                 level_checks};
  deform_conv::sim::restart_block_orders();
}

}  // namespace

TORCH_LIBRARY(deform_conv_sim, m) {
  for (const char* schema : deform_conv::kSchemas) m.def(schema);
  m.def("configure(int int32_limit, bool shuffle_blocks, int seed, int budget_bytes, int max_blocks, "
        "bool level_checks) -> ()",
        &configure);
  // [launches, blocks, threads, shuffles, launches with 32-bit indices, launches with 64-bit indices] so far.
  m.def("statistics() -> int[]", &deform_conv::sim::counts);
}

TORCH_LIBRARY_IMPL(deform_conv_sim, CPU, m) { deform_conv::cuda::impl_ops(m); }
