// FlashDeformAttn (the DCNv4 repository's): value [N, S, G, D], spatial_shapes [L, 2], level_start_index [L],
// sampling_loc_attn [N, Lq, G, L * K * 3] = L * K (x, y) locations normalised as multi-scale deformable
// attention's, then L * K logits under one softmax -> [N, Lq, G * D]. Host code written once for every backend,
// as DCNv3's (dcnv3/dcnv3.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "../sampled_sum/sampled_sum.h"

namespace deform_conv {

at::Tensor flash_deform_attn_forward(const SampledSumKernels& kernels, const at::Tensor& value,
                                     const at::Tensor& spatial_shapes, const at::Tensor& level_start_index,
                                     const at::Tensor& sampling_loc_attn, int64_t n_points);

std::tuple<at::Tensor, at::Tensor> flash_deform_attn_backward(const SampledSumKernels& kernels,
                                                              const at::Tensor& grad_output, const at::Tensor& value,
                                                              const at::Tensor& spatial_shapes,
                                                              const at::Tensor& level_start_index,
                                                              const at::Tensor& sampling_loc_attn, int64_t n_points);

}  // namespace deform_conv
