// Images turned to channels-last by the thread that reads them. The CPU passes read the input channels-last; turned
// whole up front by all threads (layout.h's in_channels_last), a copy of the input's size goes to memory and comes
// back, where a thread that turns the image its tasks read just before reading it keeps it in its cache. The
// depthwise forward of S4, H6 and H7 (6-8 images of 64-128 channels) ran 14-21% faster by median so, 8-18% by
// minimum, and forward+backward 4-14%, on 2 threads of a 2-core Zen 3 EPYC whose memory other machines share.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <type_traits>

#include "scratch.h"
#include "transpose.h"

namespace deform_conv {
namespace cpu {

// The most bytes of an image a thread turns itself; it keeps the buffer (scratch.h), so the bound is per worker
// thread.
constexpr int64_t kMaxTurnedImageBytes = int64_t(4) << 20;

// Whether each thread turns the images its tasks read itself, rather than the input be turned whole up front: where
// `input` [B, C, H, W] is contiguous (and not channels-last already), has at least as many images as threads (most
// images are then one thread's alone: an image whose tasks two threads share is turned by both), and an image of it in
// `element_bytes`-byte values is at most kMaxTurnedImageBytes.
inline bool turns_per_thread(const at::Tensor& input, int64_t element_bytes) {
  const int64_t image_size = input.size(1) * input.size(2) * input.size(3);
  return input.is_contiguous() && !input.is_contiguous(at::MemoryFormat::ChannelsLast) &&
         input.size(0) >= at::get_num_threads() && image_size * element_bytes <= kMaxTurnedImageBytes;
}

// Image n of `images` [B, C, H, W] (contiguous) into `turned` [H * W, C], on this thread: of the same type (float32
// or a half type), or a half type widened to float32.
template <typename scalar_t, typename image_t>
void turn_image(const image_t* images, int64_t n, int64_t channels, int64_t pixels, scalar_t* turned) {
  transpose(images + n * channels * pixels, channels, pixels, pixels, turned, channels);
}

// Where a pass's tasks read the input channels-last: turned whole up front (`whole`, [B, H, W, C]), or, with `whole`
// nullptr, image by image from `channels_first` (the input, [B, C, H, W], contiguous, of `dtype`: float32 or a half
// type, widened as it is turned) by the threads that read them (TaskImages). Only float32 passes take the second.
template <typename scalar_t>
struct InputImages {
  const scalar_t* whole;
  const void* channels_first;
  at::ScalarType dtype;
  int64_t channels, pixels;

  static InputImages turned_up_front(const at::Tensor& input_cl) {
    return {input_cl.const_data_ptr<scalar_t>(), nullptr, input_cl.scalar_type(), input_cl.size(1),
            input_cl.size(2) * input_cl.size(3)};
  }
  static InputImages turned_per_thread(const at::Tensor& input) {
    return {nullptr, input.const_data_ptr(), input.scalar_type(), input.size(1), input.size(2) * input.size(3)};
  }
};

// Image n of the input channels-last, [H * W, C], as one task's loop reads it: a pointer into the input turned up
// front, or the image turned into the thread's scratch buffer for `slot` when the task comes to it (and again only
// when it moves on to another image).
template <typename scalar_t>
class TaskImages {
 public:
  TaskImages(const InputImages<scalar_t>& images, ScratchSlot slot) : images_(images) {
    if (images.whole == nullptr) {
      TORCH_INTERNAL_ASSERT((std::is_same_v<scalar_t, float>), "deform_conv: only float32 passes turn images");
      buffer_ = static_cast<scalar_t*>(
          scratch_bytes(slot, images.channels * images.pixels * static_cast<int64_t>(sizeof(scalar_t))));
    }
  }

  const scalar_t* image(int64_t n) {
    const int64_t channels = images_.channels, pixels = images_.pixels;
    if (images_.whole != nullptr) return images_.whole + n * channels * pixels;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (n != turned_) {
        const void* from = images_.channels_first;
        switch (images_.dtype) {
          case at::kBFloat16:
            turn_image(static_cast<const c10::BFloat16*>(from), n, channels, pixels, buffer_);
            break;
          case at::kHalf:
            turn_image(static_cast<const c10::Half*>(from), n, channels, pixels, buffer_);
            break;
          case at::kFloat:
            turn_image(static_cast<const float*>(from), n, channels, pixels, buffer_);
            break;
          default:
            TORCH_INTERNAL_ASSERT(false, "deform_conv: no per-thread turn of a ", images_.dtype, " image");
        }
        turned_ = n;
      }
    }
    return buffer_;
  }

 private:
  InputImages<scalar_t> images_;
  scalar_t* buffer_ = nullptr;
  int64_t turned_ = -1;
};

}  // namespace cpu
}  // namespace deform_conv
