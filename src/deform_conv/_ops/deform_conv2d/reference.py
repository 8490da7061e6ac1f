"""Slow, plainly written pure-PyTorch deform_conv2d: the ground truth of the tests.

Written from the definition on the shared bilinear sampling (``shared/reference.py``, whose docstring gives the
semantics at the border and at non-finite coordinates), and differentiable by autograd, so its gradients are the
reference for ours. The mask multiplies the sample, so a non-finite mask propagates as a multiplication does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..shared.checks import IntPair
from ..shared.reference import _bilinear
from .checks import check_args, check_border_gradient


def deform_conv2d_reference(
    input: Tensor,
    offset: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: IntPair = 1,
    padding: IntPair = 0,
    dilation: IntPair = 1,
    mask: Optional[Tensor] = None,
    border_gradient: str = "torchvision",
) -> Tensor:
    """Same signature, layout and result as :func:`deform_conv.deform_conv2d`, computed the slow way.

    input [B, C_in, H, W], offset [B, 2*offset_groups*kh*kw, H_out, W_out], weight [C_out, C_in/groups, kh, kw],
    mask [B, offset_groups*kh*kw, H_out, W_out] or None, bias [C_out] or None -> [B, C_out, H_out, W_out].
    """
    geo = check_args(input, offset, weight, mask, bias, stride, padding, dilation)
    check_border_gradient(border_gradient)
    batch, in_channels, height, width = input.shape
    out_channels, in_per_group, kernel_h, kernel_w = weight.shape
    taps, groups, offset_groups = kernel_h * kernel_w, geo.groups, geo.offset_groups
    pixels = geo.out_h * geo.out_w

    def positions(out_size: int, stride: int, pad: int, kernel: int, dilation: int) -> Tensor:
        out = torch.arange(out_size, device=input.device) * stride - pad
        return torch.arange(kernel, device=input.device)[:, None] * dilation + out[None, :]  # [kernel, out]

    rows = positions(geo.out_h, geo.stride[0], geo.padding[0], kernel_h, geo.dilation[0])
    cols = positions(geo.out_w, geo.stride[1], geo.padding[1], kernel_w, geo.dilation[1])
    # base[tap = i * kernel_w + j, oy, ox]
    base_y = rows[:, None, :, None].expand(kernel_h, kernel_w, geo.out_h, geo.out_w).reshape(taps, geo.out_h, geo.out_w)
    base_x = cols[None, :, None, :].expand(kernel_h, kernel_w, geo.out_h, geo.out_w).reshape(taps, geo.out_h, geo.out_w)

    off = offset.reshape(batch, offset_groups, taps, 2, geo.out_h, geo.out_w)
    y = (base_y.to(input.dtype) + off[:, :, :, 0]).reshape(batch, offset_groups, taps * pixels)
    x = (base_x.to(input.dtype) + off[:, :, :, 1]).reshape(batch, offset_groups, taps * pixels)
    images = input.reshape(batch, offset_groups, in_channels // offset_groups, height, width)
    sampled = _bilinear(images, y, x, border_gradient).reshape(batch, offset_groups, in_channels // offset_groups, taps, pixels)
    if mask is not None:
        sampled = sampled * mask.reshape(batch, offset_groups, 1, taps, pixels)

    columns = sampled.reshape(batch, groups, in_per_group * taps, pixels)
    matrices = weight.reshape(groups, out_channels // groups, in_per_group * taps)
    out = torch.einsum("gok,bgkp->bgop", matrices, columns).reshape(batch, out_channels, geo.out_h, geo.out_w)
    if bias is not None:
        out = out + bias.reshape(1, out_channels, 1, 1)
    return out
