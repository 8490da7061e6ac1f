"""Non-finite offsets and masks (csrc/sampling.h): a NaN coordinate samples NaN, with NaN derivatives in y and x,
and reads no pixel; +-inf and huge coordinates are outside the image (0, derivative 0, whatever the mask); a
non-finite mask propagates as a multiplication. On the GEMM path and the depthwise path, in every CPU dtype.
Run under AddressSanitizer by scripts/sanitize-tests: no such input reads or writes out of bounds."""

from __future__ import annotations

import pytest
import torch

from helpers.deform_conv2d import assert_all_close_nonfinite, make_case, output_and_grads, with_special_offsets

import deform_conv

ours = deform_conv.deform_conv2d
reference = deform_conv.deform_conv2d_reference

PATHS = {
    "gemm": dict(),
    "depthwise": dict(in_channels=6, out_channels=6, groups=6, offset_groups=3),
}


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_offsets_match_the_reference(dtype, path):
    case = make_case(dtype, **PATHS[path])
    with_special_offsets(case, dtype)
    assert_all_close_nonfinite(output_and_grads(ours, case), output_and_grads(reference, case), dtype)


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_offsets_follow_the_documented_rules(path):
    case = make_case(torch.float64, **PATHS[path])
    nan_points, far_points = with_special_offsets(case, torch.float64)
    out, grad_input, grad_offset, grad_weight, grad_bias, grad_mask = output_and_grads(ours, case)

    for n, channel, oy, ox in nan_points:
        point = channel // 2                               # (offset group, tap) of the offset channel
        # The NaN sample poisons its output pixel (in the weight groups that read its channels) ...
        assert torch.isnan(out[n, :, oy, ox]).any()
        # ... and both of its coordinate derivatives, and its mask's gradient.
        assert torch.isnan(grad_offset[n, 2 * point: 2 * point + 2, oy, ox]).all()
        assert torch.isnan(grad_mask[n, point, oy, ox])
    # It reads no pixel, so the input's gradient stays finite; the weight's sums over the NaN column.
    assert torch.isfinite(grad_input).all()
    assert torch.isnan(grad_weight).any() and torch.isfinite(grad_bias).all()

    # +-inf and huge points are outside: exactly 0 derivative for their coordinates.
    for n, channel, oy, ox in far_points:
        assert grad_offset[n, channel, oy, ox] == 0
    # Without the NaN points, everything is finite.
    case.offset = torch.nan_to_num(case.offset, nan=0.5)
    assert all(torch.isfinite(r).all() for r in output_and_grads(ours, case))


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_masks_match_the_reference(dtype, path):
    case = make_case(dtype, **PATHS[path])
    with_special_offsets(case, dtype)
    mask = case.mask.clone()
    mask[2, 4, 1, 1] = float("inf")
    mask[0, 2, 2, 2] = float("nan")
    mask[1, 0, 0, 0] = -float("inf")
    case.mask = mask
    # inf * a sum and a sum of inf * terms may be inf or NaN depending on the order: compare finiteness.
    assert_all_close_nonfinite(output_and_grads(ours, case), output_and_grads(reference, case), dtype,
                               same_nan=False)


def test_non_finite_mask_propagates_as_a_multiplication():
    case = make_case(torch.float64, offset_scale=0.0)          # every point at its base position
    mask = torch.ones_like(case.mask)
    mask[0, 0, 0, 0] = float("nan")
    case.mask = mask
    out = ours(case.input, case.offset, case.weight, case.bias, case.stride, case.padding, case.dilation, mask)
    assert torch.isnan(out[0, :, 0, 0]).any()
    assert torch.isfinite(out[1:]).all() and torch.isfinite(out[0, :, 1:]).all()


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_non_finite_offsets_in_half_types(half, monkeypatch):
    """On the float32 path (the native forward's non-finite values: test_half_precision.py)."""
    monkeypatch.setenv("DEFORM_CONV_CPU_HALF_GEMM", "float32")
    case = make_case(torch.float32)
    with_special_offsets(case, half)
    halves = [t.to(half) for t in case.tensors()]
    out = case.call(ours, halves)
    widened = case.call(ours, [t.float() for t in halves]).to(half)
    assert torch.equal(torch.isnan(out), torch.isnan(widened))
    assert torch.equal(out.nan_to_num(), widened.nan_to_num())
