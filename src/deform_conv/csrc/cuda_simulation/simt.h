// The CUDA simulation: what cuda/execution.cuh provides on a GPU, provided on the CPU, so that the CUDA kernels'
// own source runs in the tests on machines without a GPU. A test facility only: the simulation library is built
// on request (deform_conv.testing.load_cuda_simulation) into a cache entry of its own, and registers the CUDA
// backend's ops as torch.ops.deform_conv_sim.* on CPU tensors.
//
// Execution model (simt.cpp): the blocks of a grid run one after another, in order or in a seeded random order;
// each thread of a block is a fiber of its own, run until it finishes or reaches a warp shuffle. A shuffle
// completes when all 32 lanes of the warp have reached it with the same lane mask and value size, and any other
// state is an error, as it would be undefined on a GPU: lanes that have exited, a partial warp, lanes at different
// shuffles. CUDA's launch limits are checked at every launch.
#pragma once

#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>

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
};
Options& options();

// Lane (lane ^ delta)'s `bytes` bytes at `value` replace this lane's.
void exchange_xor(void* value, int bytes, int delta);

// Runs `body` as every thread of every block of the grid. Checks CUDA's launch limits first.
void run_grid(int64_t blocks, int64_t threads, const std::function<void()>& body);

// Which index width a launch chose (the tests check that both paths run).
void note_index_bits(int bits);

// Shuffled block orders start again from the seed (configure calls it).
void restart_block_orders();

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

struct DeviceGuard {
  explicit DeviceGuard(const c10::Device&) {}
};

template <typename T>
inline T warp_xor(T value, int delta) {
  static_assert(sizeof(T) <= 8, "CUDA shuffles move at most 8 bytes");
  sim::exchange_xor(&value, sizeof(T), delta);
  return value;
}

// Fibers switch only at shuffles, so a plain addition is atomic here.
template <typename T>
inline void atomic_add(T* address, T value) {
  *address += value;
}

inline int64_t int32_index_limit() { return sim::options().int32_limit; }
inline void note_index_bits(int bits) { sim::note_index_bits(bits); }
inline int64_t budget_bytes(int64_t gpu_budget) {
  return sim::options().budget_bytes > 0 ? sim::options().budget_bytes : gpu_budget;
}
inline int64_t grid_blocks(int64_t blocks) {
  return sim::options().max_blocks > 0 ? std::min(blocks, sim::options().max_blocks) : blocks;
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int64_t blocks, int threads, Args&&... args) {
  sim::run_grid(blocks, threads, [&] { kernel(args...); });
}

}  // namespace cuda
}  // namespace deform_conv

#define DC_REGISTER_CUDA_KERNELS(m) TORCH_LIBRARY_IMPL(deform_conv_sim, CPU, m)
