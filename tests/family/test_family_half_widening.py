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


def test_every_bfloat16_product_is_rounded_as_torch_rounds():
    """The forward rounds its float32 sums to bfloat16 16 lanes at a time, on the bits or (a library built for
    AVX512-BF16) with the CPU's instruction, which reads a subnormal as zero and keeps a NaN's sign and payload:
    lanes holding either must come out as c10::BFloat16 rounds them all the same. Each pattern times a weight of
    1.5 (a tie to even wherever the pattern's last bit is set), 2**-20 (subnormal products), 0.7 or 3: one float32
    product, rounded once."""
    patterns = all_patterns(torch.bfloat16)
    groups = patterns.numel()
    value = torch.zeros(1, 4, groups, CHANNELS, dtype=torch.bfloat16)
    value[0, 0, :, 0] = patterns
    location = torch.full((1, 1, groups, 1, 1, 2), 0.25)
    factors = torch.tensor([1.5, 2.0**-20, 0.7, 3.0]).repeat(groups // 4)
    out = deform_conv.ms_deform_attn(value, torch.tensor([[2, 2]]), torch.tensor([0]), location,
                                     factors.view(1, 1, groups, 1, 1))
    got = out.view(groups, CHANNELS)[:, 0]
    products = patterns.float() * factors
    nan = products.isnan()
    expected = products.to(torch.bfloat16)
    assert torch.equal(got[~nan], expected[~nan])
    assert (got[nan].view(torch.int16) == 0x7FC0).all()  # c10::BFloat16's NaN, whatever the sign and payload
    ties = (products.view(torch.int32) & 0xFFFF) == 0x8000
    subnormal = (expected != 0) & (expected.abs() < torch.finfo(torch.bfloat16).tiny)
    assert ties.any() and subnormal.any() and (patterns[nan].view(torch.int16) < 0).any()
