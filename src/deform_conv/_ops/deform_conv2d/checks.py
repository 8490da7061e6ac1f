"""deform_conv2d's argument validation at the Python boundary, shared by the public function, the fake kernels,
the reference and the modules.

Each error names the argument, what was expected and what was got. The C++ op repeats the essential checks
(TORCH_CHECK) as a backstop for direct ``torch.ops.deform_conv`` calls.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from torch import Tensor

from ..shared.checks import SUPPORTED_DTYPES, IntPair, _check_tensor, _shape, as_pair


# The derivative at exactly y = -1 or x = -1 (csrc/sampling.h): torchvision's one-sided one, or mmcv's 0.
BORDER_GRADIENTS = ("torchvision", "mmcv")


def check_border_gradient(value: object) -> None:
    if not isinstance(value, str) or value not in BORDER_GRADIENTS:
        raise ValueError(f"border_gradient must be 'torchvision' or 'mmcv', got {value!r}")


class Geometry(NamedTuple):
    """Sizes of one call, derived from the tensors (groups and offset_groups are inferred as in torchvision)."""

    stride: Tuple[int, int]
    padding: Tuple[int, int]
    dilation: Tuple[int, int]
    groups: int
    offset_groups: int
    out_h: int
    out_w: int


def _check_like_input(t: Tensor, name: str, input: Tensor) -> None:
    if t.dtype != input.dtype:
        raise TypeError(f"{name} must have the input's dtype {input.dtype}, got {t.dtype}")
    if t.device != input.device:
        raise ValueError(f"{name} must be on the input's device {input.device}, got {t.device}")


def check_args(
    input: Tensor,
    offset: Tensor,
    weight: Tensor,
    mask: Optional[Tensor],
    bias: Optional[Tensor],
    stride: IntPair,
    padding: IntPair,
    dilation: IntPair,
) -> Geometry:
    """Validates one call and returns its geometry. Shapes:

    input  [B, C_in, H, W]; offset [B, 2*offset_groups*kh*kw, H_out, W_out]; weight [C_out, C_in/groups, kh, kw];
    mask   [B, offset_groups*kh*kw, H_out, W_out] or None; bias [C_out] or None.
    """
    _check_tensor(input, "input", 4, "[batch, channels, height, width]")
    _check_tensor(weight, "weight", 4, "[out_channels, in_channels / groups, kernel_h, kernel_w]")
    _check_tensor(offset, "offset", 4, "[batch, 2 * offset_groups * kernel_h * kernel_w, out_h, out_w]")
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"input must be float16, bfloat16, float32 or float64, got {input.dtype}")
    _check_like_input(offset, "offset", input)
    _check_like_input(weight, "weight", input)
    stride_hw = as_pair(stride, "stride", 1)
    padding_hw = as_pair(padding, "padding", 0)
    dilation_hw = as_pair(dilation, "dilation", 1)

    batch, in_channels, height, width = input.shape
    out_channels, in_per_group, kernel_h, kernel_w = weight.shape
    if in_channels < 1:
        raise ValueError(f"input must have at least 1 channel, got shape {_shape(input)}")
    if kernel_h < 1 or kernel_w < 1:
        raise ValueError(f"weight's kernel size must be at least 1x1, got weight of shape {_shape(weight)}")
    if in_per_group < 1 or in_channels % in_per_group != 0:
        raise ValueError(
            f"weight.shape[1] (in_channels / groups) must divide the input's {in_channels} channels, "
            f"got weight of shape {_shape(weight)}"
        )
    groups = in_channels // in_per_group
    if out_channels % groups != 0:
        raise ValueError(
            f"weight.shape[0] (out_channels) must be divisible by groups = {in_channels} // {in_per_group} = {groups}, "
            f"got {out_channels}"
        )

    taps = kernel_h * kernel_w
    if offset.shape[1] < 1 or offset.shape[1] % (2 * taps) != 0:
        raise ValueError(
            f"offset must have a positive multiple of 2 * kernel_h * kernel_w = {2 * taps} channels "
            f"(2 * offset_groups * kernel_h * kernel_w), got {offset.shape[1]}"
        )
    offset_groups = offset.shape[1] // (2 * taps)
    if in_channels % offset_groups != 0:
        raise ValueError(
            f"offset_groups = offset.shape[1] // {2 * taps} = {offset_groups} must divide the input's "
            f"{in_channels} channels"
        )

    extent_h = height + 2 * padding_hw[0] - dilation_hw[0] * (kernel_h - 1) - 1
    extent_w = width + 2 * padding_hw[1] - dilation_hw[1] * (kernel_w - 1) - 1
    if extent_h < 0 or extent_w < 0:
        raise ValueError(
            f"output size must be at least 1x1, but input {height}x{width} with kernel {kernel_h}x{kernel_w}, "
            f"padding {tuple(padding_hw)} and dilation {tuple(dilation_hw)} leaves no room for one kernel window"
        )
    out_h = extent_h // stride_hw[0] + 1
    out_w = extent_w // stride_hw[1] + 1

    expected = (batch, offset.shape[1], out_h, out_w)
    if _shape(offset) != expected:
        raise ValueError(f"offset must have shape {expected} [batch, channels, out_h, out_w], got {_shape(offset)}")
    if mask is not None:
        _check_tensor(mask, "mask", 4, "[batch, offset_groups * kernel_h * kernel_w, out_h, out_w]")
        _check_like_input(mask, "mask", input)
        expected = (batch, offset_groups * taps, out_h, out_w)
        if _shape(mask) != expected:
            raise ValueError(
                f"mask must have shape {expected} [batch, offset_groups * kernel_h * kernel_w, out_h, out_w], "
                f"got {_shape(mask)}"
            )
    if bias is not None:
        _check_tensor(bias, "bias", 1, "[out_channels]")
        _check_like_input(bias, "bias", input)
        if bias.shape[0] != out_channels:
            raise ValueError(f"bias must have shape ({out_channels},) [out_channels], got {_shape(bias)}")
    return Geometry(stride_hw, padding_hw, dilation_hw, groups, offset_groups, out_h, out_w)
