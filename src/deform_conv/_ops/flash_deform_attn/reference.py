"""FlashDeformAttn's pure-PyTorch reference: the softmax of its logits, then multi-scale deformable attention's
reference on its locations (the op's definition)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ms_deform_attn.reference import ms_deform_attn_reference
from .checks import FlashSizes, check_flash_deform_attn_args


def flash_deform_attn_reference(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                                sampling_loc_attn: Tensor, n_points: int) -> Tensor:
    """:func:`deform_conv.flash_deform_attn` in plain PyTorch (same arguments)."""
    s = check_flash_deform_attn_args(value, spatial_shapes, level_start_index, sampling_loc_attn, n_points)
    return checked_flash_deform_attn_reference(value, spatial_shapes, level_start_index, sampling_loc_attn, s)


def checked_flash_deform_attn_reference(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                                        sampling_loc_attn: Tensor, s: FlashSizes) -> Tensor:
    """flash_deform_attn of checked arguments (their sizes ``s``), computed in float32 (float64) and rounded once."""
    dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
    points = s.levels * s.points
    locations = sampling_loc_attn[..., : 2 * points].to(dtype).reshape(
        s.batch, s.queries, s.group, s.levels, s.points, 2)
    weights = sampling_loc_attn[..., 2 * points:].to(dtype).softmax(-1).reshape(
        s.batch, s.queries, s.group, s.levels, s.points)
    output = ms_deform_attn_reference(value.to(dtype), spatial_shapes, level_start_index, locations, weights)
    return output.to(value.dtype)
