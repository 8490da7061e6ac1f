// Scratch memory for the CPU kernels' internal buffers (the driver's column buffer, its channels-last copy of the input
// and, in the half types' backward, the columns' gradient; the tiled passes' tiles and images; the depthwise passes'
// images), kept per thread from call to call: by the calling thread, and by each worker thread of the tiled and the
// depthwise passes (a tile and an image: a few MiB each, up to kMaxKeptScratchBytes for the half types' whole-image
// tiles and the tiled backward's tiles of large layers). Buffers of a few MiB that are allocated and freed on every
// call are handed back to the kernel by malloc (its heap is trimmed once the freed top exceeds a threshold) and mapped
// anew on the next call; the page faults of touching them again cost a tenth of a forward. Kept: at most
// kMaxKeptScratchBytes per slot and thread; larger requests get fresh memory.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../columns_driver.h"

namespace deform_conv {
namespace cpu {

constexpr int64_t kMaxKeptScratchBytes = int64_t(32) << 20;

// A channels-last tensor of `sizes` in this thread's buffer for `slot`; valid until the thread asks for the
// same slot again. It must not outlive the op's call.
at::Tensor scratch(ScratchSlot slot, at::IntArrayRef sizes, const at::TensorOptions& options);

// This thread's buffer for `slot`, of at least `bytes` (at most kMaxKeptScratchBytes); valid until the thread
// asks for the same slot again.
void* scratch_bytes(ScratchSlot slot, int64_t bytes);

// What all threads keep now, in bytes (torch.ops.deform_conv.kept_scratch_bytes()).
int64_t kept_scratch_bytes();

}  // namespace cpu
}  // namespace deform_conv
