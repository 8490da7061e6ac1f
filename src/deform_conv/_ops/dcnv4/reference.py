"""DCNv4's pure-PyTorch reference: its offset_mask split into DCNv3's offsets and mask (with the softmax where
asked), on DCNv3's reference."""

from __future__ import annotations

from torch import Tensor

from ..dcnv3.checks import GridSizes
from ..dcnv3.reference import grid_coordinates, grid_sum, point_dtype
from ..shared.checks import IntPair
from .checks import check_dcnv4_args


def dcnv4_reference(input: Tensor, offset_mask: Tensor, kernel_size: IntPair, stride: IntPair = 1,
                    padding: IntPair = 0, dilation: IntPair = 1, group: int = 1, offset_scale: float = 1.0,
                    remove_center: bool = False, softmax: bool = False) -> Tensor:
    """:func:`deform_conv.dcnv4` in plain PyTorch (same arguments)."""
    s = check_dcnv4_args(input, offset_mask, kernel_size, stride, padding, dilation, group, offset_scale,
                         remove_center, softmax)
    return checked_dcnv4_reference(input, offset_mask, s, float(offset_scale), remove_center, softmax)


def checked_dcnv4_reference(input: Tensor, offset_mask: Tensor, s: GridSizes, offset_scale: float,
                            remove_center: bool, softmax: bool) -> Tensor:
    """dcnv4 of checked arguments (their sizes ``s``)."""
    dtype = point_dtype(input.dtype)
    k = s.points
    blocks = offset_mask[..., : s.group * 3 * k].unflatten(3, (s.group, 3 * k))
    offsets = blocks[..., : 2 * k].unflatten(4, (k, 2))
    weights = blocks[..., 2 * k:].to(dtype)
    if softmax:
        weights = weights.softmax(-1)
    x, y = grid_coordinates(s, offsets, offset_scale, remove_center, dtype)
    return grid_sum(input, s, x, y, weights)
