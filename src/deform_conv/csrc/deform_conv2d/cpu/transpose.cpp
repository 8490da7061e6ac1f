#include "transpose.h"

#include <algorithm>

#include "sampling_point.h"

namespace deform_conv {
namespace cpu {
namespace {

// In blocks of 16 rows of src: the lines they span stay in the L1 cache while every column reads them, and each
// row of dst is written 16 contiguous values at a time; whole 16x16 blocks turned over in registers.
DC_CPU_DISPATCH void transpose_in_blocks(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst,
                                         int64_t ld_dst, const float* add) {
  constexpr int64_t kBlock = 16;
  for (int64_t i0 = 0; i0 < rows; i0 += kBlock) {
    const int64_t block = std::min(kBlock, rows - i0);
    int64_t j0 = 0;
#if defined(__GNUC__)
    for (; block == kBlock && j0 + kBlock <= cols; j0 += kBlock) {
      transpose_block(src + i0 * ld_src + j0, ld_src, add != nullptr ? add + j0 : nullptr, dst + j0 * ld_dst + i0,
                      ld_dst);
    }
#endif
    for (int64_t j = j0; j < cols; ++j) {
      const float* __restrict__ from = src + i0 * ld_src + j;
      float* __restrict__ to = dst + j * ld_dst + i0;
      if (add != nullptr) {
        const float a = add[j];
        for (int64_t i = 0; i < block; ++i) to[i] = from[i * ld_src] + a;
      } else {
        for (int64_t i = 0; i < block; ++i) to[i] = from[i * ld_src];
      }
    }
  }
}

}  // namespace

void transpose(const float* src, int64_t rows, int64_t cols, int64_t ld_src, float* dst, int64_t ld_dst,
               const float* add) {
  transpose_in_blocks(src, rows, cols, ld_src, dst, ld_dst, add);
}

}  // namespace cpu
}  // namespace deform_conv
