// The op schemas, written once: the library defines them in namespace deform_conv (ops.cpp), and the CUDA
// simulation (cuda_simulation/simt.cpp) the same ones in deform_conv_sim.
#pragma once

namespace deform_conv {

// input [B, C_in, H, W], offset [B, 2*offset_groups*kh*kw, H_out, W_out], weight [C_out, C_in/groups, kh, kw],
// mask [B, offset_groups*kh*kw, H_out, W_out], bias [C_out] -> output [B, C_out, H_out, W_out].
// groups and offset_groups are inferred from the weight's and the offset's shapes, as in torchvision.
// border_gradient ("torchvision" or "mmcv"): the derivative at exactly y = -1 or x = -1 (sampling.h); the forward
// is the same under both, and the op carries it for its backward.
constexpr const char* kDeformConv2dSchema =
    "deform_conv2d(Tensor input, Tensor offset, Tensor weight, Tensor? mask, Tensor? bias, "
    "int[2] stride, int[2] padding, int[2] dilation, str border_gradient=\"torchvision\") -> Tensor";

// The gradients of deform_conv2d with respect to input, offset, weight, mask (None without a mask) and bias
// (None unless bias_defined). An op of its own so that compile/export can trace the backward.
constexpr const char* kDeformConv2dBackwardSchema =
    "deform_conv2d_backward(Tensor grad_output, Tensor input, Tensor offset, Tensor weight, Tensor? mask, "
    "int[2] stride, int[2] padding, int[2] dilation, bool bias_defined, str border_gradient=\"torchvision\") "
    "-> (Tensor grad_input, Tensor grad_offset, Tensor grad_weight, Tensor? grad_mask, Tensor? grad_bias)";

// Multi-scale deformable attention (Deformable DETR): value [N, S, M, D] (S = sum of H_l * W_l), spatial_shapes
// [L, 2] int64 (H_l, W_l), level_start_index [L] int64, sampling_locations [N, Lq, M, L, P, 2] (x, y in [0, 1],
// grid_sample's align_corners=False), attention_weights [N, Lq, M, L, P] -> output [N, Lq, M * D].
constexpr const char* kMsDeformAttnSchema =
    "ms_deform_attn(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_locations, "
    "Tensor attention_weights) -> Tensor";

// Its gradients with respect to value, sampling_locations and attention_weights.
constexpr const char* kMsDeformAttnBackwardSchema =
    "ms_deform_attn_backward(Tensor grad_output, Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
    "Tensor sampling_locations, Tensor attention_weights) "
    "-> (Tensor grad_value, Tensor grad_sampling_locations, Tensor grad_attention_weights)";

// DCNv3 (InternImage): input [N, H, W, group * C], offset [N, H_out, W_out, group * K * 2] ((x, y) per point), mask
// [N, H_out, W_out, group * K] -> [N, H_out, W_out, group * C], K = kh * kw - remove_center (sampled_sum/points.h
// has the grid). offset and mask may be float32 beside a float16/bfloat16 input.
constexpr const char* kDcnv3Schema =
    "dcnv3(Tensor input, Tensor offset, Tensor mask, int[2] kernel_size, int[2] stride, int[2] padding, "
    "int[2] dilation, int group, float offset_scale, bool remove_center) -> Tensor";
constexpr const char* kDcnv3BackwardSchema =
    "dcnv3_backward(Tensor grad_output, Tensor input, Tensor offset, Tensor mask, int[2] kernel_size, int[2] stride, "
    "int[2] padding, int[2] dilation, int group, float offset_scale, bool remove_center) "
    "-> (Tensor grad_input, Tensor grad_offset, Tensor grad_mask)";

// DCNv4: input [N, H, W, group * C], offset_mask [N, H_out, W_out, P], P >= group * K * 3 (each group's 2K offsets
// then its K mask values; with softmax, the mask values are logits) -> [N, H_out, W_out, group * C].
constexpr const char* kDcnv4Schema =
    "dcnv4(Tensor input, Tensor offset_mask, int[2] kernel_size, int[2] stride, int[2] padding, int[2] dilation, "
    "int group, float offset_scale, bool remove_center, bool softmax) -> Tensor";
constexpr const char* kDcnv4BackwardSchema =
    "dcnv4_backward(Tensor grad_output, Tensor input, Tensor offset_mask, int[2] kernel_size, int[2] stride, "
    "int[2] padding, int[2] dilation, int group, float offset_scale, bool remove_center, bool softmax) "
    "-> (Tensor grad_input, Tensor grad_offset_mask)";

// FlashDeformAttn (DCNv4): value [N, S, group, D], spatial_shapes [L, 2], level_start_index [L], sampling_loc_attn
// [N, Lq, group, L * n_points * 3] (L * n_points (x, y) locations, then as many logits under one softmax)
// -> [N, Lq, group * D].
constexpr const char* kFlashDeformAttnSchema =
    "flash_deform_attn(Tensor value, Tensor spatial_shapes, Tensor level_start_index, Tensor sampling_loc_attn, "
    "int n_points) -> Tensor";
constexpr const char* kFlashDeformAttnBackwardSchema =
    "flash_deform_attn_backward(Tensor grad_output, Tensor value, Tensor spatial_shapes, Tensor level_start_index, "
    "Tensor sampling_loc_attn, int n_points) -> (Tensor grad_value, Tensor grad_sampling_loc_attn)";

// Every op's schema, for the units that define them (ops.cpp, cuda_simulation/ops_sim.cpp).
constexpr const char* kSchemas[] = {
    kDeformConv2dSchema, kDeformConv2dBackwardSchema, kMsDeformAttnSchema, kMsDeformAttnBackwardSchema,
    kDcnv3Schema,        kDcnv3BackwardSchema,        kDcnv4Schema,        kDcnv4BackwardSchema,
    kFlashDeformAttnSchema, kFlashDeformAttnBackwardSchema,
};

}  // namespace deform_conv
