"""The family's CPU kernels widen float16 and bfloat16 values to float32 themselves, 16 lanes at a time
(csrc/cpu_lanes.h): every one of the 65,536 bit patterns must come out as torch's own conversion gives it
(subnormals and infinities included; a NaN must stay a NaN), in the forward and in the backward.

One level of 2x2 pixels, one query, and a group per pattern (16 channels each: the pattern in channel 0, zeros
elsewhere); one point per group exactly on pixel (0, 0), where the pattern sits, with weight 1. Its bilinear
weights are then (1, 0, 0, 0) and the other three pixels are zeros, so the forward's sum is the pattern widened and
rounded back (the same value, since widening is exact; -0 becomes +0, as any sum from +0 makes it), and with grad_output one-hot on channel 0 the weight's
gradient is the pattern widened (in float32: the weights are float32)."""

from __future__ import annotations

import pytest
import torch

import deform_conv

CHANNELS = 16  # one vector of lanes: the kernels' vector paths


def all_patterns(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_half_value_is_widened_exactly(dtype):
    patterns = all_patterns(dtype)
    groups = patterns.numel()
    value = torch.zeros(1, 4, groups, CHANNELS, dtype=dtype)
    value[0, 0, :, 0] = patterns
    location = torch.full((1, 1, groups, 1, 1, 2), 0.25)  # (0 + 0.5) / 2: pixel 0 of a 2-pixel side
    weight = torch.ones(1, 1, groups, 1, 1, requires_grad=True)
    out = deform_conv.ms_deform_attn(value, torch.tensor([[2, 2]]), torch.tensor([0]), location, weight)
    out = out.view(groups, CHANNELS)
    nan = patterns.isnan()
    assert torch.equal(out[~nan, 0], patterns[~nan])  # by value: the sum starts at +0, so -0 comes back +0
    assert out[nan, 0].isnan().all()
    assert not out[:, 1:].any()

    grad_output = torch.zeros(1, 1, groups * CHANNELS, dtype=dtype)
    grad_output.view(groups, CHANNELS)[:, 0] = 1
    (grad_weight,) = torch.autograd.grad(out.view(1, 1, -1), weight, grad_output)
    widened = patterns.float()
    got = grad_weight.view(groups)
    assert torch.equal(got[~nan], widened[~nan])
    assert got[nan].isnan().all()
