// The few things a kernel needs from the machine it runs on: thread and block indices, warp shuffles, atomics and
// the launch. Kernel bodies use nothing else device-specific, so the same source also compiles with the host
// compiler against the CUDA simulation (cuda_simulation/simt.h), which executes it on the CPU for the tests
// (deform_conv.testing.load_cuda_simulation). Kernel side only (the .cu files): no ATen, no c10/cuda, so that
// nvcc parses little more than cuda_runtime.h; what a launch needs from torch (the device guard, the current
// stream, the launch check) is host code's, cuda/host.h.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "launch.h"

#ifndef DEFORM_CONV_CUDA_SIMULATION

#include <cuda_runtime.h>

#define DC_KERNEL __global__
#define DC_DEVICE __device__ __forceinline__

namespace deform_conv {
namespace cuda {

// Each lane gets `value` of lane (its lane ^ delta); every lane of the warp takes part.
template <typename T>
DC_DEVICE T warp_xor(T value, int delta) {
  return __shfl_xor_sync(0xffffffffu, value, delta);
}

// The kernels add atomically only in their accumulation type (opmath_type): float or double. atomicAdd on double
// needs sm_60, older than every arch we build for.
template <typename T>
DC_DEVICE void atomic_add(T* address, T value) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "atomic adds are float or double");
  atomicAdd(address, value);
}

// The one place a kernel is launched. The host code that called the launcher checks the launch (cuda/host.h).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), const LaunchConfig& config, Args&&... args) {
  kernel<<<static_cast<unsigned>(config.blocks), config.threads, 0, config.stream>>>(std::forward<Args>(args)...);
}

}  // namespace cuda
}  // namespace deform_conv

#else  // the simulation

#include "../cuda_simulation/simt.h"

#endif
