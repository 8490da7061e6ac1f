#include "scratch.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/MemoryFormat.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/accumulate.h>

#include <atomic>

namespace deform_conv {
namespace cpu {
namespace {

std::atomic<int64_t> kept_bytes{0};

// Freed with its thread (the memory comes from c10::alloc_cpu, not from torch's allocator objects, which may
// be gone by the time the last thread exits).
struct KeptBuffer {
  void* data = nullptr;
  int64_t bytes = 0;
  KeptBuffer() = default;
  KeptBuffer(const KeptBuffer&) = delete;
  KeptBuffer& operator=(const KeptBuffer&) = delete;
  ~KeptBuffer() { release(); }

  void release() {
    c10::free_cpu(data);
    kept_bytes -= bytes;
    data = nullptr;
    bytes = 0;
  }

  void* at_least(int64_t wanted) {
    if (wanted > bytes) {
      release();
      data = c10::alloc_cpu(wanted);  // throws on failure, leaving the buffer empty
      bytes = wanted;
      kept_bytes += bytes;
    }
    return data;
  }
};

constexpr int kSlots = 6;

}  // namespace

void* scratch_bytes(ScratchSlot slot, int64_t bytes) {
  TORCH_CHECK(bytes <= kMaxKeptScratchBytes, "deform_conv: scratch request of ", bytes, " bytes is over the bound");
  thread_local KeptBuffer kept[kSlots];
  return kept[static_cast<int>(slot)].at_least(bytes);
}

at::Tensor scratch(ScratchSlot slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
  const int64_t bytes = c10::multiply_integers(sizes) * static_cast<int64_t>(options.dtype().itemsize());
  if (bytes == 0 || bytes > kMaxKeptScratchBytes) return at::empty(sizes, options, at::MemoryFormat::ChannelsLast);
  return at::from_blob(scratch_bytes(slot, bytes), sizes, c10::get_channels_last_strides_2d(sizes), options);
}

int64_t kept_scratch_bytes() { return kept_bytes.load(); }

}  // namespace cpu
}  // namespace deform_conv
