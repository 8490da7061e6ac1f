"""deform_conv2d's modules: ``DeformConv2d`` (torchvision's) and the learned-offset layers ``DeformConv2dPack`` and
``ModulatedDeformConv2dPack`` (mmcv's constructor arguments, initialisation, state_dict keys and numbers).

Each follows the library whose name it carries at a sampling point exactly on y = -1 or x = -1, where the two
differ in the backward (``border_gradient``, see ``deform_conv2d``): ``DeformConv2d`` torchvision's, the Pack
layers mmcv's; all accept ``border_gradient=`` to choose."""

from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .._ops.deform_conv2d import deform_conv2d
from .._ops.deform_conv2d.checks import check_border_gradient
from .._ops.shared.checks import IntPair, as_pair


def _check_channels(in_channels: int, out_channels: int, groups: int, deform_groups: int = 1) -> None:
    if in_channels < 1 or out_channels < 1:
        raise ValueError(f"in_channels and out_channels must be >= 1, got {in_channels} and {out_channels}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    if deform_groups < 1:
        raise ValueError(f"deform_groups must be >= 1, got {deform_groups}")
    if in_channels % groups != 0:
        raise ValueError(f"in_channels ({in_channels}) must be divisible by groups ({groups})")
    if out_channels % groups != 0:
        raise ValueError(f"out_channels ({out_channels}) must be divisible by groups ({groups})")
    if in_channels % deform_groups != 0:
        raise ValueError(f"in_channels ({in_channels}) must be divisible by deform_groups ({deform_groups})")


def _resolve_deform_groups(deform_groups: int, deformable_groups: Optional[int]) -> int:
    """mmcv still accepts the old keyword ``deformable_groups`` (with a deprecation warning); so do we."""
    if deformable_groups is None:
        return deform_groups
    warnings.warn("deformable_groups is deprecated, use deform_groups instead", DeprecationWarning, stacklevel=3)
    return deformable_groups


class DeformConv2d(nn.Module):
    """Deformable convolution with offsets (and optionally a mask) given at call time, as
    ``torchvision.ops.DeformConv2d``.

    ``forward(input [B, C_in, H, W], offset [B, 2*offset_groups*kh*kw, H_out, W_out],
    mask [B, offset_groups*kh*kw, H_out, W_out] or None) -> [B, C_out, H_out, W_out]``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntPair,
        stride: IntPair = 1,
        padding: IntPair = 0,
        dilation: IntPair = 1,
        groups: int = 1,
        bias: bool = True,
        *,
        border_gradient: str = "torchvision",
    ) -> None:
        super().__init__()
        _check_channels(in_channels, out_channels, groups)
        check_border_gradient(border_gradient)
        self.border_gradient = border_gradient
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size: Tuple[int, int] = as_pair(kernel_size, "kernel_size", 1)
        self.stride: Tuple[int, int] = as_pair(stride, "stride", 1)
        self.padding: Tuple[int, int] = as_pair(padding, "padding", 0)
        self.dilation: Tuple[int, int] = as_pair(dilation, "dilation", 1)
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        self.bias: Optional[nn.Parameter] = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torchvision's (= nn.Conv2d's) initialisation."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Tensor, offset: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return deform_conv2d(input, offset, self.weight, self.bias, self.stride, self.padding, self.dilation, mask,
                             self.border_gradient)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, bias={self.bias is not None}"
            + _border_repr(self.border_gradient, "torchvision")
        )


def _border_repr(border_gradient: str, default: str) -> str:
    return "" if border_gradient == default else f", border_gradient={border_gradient!r}"


class _PackBase(nn.Module):
    """What both mmcv-compatible layers share: the main weight and the zero-initialised ``conv_offset`` that
    predicts ``offset_channels_per_group * deform_groups * kh * kw`` channels from the input.

    ``_version = 2`` is recorded in state_dict metadata as mmcv does. (mmcv's renaming of pre-version-2 keys
    ``<name>_offset.*`` cannot work in current torch, which hands a child only the keys under its own prefix.)"""

    _version = 2

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntPair,
        stride: IntPair,
        padding: IntPair,
        dilation: IntPair,
        groups: int,
        deform_groups: int,
        bias: bool,
        offset_channels_per_group: int,
        border_gradient: str,
    ) -> None:
        super().__init__()
        _check_channels(in_channels, out_channels, groups, deform_groups)
        check_border_gradient(border_gradient)
        self.border_gradient = border_gradient
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size: Tuple[int, int] = as_pair(kernel_size, "kernel_size", 1)
        self.stride: Tuple[int, int] = as_pair(stride, "stride", 1)
        self.padding: Tuple[int, int] = as_pair(padding, "padding", 0)
        self.dilation: Tuple[int, int] = as_pair(dilation, "dilation", 1)
        self.groups = groups
        self.deform_groups = deform_groups
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        self.bias: Optional[nn.Parameter] = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.conv_offset = nn.Conv2d(
            in_channels,
            deform_groups * offset_channels_per_group * self.kernel_size[0] * self.kernel_size[1],
            kernel_size=self.kernel_size,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            bias=True,
        )
        self.init_weights()

    def init_weights(self) -> None:
        """mmcv's initialisation: weight ~ U(-1/sqrt(n), 1/sqrt(n)) with n = in_channels * kh * kw, bias 0,
        and a zero ``conv_offset`` so that training starts from a plain convolution."""
        stdv = 1.0 / math.sqrt(self.in_channels * self.kernel_size[0] * self.kernel_size[1])
        with torch.no_grad():
            self.weight.uniform_(-stdv, stdv)
            if self.bias is not None:
                self.bias.zero_()
            self.conv_offset.weight.zero_()
            self.conv_offset.bias.zero_()

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
            f"deform_groups={self.deform_groups}, bias={self.bias is not None}"
            + _border_repr(self.border_gradient, "mmcv")
        )


class DeformConv2dPack(_PackBase):
    """DCNv1 layer that predicts its own offsets, as mmcv's ``DeformConv2dPack``.

    State dict keys: ``weight``, ``conv_offset.weight``, ``conv_offset.bias`` (and ``bias`` when bias=True;
    mmcv refuses bias=True here, we allow it). ``im2col_step`` is accepted for compatibility and ignored: the
    batch is chunked automatically. ``forward(x [B, C_in, H, W]) -> [B, C_out, H_out, W_out]``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntPair,
        stride: IntPair = 1,
        padding: IntPair = 0,
        dilation: IntPair = 1,
        groups: int = 1,
        deform_groups: int = 1,
        bias: bool = False,
        im2col_step: int = 32,
        *,
        deformable_groups: Optional[int] = None,
        border_gradient: str = "mmcv",
    ) -> None:
        deform_groups = _resolve_deform_groups(deform_groups, deformable_groups)
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, deform_groups, bias,
            offset_channels_per_group=2, border_gradient=border_gradient,
        )
        self.im2col_step = im2col_step

    def forward(self, x: Tensor) -> Tensor:
        offset = self.conv_offset(x)  # [B, 2 * deform_groups * kh * kw, H_out, W_out]
        return deform_conv2d(x, offset, self.weight, self.bias, self.stride, self.padding, self.dilation, None,
                             self.border_gradient)


