#include "tiled_backward.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <type_traits>
#include <vector>

#include "brgemm.h"
#include "sampling_passes.h"
#include "scratch.h"

namespace deform_conv {
namespace cpu {
namespace {

// The backward's GEMMs on scalar_t factors: float32's, or a half type's on its native GEMM.
template <typename scalar_t>
using BackwardFactors =
    std::conditional_t<std::is_same_v<scalar_t, float>, FloatBackwardFactors, HalfBackwardFactors<scalar_t>>;

// The half GEMM the call's half-type factors multiply on (read once: its settings may change between calls, on
// another thread), or none for float32.
template <typename scalar_t>
HalfGemm half_gemm_of() {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return HalfGemm{};
  } else {
    return half_gemm_for(c10::CppTypeToScalarType<scalar_t>::value);
  }
}

// Whether the GEMMs run here on scalar_t's factors (FloatBackwardFactors::apply, HalfBackwardFactors::apply).
template <typename scalar_t>
bool gemms_apply(const ConvParams& p, const HalfGemm& gemm) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return FloatBackwardFactors::apply(p);
  } else {
    return HalfBackwardFactors<scalar_t>::apply(p, gemm);
  }
}

// A float32 tensor, or an undefined one (the mask and its gradient of a layer without a mask).
bool float32_or_none(const at::Tensor& t) { return !t.defined() || t.scalar_type() == at::kFloat; }

}  // namespace

template <typename scalar_t>
bool tiled_backward(const ConvParams& p, const SamplingTensors& tensors, const at::Tensor& grad_output,
                    int64_t first, int64_t images, const at::Tensor& weight_matrix, const at::Tensor& columns,
                    at::Tensor& grad_weights, at::Tensor& grad_offset, at::Tensor& grad_mask,
                    at::Tensor& grad_input) {
  const at::ScalarType dtype = c10::CppTypeToScalarType<scalar_t>::value;
  const int64_t row = p.taps() * p.in_channels, pixels = p.out_pixels();
  // Per thread: a tile's columns' gradient in float32, then its grad_output turned for the GEMM, in scalar_t.
  const int64_t tile_floats = kPixelTile * row;
  const int64_t turned_values = kPixelTile * BackwardFactors<scalar_t>::turned_per_pixel(p);
  const int64_t tile_bytes = tile_floats * int64_t(sizeof(float)) + turned_values * int64_t(sizeof(scalar_t));
  const HalfGemm gemm = half_gemm_of<scalar_t>();
  if (images < at::get_num_threads() || tile_bytes > kMaxKeptScratchBytes || !gemms_apply<scalar_t>(p, gemm) ||
      grad_output.scalar_type() != dtype || weight_matrix.scalar_type() != dtype || columns.scalar_type() != dtype ||
      tensors.input.scalar_type() != dtype || tensors.offset.scalar_type() != at::kFloat ||
      !float32_or_none(tensors.mask) || grad_weights.scalar_type() != at::kFloat ||
      grad_offset.scalar_type() != at::kFloat || !float32_or_none(grad_mask) ||
      grad_input.scalar_type() != at::kFloat) {
    return false;
  }
  const BackwardFactors<scalar_t> factors = [&] {
    if constexpr (std::is_same_v<scalar_t, float>) {
      return FloatBackwardFactors(p, grad_output, first, images, weight_matrix);
    } else {
      return HalfBackwardFactors<scalar_t>(p, gemm, grad_output, first, images, weight_matrix);
    }
  }();
  // The driver's ranges of its passes (columns_driver.cpp), for this pass in their place.
  RECORD_FUNCTION("deform_conv2d::tiled_backward", std::vector<c10::IValue>{});
  factors.add_weight_gradient(p, images, columns.const_data_ptr<scalar_t>(), grad_weights.mutable_data_ptr<float>());

  const SamplingInputs<float, scalar_t> in{tensors.input.const_data_ptr<scalar_t>(),
                                           tensors.offset.const_data_ptr<float>(),
                                           tensors.mask.defined() ? tensors.mask.const_data_ptr<float>() : nullptr};
  float* offsets = grad_offset.mutable_data_ptr<float>();
  float* masks = grad_mask.defined() ? grad_mask.mutable_data_ptr<float>() : nullptr;
  float* inputs = grad_input.mutable_data_ptr<float>();
  at::parallel_for(0, images, 1, [&](int64_t begin, int64_t end) {
    float* tile = static_cast<float*>(scratch_bytes(ScratchSlot::tile, tile_bytes));
    scalar_t* turned = reinterpret_cast<scalar_t*>(tile + tile_floats);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t pixel = 0; pixel < pixels; pixel += kPixelTile) {
        const int64_t len = std::min(kPixelTile, pixels - pixel);
        factors.column_gradient_tile(p, n, pixel, len, turned, tile, row);
        tile_grads(p, in, first + n, pixel, pixel + len, tile, offsets, masks, inputs);
      }
    }
    factors.release();
  });
  return true;
}

template bool tiled_backward<float>(const ConvParams&, const SamplingTensors&, const at::Tensor&, int64_t, int64_t,
                                    const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&,
                                    at::Tensor&);
template bool tiled_backward<c10::BFloat16>(const ConvParams&, const SamplingTensors&, const at::Tensor&, int64_t,
                                            int64_t, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                            at::Tensor&, at::Tensor&);
template bool tiled_backward<c10::Half>(const ConvParams&, const SamplingTensors&, const at::Tensor&, int64_t,
                                        int64_t, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                        at::Tensor&, at::Tensor&);

}  // namespace cpu
}  // namespace deform_conv
