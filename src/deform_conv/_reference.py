"""Slow, plainly written pure-PyTorch versions of both ops: the ground truth of the tests.

``deform_conv2d_reference`` and ``ms_deform_attn_reference`` are written from the definitions with the same
bilinear sampling (``_bilinear``); ``ms_deform_attn_grid_sample`` is the composition of ``grid_sample`` calls
Deformable DETR ships as its pure-PyTorch version (a second, independent check, and the graph the ONNX export
emits).

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

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ._checks import IntPair, check_args, check_border_gradient, check_ms_deform_attn_args


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


def ms_deform_attn_reference(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
) -> Tensor:
    """Same arguments and result as :func:`deform_conv.ms_deform_attn`, from the definition:

    out[n, q, m * D + d] = sum over levels l and points p of attention_weights[n, q, m, l, p] * (value of level l,
    head m, channel d, bilinearly sampled at pixel (x * W_l - 0.5, y * H_l - 0.5)), where (x, y) =
    sampling_locations[n, q, m, l, p]: grid_sample's convention (align_corners=False, pixel centres at
    (i + 0.5) / size) with zero outside the image.

    value [N, S, M, D], spatial_shapes [L, 2], level_start_index [L], sampling_locations [N, Lq, M, L, P, 2],
    attention_weights [N, Lq, M, L, P] -> [N, Lq, M * D].
    """
    sizes = check_ms_deform_attn_args(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights)
    batch, _, heads, channels = value.shape
    queries, points = sizes.queries, sizes.points
    out = value.new_zeros((batch, heads, channels, queries))
    for level, ((height, width), start) in enumerate(zip(spatial_shapes.tolist(), level_start_index.tolist())):
        pixels = value[:, start:start + height * width]  # [N, H*W, M, D]
        images = pixels.permute(0, 2, 3, 1).reshape(batch, heads, channels, height, width)
        location = sampling_locations[:, :, :, level].permute(0, 2, 1, 3, 4)  # [N, M, Lq, P, 2]
        x = (location[..., 0] * width - 0.5).reshape(batch, heads, queries * points)
        y = (location[..., 1] * height - 0.5).reshape(batch, heads, queries * points)
        sampled = _bilinear(images, y, x, "torchvision")  # [N, M, D, Lq * P]
        weights = attention_weights[:, :, :, level].permute(0, 2, 1, 3).reshape(batch, heads, 1, queries * points)
        out = out + (sampled * weights).reshape(batch, heads, channels, queries, points).sum(-1)
    return out.permute(0, 3, 1, 2).reshape(batch, queries, heads * channels)


def ms_deform_attn_grid_sample(
    value: Tensor,
    level_shapes: List[Tuple[int, int]],
    sampling_locations: Tensor,
    attention_weights: Tensor,
) -> Tensor:
    """Deformable DETR's pure-PyTorch multi-scale deformable attention: one ``grid_sample`` a level (bilinear,
    zero padding, align_corners=False) and the weighted sum. ``level_shapes``: (H_l, W_l) of each level, as
    Python ints (the graph's constants when exported). Shapes as :func:`ms_deform_attn_reference`.

    Its values and gradients are grid_sample's, which differ from ours only at non-finite locations: at +-inf
    grid_sample samples NaN (ours 0), and at a NaN location it gives the NaN coordinate's own gradient as 0 (ours
    NaN for both)."""
    batch, _, heads, channels = value.shape
    _, queries, _, levels, points, _ = sampling_locations.shape
    per_level = value.split([height * width for height, width in level_shapes], dim=1)
    grids = 2 * sampling_locations - 1
    samples = []
    for level, (height, width) in enumerate(level_shapes):
        # [N, H*W, M, D] -> [N*M, D, H, W]
        images = per_level[level].flatten(2).transpose(1, 2).reshape(batch * heads, channels, height, width)
        grid = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)  # [N*M, Lq, P, 2]
        samples.append(F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False))
    weights = attention_weights.transpose(1, 2).reshape(batch * heads, 1, queries, levels * points)
    out = (torch.stack(samples, dim=-2).flatten(-2) * weights).sum(-1)  # [N*M, D, Lq]
    return out.view(batch, heads * channels, queries).transpose(1, 2).contiguous()
