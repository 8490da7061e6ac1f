// cuda/host.h's functions for the CUDA library (cuda_simulation/simt.cpp defines them for the simulation).
#include "host.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

namespace deform_conv {
namespace cuda {

Stream current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void check_launch() { C10_CUDA_KERNEL_LAUNCH_CHECK(); }

int64_t int32_index_limit() { return int64_t(1) << 30; }

void note_index_bits(int) {}

int64_t budget_bytes(int64_t gpu_budget) { return gpu_budget; }

int64_t grid_blocks(int64_t blocks) { return blocks; }

bool level_checks_on_device() { return true; }

}  // namespace cuda
}  // namespace deform_conv
