// Multi-scale deformable attention with float32 sampling locations or attention weights beside a float16/bfloat16
// value (Deformable DETR under autocast: the value from a half Linear, the locations from float32 reference
// points): computed on the family's shared kernels (csrc/sampled_sum/), whose points are float32 whatever the
// value's dtype, so that no coordinate is rounded to a half type. The CUDA backend's path for such calls (calls
// whose tensors share one dtype keep the op's own CUDA kernels); the CPU backend reads every call's locations in
// place with the family's kernels (csrc/ms_deform_attn/cpu/ms_deform_attn_cpu.cpp). Host code.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "../../sampled_sum/sampled_sum.h"
#include "../attention_sizes.h"

namespace deform_conv {

// Whether a call takes this path: sampling_locations or attention_weights not in value's dtype.
bool has_float32_points(const at::Tensor& value, const at::Tensor& sampling_locations,
                        const at::Tensor& attention_weights);

at::Tensor ms_deform_attn_on_float32_points(const SampledSumKernels& kernels, const AttentionParams& p,
                                            const at::Tensor& value, const at::Tensor& spatial_shapes,
                                            const at::Tensor& level_start_index,
                                            const at::Tensor& sampling_locations,
                                            const at::Tensor& attention_weights);

std::tuple<at::Tensor, at::Tensor, at::Tensor> ms_deform_attn_backward_on_float32_points(
    const SampledSumKernels& kernels, const AttentionParams& p, const at::Tensor& grad_output,
    const at::Tensor& value, const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
    const at::Tensor& sampling_locations, const at::Tensor& attention_weights);

}  // namespace deform_conv
