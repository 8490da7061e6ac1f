"""Argument checks of DCNv3 (and of DCNv4, which samples on the same grid) at the Python boundary, shared by the
public function and the fake kernels. Each error names the argument, what was expected and what was got; the C++
op repeats them (TORCH_CHECK) for direct ``torch.ops.deform_conv`` calls."""

from __future__ import annotations

import math
from typing import NamedTuple, Tuple

from torch import Tensor

from ..shared.checks import (INT64_MAX, SUPPORTED_DTYPES, IntPair, _check_tensor, _is_int, _shape, as_pair,
                             check_point_dtype, check_same_device)


class GridSizes(NamedTuple):
    """Sizes of one DCNv3/DCNv4 call: input [batch, height, width, group * group_channels], K points a group."""

    batch: int
    height: int
    width: int
    channels: int
    group: int
    kernel_size: Tuple[int, int]
    stride: Tuple[int, int]
    padding: Tuple[int, int]
    dilation: Tuple[int, int]
    out_height: int
    out_width: int
    points: int  # K = kh * kw - remove_center


def check_grid_args(input: Tensor, kernel_size: IntPair, stride: IntPair, padding: IntPair, dilation: IntPair,
                    group: int, offset_scale: float, remove_center: bool) -> GridSizes:
    """Checks the input and the grid's arguments and returns the sizes (H_out, W_out as conv2d's)."""
    _check_tensor(input, "input", 4, "[N, H, W, group * group_channels] (channels last)")
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"input must be float16, bfloat16, float32 or float64, got {input.dtype}")
    kernel = as_pair(kernel_size, "kernel_size", 1)
    stride_ = as_pair(stride, "stride", 1)
    padding_ = as_pair(padding, "padding", 0)
    dilation_ = as_pair(dilation, "dilation", 1)
    if not _is_int(group):
        raise TypeError(f"group must be an int, got {group!r}")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    if not isinstance(offset_scale, (int, float)) or isinstance(offset_scale, bool):
        raise TypeError(f"offset_scale must be a float, got {offset_scale!r}")
    if not math.isfinite(offset_scale):
        raise ValueError(f"offset_scale must be finite, got {offset_scale}")
    if not isinstance(remove_center, bool):
        raise TypeError(f"remove_center must be a bool, got {remove_center!r}")
    if remove_center and (kernel[0] % 2 == 0 or kernel[1] % 2 == 0):
        raise ValueError(f"remove_center needs an odd kernel_size in both dimensions, got {kernel}")
    batch, height, width, channels = input.shape
    if channels % group != 0:
        raise ValueError(f"input's channels (input.shape[3] = {channels}) must be divisible by group = {group}")
    span = (dilation_[0] * (kernel[0] - 1) + 1, dilation_[1] * (kernel[1] - 1) + 1)
    padded = (height + 2 * padding_[0], width + 2 * padding_[1])
    if max(span + padded) > INT64_MAX:
        raise ValueError(f"the kernel's span {span} or the padded input {padded} overflows int64")
    if padded[0] < span[0] or padded[1] < span[1]:
        raise ValueError(
            f"the kernel ({span[0]}x{span[1]} pixels with dilation) must fit in the padded input "
            f"({padded[0]}x{padded[1]}): kernel_size {kernel}, dilation {dilation_}, padding {padding_}, "
            f"input {height}x{width}"
        )
    out = ((padded[0] - span[0]) // stride_[0] + 1, (padded[1] - span[1]) // stride_[1] + 1)
    points = kernel[0] * kernel[1] - (1 if remove_center else 0)
    return GridSizes(batch, height, width, channels, group, kernel, stride_, padding_, dilation_, out[0], out[1],
                     points)


def check_point_tensor(t: Tensor, name: str, input: Tensor, expected: Tuple[int, ...], layout: str) -> None:
    """An offset or mask tensor: dense, input's dtype (or float32 beside a half input), input's device, shape."""
    _check_tensor(t, name, len(expected), layout)
    check_point_dtype(t, name, input, "input")
    check_same_device(((t, name),), input, "input")
    if _shape(t) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} {layout}, got {_shape(t)}")


def check_dcnv3_args(input: Tensor, offset: Tensor, mask: Tensor, kernel_size: IntPair, stride: IntPair,
                     padding: IntPair, dilation: IntPair, group: int, offset_scale: float,
                     remove_center: bool) -> GridSizes:
    """Validates one dcnv3 call and returns its sizes."""
    s = check_grid_args(input, kernel_size, stride, padding, dilation, group, offset_scale, remove_center)
    k = s.group * s.points
    check_point_tensor(offset, "offset", input, (s.batch, s.out_height, s.out_width, 2 * k),
                       "[N, H_out, W_out, group * K * 2]")
    check_point_tensor(mask, "mask", input, (s.batch, s.out_height, s.out_width, k), "[N, H_out, W_out, group * K]")
    return s

