"""Slow, plainly written pure-PyTorch versions of multi-scale deformable attention: the ground truth of the tests.

``ms_deform_attn_reference`` is written from the definition on the bilinear sampling deform_conv2d's reference
uses too (``shared/reference.py``); ``ms_deform_attn_grid_sample`` is the composition of ``grid_sample`` calls
Deformable DETR ships as its pure-PyTorch version (a second, independent check, and the graph the ONNX export
emits). Both are differentiable by autograd, so their gradients are the reference for ours.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..shared.reference import _bilinear
from .checks import check_ms_deform_attn_args


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
    # Float32 locations or weights beside a half value: computed in float32, rounded to value's dtype once.
    dtype = torch.promote_types(torch.promote_types(value.dtype, sampling_locations.dtype), attention_weights.dtype)
    out = value.new_zeros((batch, heads, channels, queries), dtype=dtype)
    for level, ((height, width), start) in enumerate(zip(spatial_shapes.tolist(), level_start_index.tolist())):
        pixels = value[:, start:start + height * width]  # [N, H*W, M, D]
        images = pixels.permute(0, 2, 3, 1).reshape(batch, heads, channels, height, width).to(dtype)
        location = sampling_locations[:, :, :, level].permute(0, 2, 1, 3, 4)  # [N, M, Lq, P, 2]
        x = (location[..., 0] * width - 0.5).reshape(batch, heads, queries * points)
        y = (location[..., 1] * height - 0.5).reshape(batch, heads, queries * points)
        sampled = _bilinear(images, y, x, "torchvision")  # [N, M, D, Lq * P]
        weights = attention_weights[:, :, :, level].permute(0, 2, 1, 3).reshape(batch, heads, 1, queries * points)
        out = out + (sampled * weights).reshape(batch, heads, channels, queries, points).sum(-1)
    return out.permute(0, 3, 1, 2).reshape(batch, queries, heads * channels).to(value.dtype)


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
