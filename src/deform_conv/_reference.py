"""A slow, plainly written deformable convolution in pure PyTorch: the ground truth of the tests.

Differentiable by autograd, so its gradients are the reference for ours. Semantics as in torchvision:
a sampling point with y <= -1, y >= H, x <= -1 or x >= W gives 0; otherwise each in-image neighbour
contributes its bilinear weight times its value and out-of-image neighbours contribute nothing. At the
kinks (integer coordinates) the gradient is the one-sided derivative from above; at exactly y = -1 or x = -1
too with ``border_gradient="torchvision"``, while ``"mmcv"`` counts those points as outside (derivative 0).

Non-finite offsets (csrc/sampling.h): a point with a NaN coordinate samples NaN, with NaN derivatives in y and
x, and reads no pixel; +-inf or huge coordinates are outside (0, derivative 0). The mask multiplies the sample,
so a non-finite mask propagates as a multiplication does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._checks import IntPair, check_args, check_border_gradient


class _NanPoints(torch.autograd.Function):
    """0 where a point's coordinates are numbers and NaN where either is NaN, with derivatives in y and x that
    are NaN there and 0 elsewhere: added to the samples, it makes a NaN point's value and derivatives NaN."""

    @staticmethod
    def forward(ctx, y: Tensor, x: Tensor) -> Tensor:
        nan = torch.isnan(y) | torch.isnan(x)
        ctx.save_for_backward(nan)
        return torch.zeros_like(y).masked_fill(nan, float("nan"))

    @staticmethod
    def backward(ctx, grad: Tensor):
        (nan,) = ctx.saved_tensors
        derivative = torch.zeros_like(grad).masked_fill(nan, float("nan"))
        return derivative, derivative


def _bilinear(images: Tensor, y: Tensor, x: Tensor, border_gradient: str) -> Tensor:
    """Samples ``images`` [B, G, C, H, W] at points y, x [B, G, N] -> [B, G, C, N]."""
    batch, groups, channels, height, width = images.shape
    # The value at -1 is 0 either way (the in-image neighbours' weights are 0). With >= -1 the gradient there is
    # the one-sided derivative from above (torchvision's); with > -1 the point is outside, derivative 0 (mmcv's).
    y_in, x_in = y, x
    if border_gradient == "mmcv":
        inside = (y > -1) & (y < height) & (x > -1) & (x < width)
    else:
        inside = (y >= -1) & (y < height) & (x >= -1) & (x < width)
    # Outside (or NaN) points are moved to 0 before the integer conversion; they are masked out below.
    y = torch.where(inside, y, torch.zeros_like(y))
    x = torch.where(inside, x, torch.zeros_like(x))
    y0, x0 = torch.floor(y), torch.floor(x)
    ly, lx = y - y0, x - x0
    flat = images.reshape(batch, groups, channels, height * width)
    value = _NanPoints.apply(y_in, x_in).unsqueeze(2).expand(batch, groups, channels, y.shape[-1])
    if height * width == 0:
        return value
    for dy, dx, weight in ((0, 0, (1 - ly) * (1 - lx)), (0, 1, (1 - ly) * lx), (1, 0, ly * (1 - lx)), (1, 1, ly * lx)):
        yy, xx = y0 + dy, x0 + dx
        valid = inside & (yy >= 0) & (yy <= height - 1) & (xx >= 0) & (xx <= width - 1)
        index = (yy.clamp(0, height - 1) * width + xx.clamp(0, width - 1)).long()
        gathered = torch.gather(flat, 3, index.unsqueeze(2).expand(batch, groups, channels, index.shape[-1]))
        term = weight.unsqueeze(2) * gathered
        value = value + torch.where(valid.unsqueeze(2), term, torch.zeros_like(term))
    return value


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
