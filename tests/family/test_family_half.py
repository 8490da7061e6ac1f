"""The half types: a float16 or bfloat16 input (value) beside float32 offsets / offset_mask / sampling_loc_attn, and
beside points of its own type. The call is accepted, the output (and the input's gradient) has the input's dtype,
the points' gradient the points' dtype, and the output is within a bound derived from the half type's eps of the
float64 reference on the same (rounded) arguments.

The bound. The CPU kernels read the half arguments exactly into float32 (coordinates are never computed in a half
type), compute there and round each output once to the half type. With u = eps / 2 of the half type, S the sum of
|weights| of an output element's points (after the softmax where there is one) and V = max|value|:

    |output| <= S V                                  (bilinear samples are convex combinations of values, or less)
    final rounding          <= u |output| + the half type's subnormal spacing / 2  <= u S V + tiny eps / 2
    float32's own error     <= float32_bound (helpers/family.py: the same S V times float32's eps and the
                               coordinates' magnitude), which this test checks is below u S V for its cases
    total                   <= eps S V + tiny eps / 2

Nothing grows with the number of points but float32's share, so an accumulator in the half type (K roundings of
partial sums up to S V) would exceed it."""

from __future__ import annotations

import pytest
import torch

from helpers.family import (GRAD_NAMES, HALF_TYPES, PUBLIC, REFERENCE, Case, assert_within, float32_bound,
                            grad_output_for, make_dcnv3, make_dcnv4, make_flash, weight_sums)

CASES = {
    "dcnv3_awkward": lambda: make_dcnv3(),
    "dcnv3_K25_c71": lambda: make_dcnv3(kernel=5, stride=1, padding=2, dilation=1, group=1, group_channels=71,
                                        size=(5, 4), batch=1),
    "dcnv3_remove_center_scale2": lambda: make_dcnv3(kernel=3, stride=1, padding=1, group=3, group_channels=3,
                                                     remove_center=True, offset_scale=2.0),
    "dcnv4_mask": lambda: make_dcnv4(extra_channels=3),
    "dcnv4_softmax": lambda: make_dcnv4(softmax=True, extra_channels=3, kernel=(2, 3), dilation=(1, 2),
                                        padding=(0, 1), offset_scale=0.5),
    "flash_3_levels": lambda: make_flash(),
    "flash_1_level_1_point": lambda: make_flash(levels=((6, 5),), n_points=1),
}


def half_bound(case: Case) -> torch.Tensor:
    dtype = case.value.dtype
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).smallest_normal
    scale = weight_sums(case) * float(case.value.abs().max())
    # The premise of the bound (module docstring): float32's share is below one u of the half type.
    assert torch.all(float32_bound(case) <= eps / 2 * scale)
    return eps * scale + tiny * eps / 2


@pytest.mark.parametrize("points_dtype", ["float32", "same"], ids=["fp32_points", "half_points"])
@pytest.mark.parametrize("half", HALF_TYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_half_input_within_the_bound(name, half, points_dtype):
    case = CASES[name]().to(half, torch.float32 if points_dtype == "float32" else half)
    out = PUBLIC[case.op](*case.args)
    assert out.dtype == half
    expected = REFERENCE[case.op](*case.double().args)
    assert_within(out, expected, half_bound(case), f"{name} in {half}")


@pytest.mark.parametrize("points_dtype", ["float32", "same"], ids=["fp32_points", "half_points"])
@pytest.mark.parametrize("half", HALF_TYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["dcnv3_awkward", "dcnv4_softmax", "flash_3_levels"])
def test_half_gradients_have_their_arguments_dtypes(name, half, points_dtype):
    """The backward runs, finite, each gradient in its argument's dtype (autograd would otherwise cast it)."""
    case = CASES[name]().to(half, torch.float32 if points_dtype == "float32" else half)
    out = getattr(torch.ops.deform_conv, case.op)(*case.args)
    grads = getattr(torch.ops.deform_conv, case.op + "_backward")(grad_output_for(out), *case.args)
    for grad_name, g, t in zip(GRAD_NAMES[case.op][1:], grads, case.floats()):
        assert g.dtype == t.dtype and g.shape == t.shape, grad_name
        assert torch.isfinite(g).all(), grad_name


@pytest.mark.parametrize("half", HALF_TYPES, ids=["fp16", "bf16"])
def test_points_of_the_other_half_type_are_refused(half):
    other = torch.bfloat16 if half == torch.float16 else torch.float16
    case = make_dcnv3().to(half, other)
    with pytest.raises(TypeError, match=rf"^offset must have input's dtype {half} or float32, got {other}"):
        PUBLIC["dcnv3"](*case.args)
