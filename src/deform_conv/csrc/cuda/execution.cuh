// The few things a kernel needs from the machine it runs on: thread and block indices, warp shuffles, atomics,
// the launch, the device guard and the registration. Kernel bodies use nothing else device-specific, so the same
// source also compiles with the host compiler against the CUDA simulation (cuda_simulation/simt.h), which
// executes it on the CPU for the tests (deform_conv.testing.load_cuda_simulation).
#pragma once

#include <cstdint>

#ifndef DEFORM_CONV_CUDA_SIMULATION

#include <ATen/cuda/Atomic.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#define DC_KERNEL __global__
#define DC_DEVICE __device__ __forceinline__

namespace deform_conv {
namespace cuda {

using DeviceGuard = c10::cuda::CUDAGuard;

// Each lane gets `value` of lane (its lane ^ delta); every lane of the warp takes part.
template <typename T>
DC_DEVICE T warp_xor(T value, int delta) {
  return __shfl_xor_sync(0xffffffffu, value, delta);
}

template <typename T>
DC_DEVICE void atomic_add(T* address, T value) {
  gpuAtomicAdd(address, value);
}

// Below this many elements in every tensor a kernel indexes, it runs its index arithmetic in 32 bits.
inline int64_t int32_index_limit() { return int64_t(1) << 30; }
inline void note_index_bits(int) {}  // counted by the simulation only
// The memory budget of a chunk (the simulation may lower it, so that small tests take many chunks).
inline int64_t budget_bytes(int64_t gpu_budget) { return gpu_budget; }
// The blocks a launch gets (the simulation may cap them, so that grid-stride loops run more than once).
inline int64_t grid_blocks(int64_t blocks) { return blocks; }

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int64_t blocks, int threads, Args&&... args) {
  kernel<<<static_cast<unsigned>(blocks), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace deform_conv

#define DC_REGISTER_CUDA_KERNELS(m) TORCH_LIBRARY_IMPL(deform_conv, CUDA, m)

#else  // the simulation

#include "../cuda_simulation/simt.h"

#endif