class ModulatedDeformConv2dPack(_PackBase):
    """DCNv2 layer that predicts its own offsets and mask, as mmcv's ``ModulatedDeformConv2dPack``.

    ``conv_offset`` predicts ``3 * deform_groups * kh * kw`` channels, split in three: the first two thirds
    are the offsets, the last third passes through a sigmoid to become the mask (0.5 at initialisation).
    State dict keys: ``weight``, ``bias`` (if bias=True), ``conv_offset.weight``, ``conv_offset.bias``.
    ``forward(x [B, C_in, H, W]) -> [B, C_out, H_out, W_out]``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntPair,
        stride: IntPair = 1,
        padding: IntPair = 0,
        dilation: IntPair = 1,
        groups: int = 1,
        deform_groups: int = 1,
        bias: bool = True,
        *,
        deformable_groups: Optional[int] = None,
        border_gradient: str = "mmcv",
    ) -> None:
        deform_groups = _resolve_deform_groups(deform_groups, deformable_groups)
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, deform_groups, bias,
            offset_channels_per_group=3, border_gradient=border_gradient,
        )

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv_offset(x)  # [B, 3 * deform_groups * kh * kw, H_out, W_out]
        # mmcv's chunk(3) + cat of the first two thirds, as one slice: no copy, and static channel counts that
        # ONNX export needs (shape inference loses them through Split + Concat).
        offset_channels = 2 * self.deform_groups * self.kernel_size[0] * self.kernel_size[1]
        offset, mask = out[:, :offset_channels], out[:, offset_channels:]
        return deform_conv2d(
            x, offset, self.weight, self.bias, self.stride, self.padding, self.dilation, torch.sigmoid(mask),
            self.border_gradient,
        )
