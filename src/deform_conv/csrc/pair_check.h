// The check of a (height, width) argument -- kernel size, stride, padding, dilation -- for every op that takes one.
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace deform_conv {

inline void check_pair(c10::IntArrayRef pair, const char* name, int64_t minimum) {
  TORCH_CHECK(pair.size() == 2, name, " must be a pair (height, width), got ", pair);
  TORCH_CHECK(pair[0] >= minimum && pair[1] >= minimum, name, " must be >= ", minimum, " in both dimensions, got ",
              pair);
}

}  // namespace deform_conv
