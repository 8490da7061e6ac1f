"""FlashDeformAttn's module: the DCNv4 repository's ``DCNv4.modules.FlashDeformAttn`` on
:func:`deform_conv.flash_deform_attn`."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._ops.flash_deform_attn import flash_deform_attn
from .ms_deform_attn import MSDeformAttn


class FlashDeformAttn(MSDeformAttn):
    """The DCNv4 repository's FlashDeformAttn module (DCNv4_op/DCNv4/modules/flash_deform_attn.py): Deformable
    DETR's ``MSDeformAttn`` -- the same arguments, state_dict keys, initialisation and forward arguments
    (``MSDeformAttn``'s docstring) -- with the softmax of the attention weights fused into the op. Unlike upstream
    the sampling locations are not rounded to float16 (``.half()``) before the op: coordinates stay float32."""

    def forward(
        self,
        query: Tensor,
        reference_points: Tensor,
        input_flatten: Tensor,
        input_spatial_shapes: Tensor,
        input_level_start_index: Tensor,
        input_padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        value, locations, logits = self._projections(query, reference_points, input_flatten, input_spatial_shapes,
                                                     input_padding_mask)
        locations = locations.flatten(-3)
        if locations.dtype != logits.dtype:  # e.g. float32 reference points beside a half Linear: keep float32
            dtype = torch.promote_types(locations.dtype, logits.dtype)
            locations, logits = locations.to(dtype), logits.to(dtype)
        sampling_loc_attn = torch.cat([locations, logits], -1)
        output = flash_deform_attn(value, input_spatial_shapes, input_level_start_index, sampling_loc_attn,
                                   self.n_points)
        return self.output_proj(output)
