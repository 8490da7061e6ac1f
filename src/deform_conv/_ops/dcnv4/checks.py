"""Argument checks of DCNv4 at the Python boundary (its grid is DCNv3's: dcnv3/checks.py)."""

from __future__ import annotations

from torch import Tensor

from ..dcnv3.checks import GridSizes, check_grid_args
from ..shared.checks import IntPair, _check_tensor, _shape, check_point_dtype, check_same_device


def check_dcnv4_args(input: Tensor, offset_mask: Tensor, kernel_size: IntPair, stride: IntPair, padding: IntPair,
                     dilation: IntPair, group: int, offset_scale: float, remove_center: bool,
                     softmax: bool) -> GridSizes:
    """Validates one dcnv4 call and returns its sizes."""
    s = check_grid_args(input, kernel_size, stride, padding, dilation, group, offset_scale, remove_center)
    if not isinstance(softmax, bool):
        raise TypeError(f"softmax must be a bool, got {softmax!r}")
    layout = "[N, H_out, W_out, P]"
    _check_tensor(offset_mask, "offset_mask", 4, layout)
    check_point_dtype(offset_mask, "offset_mask", input, "input")
    check_same_device(((offset_mask, "offset_mask"),), input, "input")
    needed = s.group * s.points * 3
    batch, out_h, out_w, channels = _shape(offset_mask)
    if (batch, out_h, out_w) != (s.batch, s.out_height, s.out_width) or channels < needed:
        raise ValueError(
            f"offset_mask must have shape ({s.batch}, {s.out_height}, {s.out_width}, P) with P >= group * K * 3 = "
            f"{needed} {layout}, got {_shape(offset_mask)}"
        )
    return s
