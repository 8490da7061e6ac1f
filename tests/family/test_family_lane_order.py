"""The family's CPU backward sums over channels in the order csrc/cpu_lanes.h fixes: channel d to lane d % 16,
then the lanes added pairwise (j + j + 8, j + j + 4, j + j + 2, 0 + 1), whatever the instruction set the library
was compiled for. A point exactly on a pixel has bilinear weights (1, 0, 0, 0), so its attention weight's gradient
is that one dot product, grad_output . value[pixel], as the kernel sums it: it must have the bits of the same sum
taken here in that order, step by step, in the accumulation dtype. This runs on every CPU the suite runs on, so an
AVX2, an AVX-512 and a baseline library are each held to the one order (and so to each other's bits)."""

from __future__ import annotations

import pytest
import torch

import deform_conv

from helpers.lanes import lane_order_sum, sequential_sum, spread

HEIGHT = WIDTH = 4
PIXEL = (1, 2)  # (y, x): interior, so that the kernel takes its four-neighbour path


def weight_gradient_of_one_point(value_dtype: torch.dtype, channels: int, seed: int):
    """ms_deform_attn with one query, one point at PIXEL exactly: (d loss / d weight, grad_output, the pixel)."""
    g = torch.Generator().manual_seed(seed)
    value = spread((1, HEIGHT * WIDTH, 1, channels), g).to(value_dtype)
    points_dtype = torch.float64 if value_dtype == torch.float64 else torch.float32
    y, x = PIXEL  # the point is at pixel (y, x): location * size - 0.5 = y, x exactly
    location = torch.tensor([(x + 0.5) / WIDTH, (y + 0.5) / HEIGHT], dtype=points_dtype).view(1, 1, 1, 1, 1, 2)
    weight = torch.ones(1, 1, 1, 1, 1, dtype=points_dtype, requires_grad=True)
    grad_output = torch.randn(1, 1, channels, generator=g, dtype=torch.float64).to(value_dtype)
    out = deform_conv.ms_deform_attn(value, torch.tensor([[HEIGHT, WIDTH]]), torch.tensor([0]), location, weight)
    (grad_weight,) = torch.autograd.grad(out, weight, grad_output)
    return grad_weight.reshape(()), grad_output.reshape(-1), value[0, y * WIDTH + x, 0]


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("channels", [16, 40, 71])  # whole blocks of lanes, and a tail of 8 or 7 channels
def test_the_backward_sums_channels_in_the_lane_order(value_dtype, channels):
    accumulate = torch.float64 if value_dtype == torch.float64 else torch.float32
    differs_from_sequential = 0
    for seed in range(4):
        got, grad_output, pixel = weight_gradient_of_one_point(value_dtype, channels, seed)
        expected = lane_order_sum(grad_output, pixel, accumulate)
        assert got.to(accumulate).item() == expected.item(), (seed, got.item(), expected.item())
        differs_from_sequential += expected.item() != sequential_sum(grad_output, pixel, accumulate).item()
    assert differs_from_sequential > 0  # the data can tell the lane order from a plain sum
