"""deform_conv2d's CPU backward sums over channels in the order csrc/cpu_lanes.h fixes, whatever the instruction
set the library was compiled for (see tests/family/test_family_lane_order.py). A 1x1 layer whose weight is the
identity passes grad_output to the columns' gradient unchanged; with zero offsets every point sits on its pixel
(bilinear weights (1, 0, 0, 0)), so the mask's gradient at an interior pixel is the one dot product
grad_output[:, pixel] . input[:, pixel], as the kernel sums it. Depthwise layers sum their own products
(grad_output * weight) against each corner's values: with a weight of ones, the same dot product."""

from __future__ import annotations

import pytest
import torch

import deform_conv

from helpers.deform_conv2d import half_gemm_path
from helpers.lanes import lane_order_sum, sequential_sum, spread

SIZE = 4
PIXEL = (1, 2)  # interior: the four-neighbour path


def mask_gradient_at_pixel(dtype: torch.dtype, channels: int, depthwise: bool, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    x = (spread((1, channels, SIZE, SIZE), g) * scale).to(dtype)
    grad_output = (spread((1, channels, SIZE, SIZE), g) * scale).to(dtype)
    weight = (torch.ones(channels, 1, 1, 1) if depthwise else torch.eye(channels).view(channels, channels, 1, 1))
    mask = torch.ones(1, 1, SIZE, SIZE, dtype=dtype, requires_grad=True)
    out = deform_conv.deform_conv2d(x, torch.zeros(1, 2, SIZE, SIZE, dtype=dtype), weight.to(dtype), mask=mask)
    (grad_mask,) = torch.autograd.grad(out, mask, grad_output)
    y, x_ = PIXEL
    return grad_mask[0, 0, y, x_], grad_output[0, :, y, x_], x[0, :, y, x_]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels", [16, 40, 71])
@pytest.mark.parametrize("depthwise", [False, True], ids=["columns", "depthwise"])
def test_the_backward_sums_channels_in_the_lane_order(dtype, channels, depthwise):
    differs_from_sequential = 0
    for seed in range(4):
        got, grad_output, pixel = mask_gradient_at_pixel(dtype, channels, depthwise, seed)
        expected = lane_order_sum(grad_output, pixel, dtype)
        assert got.item() == expected.item(), (seed, got.item(), expected.item())
        differs_from_sequential += expected.item() != sequential_sum(grad_output, pixel, dtype).item()
    assert differs_from_sequential > 0


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("channels", [12, 40, 71])
def test_the_half_backward_sums_its_image_in_the_lane_order(half, channels):
    """On the native half path the coordinates' pass reads the half-type image as it is, widening its channels in
    registers (16, 8 and 4 at a time, the last ones one by one: 12 = 8 + 4, 40 = 2 x 16 + 8, 71 = 4 x 16 + 4 + 3),
    and sums in float32 in the lane order; the mask's gradient is that sum rounded once."""
    for seed in range(3):
        with half_gemm_path("portable"):
            got, grad_output, pixel = mask_gradient_at_pixel(half, channels, False, seed, scale=0.05)
        expected = lane_order_sum(grad_output.float(), pixel.float(), torch.float32).to(half)
        assert torch.equal(got, expected), (seed, got.item(), expected.item())
