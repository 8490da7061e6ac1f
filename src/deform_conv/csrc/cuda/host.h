// What the host code of every op's CUDA backend shares (deform_conv2d/cuda/deform_conv_cuda.cpp,
// ms_deform_attn/cuda/ms_deform_attn_cuda.cpp): the dtype dispatch, launch sizes, the index width, and the launch
// itself (on the current stream, then checked). Host code only, compiled by the host compiler; the kernels are
// reached through each op's launchers (its cuda/launchers.h), defined in its .cu.
//
// The same host code runs in the CUDA library and in the CUDA simulation: what differs between the two is the
// handful of functions declared below, defined by cuda/host.cpp on a GPU and by cuda_simulation/simt.cpp in the
// simulation.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "launch.h"

// The dtypes both ops take (the launchers are instantiated for these: launch.h's DC_FOR_EACH_LAUNCH_TYPE).
#define DC_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)

namespace deform_conv {
namespace cuda {

// On a GPU, the CUDA device guard (through c10's device-generic guard, which CUDA's implements); in the simulation,
// whose tensors are on the CPU, the CPU's (a no-op).
using DeviceGuard = c10::DeviceGuard;

// The stream a launch runs on: the current CUDA stream (none in the simulation).
Stream current_stream();
// After every launch: the launch's error, if any, as a torch error (C10_CUDA_KERNEL_LAUNCH_CHECK).
void check_launch();
// Below this many elements in every tensor a kernel indexes, it runs its index arithmetic in 32 bits (2^30 on a
// GPU; the simulation may lower it, so that small tests take the 64-bit path).
int64_t int32_index_limit();
// Which index width a launch chose (counted by the simulation only).
void note_index_bits(int bits);
// The memory budget of a chunk (the simulation may lower it, so that small tests take many chunks).
int64_t budget_bytes(int64_t gpu_budget);
// The blocks a launch gets (the simulation may cap them, so that grid-stride loops run more than once).
int64_t grid_blocks(int64_t blocks);
// Whether the host code checks level metadata on the device (assert_level_values_async): always on a GPU; the
// simulation may skip it, so that the tests reach the kernels' own guard against levels that do not fit.
bool level_checks_on_device();

inline int64_t blocks_for(int64_t threads) {
  // Grid-stride loops cover the rest; 2^20 blocks keep every SM busy on any GPU. (The simulation may cap the grid
  // lower, so that the tests run the loops' later iterations too.)
  return grid_blocks(std::max<int64_t>(1, std::min<int64_t>((threads + kThreads - 1) / kThreads, int64_t(1) << 20)));
}

// The smallest power of two of lanes that covers `vectors` channel vectors, at most a warp.
inline Split split_for(int64_t vectors) {
  int log2 = 0;
  while (log2 < 5 && (int64_t(1) << log2) < vectors) ++log2;
  return Split{log2};
}

// Calls f(int32_t(0)) when every index of a launch fits in 32 bits (`fits_int32`, decided by the op), else
// f(int64_t(0)); the simulation counts which.
template <typename F>
void with_index_width(bool fits_int32, F&& f) {
  if (fits_int32) {
    note_index_bits(32);
    f(int32_t(0));
  } else {
    note_index_bits(64);
    f(int64_t(0));
  }
}

// Runs a launcher (a .cu's: it launches its kernel with the config it is given) with `blocks` blocks of kThreads
// on the current stream, then checks the launch.
template <typename... Params, typename... Args>
void launch_and_check(void (*launcher)(const LaunchConfig&, Params...), int64_t blocks, Args&&... args) {
  launcher(LaunchConfig{blocks, kThreads, current_stream()}, std::forward<Args>(args)...);
  check_launch();
}

}  // namespace cuda
}  // namespace deform_conv
