"""The bilinear sampling the ops' pure-PyTorch references are written with (``_bilinear``): the one copy of
the sampling math on the Python side, as csrc/sampling.h is on the C++ side.

Differentiable by autograd, so the references' gradients are the ground truth for ours. Semantics as in
torchvision: a sampling point with y <= -1, y >= H, x <= -1 or x >= W gives 0; otherwise each in-image neighbour
contributes its bilinear weight times its value and out-of-image neighbours contribute nothing. At the
kinks (integer coordinates) the gradient is the one-sided derivative from above; at exactly y = -1 or x = -1
too with ``border_gradient="torchvision"``, while ``"mmcv"`` counts those points as outside (derivative 0).

Non-finite coordinates (csrc/sampling.h): a point with a NaN coordinate samples NaN, with NaN derivatives in y
and x, and reads no pixel; +-inf or huge coordinates are outside (0, derivative 0).
"""

from __future__ import annotations

import torch
from torch import Tensor


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
