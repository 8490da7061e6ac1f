"""DCNv3's pure-PyTorch reference, written from the op's formula (csrc/sampled_sum/points.h's ConvGrid, InternImage's
CUDA kernel), not from grid_sample: the ground truth of the tests (differentiable by autograd) and what devices
without compiled kernels run. DCNv4's reference is written on it."""

from __future__ import annotations

import torch
from torch import Tensor

from ..shared.reference import _bilinear
from ..shared.checks import IntPair
from .checks import GridSizes, check_dcnv3_args


def grid_coordinates(s: GridSizes, offsets: Tensor, offset_scale: float, remove_center: bool, dtype: torch.dtype):
    """x and y [N, H_out, W_out, G, K] of every point from offsets [N, H_out, W_out, G, K, 2] (x, y)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = s.kernel_size, s.stride, s.padding, s.dilation
    taps = [(i * dw, j * dh) for i in range(kw) for j in range(kh)
            if not (remove_center and i == kw // 2 and j == kh // 2)]
    device = offsets.device
    tap_x = torch.tensor([t[0] for t in taps], dtype=dtype, device=device)
    tap_y = torch.tensor([t[1] for t in taps], dtype=dtype, device=device)
    half_w, half_h = (dw * (kw - 1)) // 2, (dh * (kh - 1)) // 2
    base_x = (half_w - pw + sw * torch.arange(s.out_width, device=device)).to(dtype) - half_w * offset_scale
    base_y = (half_h - ph + sh * torch.arange(s.out_height, device=device)).to(dtype) - half_h * offset_scale
    x = base_x.view(1, 1, -1, 1, 1) + (tap_x + offsets[..., 0].to(dtype)) * offset_scale
    y = base_y.view(1, -1, 1, 1, 1) + (tap_y + offsets[..., 1].to(dtype)) * offset_scale
    return x, y


def grid_sum(input: Tensor, s: GridSizes, x: Tensor, y: Tensor, weights: Tensor) -> Tensor:
    """sum over K of weights * the bilinear sample of input at (x, y), all [N, H_out, W_out, G, K] -> output
    [N, H_out, W_out, G * C] in input's dtype (computed in x's dtype)."""
    n, h, w, c = input.shape
    g, k = s.group, s.points
    images = input.to(x.dtype).reshape(n, h, w, g, c // g).permute(0, 3, 4, 1, 2)  # [N, G, C, H, W]
    flat = lambda t: t.permute(0, 3, 1, 2, 4).reshape(n, g, s.out_height * s.out_width * k)  # noqa: E731
    # InternImage's kernel leaves a point at exactly -1 out: mmcv's derivative there.
    samples = _bilinear(images, flat(y), flat(x), "mmcv").view(n, g, c // g, s.out_height, s.out_width, k)
    out = (samples * weights.to(x.dtype).permute(0, 3, 1, 2, 4).unsqueeze(2)).sum(-1)  # [N, G, C, H_out, W_out]
    return out.permute(0, 3, 4, 1, 2).reshape(n, s.out_height, s.out_width, c).to(input.dtype)


def point_dtype(dtype: torch.dtype) -> torch.dtype:
    """What coordinates are computed in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dcnv3_reference(input: Tensor, offset: Tensor, mask: Tensor, kernel_size: IntPair, stride: IntPair = 1,
                    padding: IntPair = 0, dilation: IntPair = 1, group: int = 1, offset_scale: float = 1.0,
                    remove_center: bool = False) -> Tensor:
    """:func:`deform_conv.dcnv3` in plain PyTorch (same arguments)."""
    s = check_dcnv3_args(input, offset, mask, kernel_size, stride, padding, dilation, group, offset_scale,
                         remove_center)
    return checked_dcnv3_reference(input, offset, mask, s, float(offset_scale), remove_center)


def checked_dcnv3_reference(input: Tensor, offset: Tensor, mask: Tensor, s: GridSizes, offset_scale: float,
                            remove_center: bool) -> Tensor:
    """dcnv3 of checked arguments (their sizes ``s``)."""
    dtype = point_dtype(input.dtype)
    offsets = offset.reshape(s.batch, s.out_height, s.out_width, s.group, s.points, 2)
    x, y = grid_coordinates(s, offsets, offset_scale, remove_center, dtype)
    weights = mask.reshape(s.batch, s.out_height, s.out_width, s.group, s.points)
    return grid_sum(input, s, x, y, weights)
