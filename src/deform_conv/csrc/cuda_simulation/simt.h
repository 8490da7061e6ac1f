// The CUDA simulation: what cuda/execution.cuh provides on a GPU, provided on the CPU, so that the CUDA kernels'
// own source runs in the tests on machines without a GPU. A test facility only: the simulation library is built
// on request (deform_conv.testing.load_cuda_simulation) into a cache entry of its own from the CUDA backend's own
// host code and kernels, and registers its ops as torch.ops.deform_conv_sim.* on CPU tensors (ops_sim.cpp).
// simt.cpp also defines cuda/host.h's functions for the simulation (its knobs: Options). No torch header here: the
// kernels include it, as they include execution.cuh on a GPU.
//
// Execution model (simt.cpp): the blocks of a grid run one after another, in order or in a seeded random order;
// each thread of a block is a fiber of its own, run until it finishes or reaches a warp shuffle. A shuffle
// completes when all 32 lanes of the warp have reached it with the same lane mask and value size, and any other
// state is an error, as it would be undefined on a GPU: lanes that have exited, a partial warp, lanes at different
// shuffles. CUDA's launch limits are checked at every launch.
#pragma once

#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

#include "../cuda/launch.h"

namespace deform_conv {
namespace sim {

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct ThreadState {
  dim3 thread, block, block_dim, grid_dim;
};

// The simulated thread whose code runs now: set by the scheduler whenever it switches fibers.
extern thread_local const ThreadState* current_thread;

struct Options {
  int64_t int32_limit = int64_t(1) << 30;  // the 32-bit index path below this many elements (as on the GPU)
  bool shuffle_blocks = false;             // blocks, and warps within a block, in a seeded random order
  uint64_t seed = 0;
  int64_t budget_bytes = 0;                // > 0: replaces the GPU's chunk budget
  int64_t max_blocks = 0;                  // > 0: at most this many blocks a launch (grid-stride loops loop)
  bool level_checks = true;                // the host code's device-side check of level metadata
};
Options& options();

// Lane (lane ^ delta)'s `bytes` bytes at `value` replace this lane's.
void exchange_xor(void* value, int bytes, int delta);

// Runs `body` as every thread of every block of the grid. Checks CUDA's launch limits first.
void run_grid(int64_t blocks, int64_t threads, const std::function<void()>& body);

// Shuffled block orders start again from the seed (configure calls it).
void restart_block_orders();

// [launches, blocks, threads, shuffles, launches with 32-bit indices, launches with 64-bit indices] so far (the
// tests check that both index widths run).
std::vector<int64_t> counts();

}  // namespace sim
}  // namespace deform_conv

#define DC_KERNEL
#define DC_DEVICE inline
#define threadIdx (::deform_conv::sim::current_thread->thread)
#define blockIdx (::deform_conv::sim::current_thread->block)
#define blockDim (::deform_conv::sim::current_thread->block_dim)
#define gridDim (::deform_conv::sim::current_thread->grid_dim)

namespace deform_conv {
namespace cuda {

template <typename T>
inline T warp_xor(T value, int delta) {
  static_assert(sizeof(T) <= 8, "CUDA shuffles move at most 8 bytes");
  sim::exchange_xor(&value, sizeof(T), delta);
  return value;
}

// Fibers switch only at shuffles, so a plain addition is atomic here. (Float or double, as on a GPU.)
template <typename T>
inline void atomic_add(T* address, T value) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "atomic adds are float or double");
  *address += value;
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), const LaunchConfig& config, Args&&... args) {
  sim::run_grid(config.blocks, config.threads, [&] { kernel(args...); });
}

}  // namespace cuda
}  // namespace deform_conv
