// The family's ops' C++ checks of their arguments: the backstop behind the Python checks (_ops/<op>/checks.py)
// for direct torch.ops calls, each message naming the argument, what was expected and what was got. Host code.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

namespace deform_conv {
namespace family {

inline void check_dense(const at::Tensor& t, const char* name, int64_t dims, const char* layout) {
  TORCH_CHECK(t.layout() == at::kStrided, name, " must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK(t.dim() == dims, name, " must be ", dims, "-D ", layout, ", got shape ", t.sizes());
}

inline void check_value_dtype(const at::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16, name,
              " must be float16, bfloat16, float32 or float64, got ", dtype);
}

// Coordinates (offsets, locations) and weights: the value's dtype, or float32 beside a float16/bfloat16 value
// (coordinates are never rounded to a half type).
inline void check_point_dtype(const at::Tensor& t, const char* name, const at::Tensor& value, const char* value_name) {
  const auto dtype = value.scalar_type();
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  TORCH_CHECK(t.scalar_type() == dtype || (half && t.scalar_type() == at::kFloat), name, " must have ", value_name,
              "'s dtype ", dtype, half ? " or float32" : "", ", got ", t.scalar_type());
}

inline void check_device(const at::Tensor& t, const char* name, const at::Tensor& value, const char* value_name) {
  TORCH_CHECK(t.device() == value.device(), name, " must be on ", value_name, "'s device ", value.device(), ", got ",
              t.device());
}

inline void check_shape(const at::Tensor& t, const char* name, c10::IntArrayRef expected, const char* layout) {
  TORCH_CHECK(t.sizes() == expected, name, " must have shape ", expected, " ", layout, ", got ", t.sizes());
}

// a * b + c, or an error naming `what` where int64 overflows.
inline int64_t checked_mul_add(int64_t a, int64_t b, int64_t c, const char* what) {
  int64_t product = 0, sum = 0;
  TORCH_CHECK(!__builtin_mul_overflow(a, b, &product) && !__builtin_add_overflow(product, c, &sum), what,
              " overflows int64");
  return sum;
}

}  // namespace family
}  // namespace deform_conv
