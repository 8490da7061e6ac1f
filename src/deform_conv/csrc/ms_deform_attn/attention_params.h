// The checks that derive a multi-scale deformable attention call's sizes (AttentionParams, attention_sizes.h) from
// its tensors. Host code.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "attention_sizes.h"

namespace deform_conv {

// Checks every tensor against the others (the backstop behind the Python checks, for direct torch.ops calls)
// and returns the sizes. With `check_level_values` (the CPU backend) the values of spatial_shapes and
// level_start_index too: levels at least 1x1, one after another, filling value's pixels. The CUDA backend does not
// read them (on a GPU that would cost a device synchronisation a call): its kernels check each level before they
// read it (level_fits).
AttentionParams make_attention_params(const at::Tensor& value, const at::Tensor& spatial_shapes,
                                      const at::Tensor& level_start_index, const at::Tensor& sampling_locations,
                                      const at::Tensor& attention_weights, bool check_level_values);

// The values of spatial_shapes [L, 2] and level_start_index [L] (host tensors): levels at least 1x1, one after
// another, filling value's `pixels`. Used by every op with levels (FlashDeformAttn's too).
void check_level_values(const at::Tensor& spatial_shapes, const at::Tensor& level_start_index, int64_t pixels);

// The same on the device, without a host synchronisation (torch._assert_async): the GPU backends' check, for
// the ops with levels (multi-scale deformable attention, FlashDeformAttn). An inconsistent call fails at the next
// synchronisation (CUDA's device-side assert), instead of sampling the wrong pixels silently.
void assert_level_values_async(const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                               int64_t pixels);

void check_attention_grad_output(const AttentionParams& p, const at::Tensor& grad_output, const at::Tensor& value);

}  // namespace deform_conv
