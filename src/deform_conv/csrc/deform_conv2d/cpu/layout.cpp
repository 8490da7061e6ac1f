#include "layout.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <type_traits>

#include "half_conversion.h"
#include "transpose.h"

namespace deform_conv {
namespace cpu {
namespace {

bool is_half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// turn(n, first, len) for every image n and every run of 128 of its pixels [first, first + len), in parallel: a
// run's rows (or columns) of the channels-first side stay in the L1 cache while the other side is written.
template <typename Turn>
void for_pixel_runs(int64_t images, int64_t pixels, const Turn& turn) {
  constexpr int64_t kPixels = 128;
  const int64_t runs = (pixels + kPixels - 1) / kPixels;
  at::parallel_for(0, images * runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / runs, first = task % runs * kPixels;
      turn(n, first, std::min(kPixels, pixels - first));
    }
  });
}

// f(half_t()) for a half type's dtype.
template <typename F>
void with_half_type(at::ScalarType dtype, const F& f) {
  if (dtype == at::kBFloat16) {
    f(c10::BFloat16());
  } else {
    f(c10::Half());
  }
}

}  // namespace

bool channels_last(const at::Tensor& channels_first, at::Tensor& out) {
  const at::ScalarType from = channels_first.scalar_type(), to = out.scalar_type();
  if (channels_first.dim() != 4 || !channels_first.is_contiguous() || out.sizes() != channels_first.sizes() ||
      !out.is_contiguous(at::MemoryFormat::ChannelsLast) ||
      !((from == to && (to == at::kFloat || is_half(to))) || (is_half(from) && to == at::kFloat))) {
    return false;
  }
  const int64_t channels = out.size(1), pixels = out.size(2) * out.size(3);
  // Image n's [C, P] from column `first`, into its [P, C] from row `first`.
  const auto turn = [&](const auto* src, auto* dst) {
    for_pixel_runs(out.size(0), pixels, [&](int64_t n, int64_t first, int64_t len) {
      transpose(src + n * channels * pixels + first, channels, len, pixels, dst + (n * pixels + first) * channels,
                channels);
    });
  };
  if (from == at::kFloat) {
    turn(channels_first.const_data_ptr<float>(), out.mutable_data_ptr<float>());
  } else {
    with_half_type(from, [&](auto half) {
      using half_t = decltype(half);
      if (to == at::kFloat) {
        turn(channels_first.const_data_ptr<half_t>(), out.mutable_data_ptr<float>());
      } else {
        turn(channels_first.const_data_ptr<half_t>(), out.mutable_data_ptr<half_t>());
      }
    });
  }
  return true;
}

at::Tensor in_channels_last(const at::Tensor& t, at::ScalarType dtype, ChannelsLastAllocator allocate) {
  if (t.scalar_type() == dtype && t.is_contiguous(at::MemoryFormat::ChannelsLast)) return t;
  const at::TensorOptions options = t.options().dtype(dtype);
  at::Tensor turned = allocate != nullptr ? allocate(t.sizes(), options)
                                          : at::empty(t.sizes(), options, at::MemoryFormat::ChannelsLast);
  if (!channels_last(t, turned)) turned.copy_(t);
  return turned;
}

bool channels_first(const at::Tensor& channels_last, at::Tensor& out, const float* add_per_channel) {
  const at::ScalarType from = channels_last.scalar_type(), to = out.scalar_type();
  if (out.dim() != 4 || !channels_last.is_contiguous() || !out.is_contiguous() ||
      channels_last.numel() != out.numel() ||
      !((from == at::kFloat && (to == at::kFloat || is_half(to))) || (is_half(to) && from == to)) ||
      (add_per_channel != nullptr && from != at::kFloat)) {
    return false;
  }
  const int64_t channels = out.size(1), pixels = out.size(2) * out.size(3);
  // Image n's [P, C] from row `first`, into its [C, P] from column `first`.
  const auto at_run = [&](int64_t n, int64_t first) {
    return std::pair<int64_t, int64_t>((n * pixels + first) * channels, n * channels * pixels + first);
  };
  // Into out_t: from float32 (rows_to_channels_first), or a half type's bits moved as they are.
  const auto turn = [&](auto out_type) {
    using out_t = decltype(out_type);
    out_t* dst = out.mutable_data_ptr<out_t>();
    for_pixel_runs(out.size(0), pixels, [&](int64_t n, int64_t first, int64_t len) {
      const auto [s, d] = at_run(n, first);
      if constexpr (!std::is_same_v<out_t, float>) {
        if (from == to) {
          transpose(channels_last.const_data_ptr<out_t>() + s, len, channels, channels, dst + d, pixels);
          return;
        }
      }
      rows_to_channels_first(channels_last.const_data_ptr<float>() + s, len, channels, add_per_channel, dst + d,
                             pixels);
    });
  };
  if (to == at::kFloat) {
    turn(float());
  } else {
    with_half_type(to, turn);
  }
  return true;
}

template <typename out_t>
void rows_to_channels_first(const float* rows, int64_t len, int64_t channels, const float* add, out_t* out,
                            int64_t ld_out) {
  if constexpr (std::is_same_v<out_t, float>) {
    transpose(rows, len, channels, channels, out, ld_out, add);
  } else {
    transpose_narrowing(rows, len, channels, channels, out, ld_out, add);
  }
}

template void rows_to_channels_first<float>(const float*, int64_t, int64_t, const float*, float*, int64_t);
template void rows_to_channels_first<c10::BFloat16>(const float*, int64_t, int64_t, const float*, c10::BFloat16*,
                                                    int64_t);
template void rows_to_channels_first<c10::Half>(const float*, int64_t, int64_t, const float*, c10::Half*, int64_t);

at::Tensor float32_contiguous(const at::Tensor& t) {
  if (!is_half(t.scalar_type()) || !t.is_contiguous()) return t.to(at::kFloat).contiguous();
  at::Tensor wide = at::empty(t.sizes(), t.options().dtype(at::kFloat));
  with_half_type(t.scalar_type(), [&](auto half) {
    using half_t = decltype(half);
    const half_t* src = t.const_data_ptr<half_t>();
    float* dst = wide.mutable_data_ptr<float>();
    at::parallel_for(0, t.numel(), int64_t(1) << 14, [&](int64_t begin, int64_t end) {
      widen(src + begin, end - begin, dst + begin);
    });
  });
  return wide;
}

}  // namespace cpu
}  // namespace deform_conv
