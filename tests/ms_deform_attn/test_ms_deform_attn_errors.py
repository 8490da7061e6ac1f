"""Every bad input to ms_deform_attn gets a clear error naming the argument, the expected and the actual value:
the ms_deform_attn table of docs/errors.md, row by row, through the public function, through both ops and in a
child process; the fake kernels' checks; the C++ backstop's own messages."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers.bad_inputs import ATTENTION_CALLS
from helpers.errors_doc import ERRORS, table
from helpers.ms_deform_attn import Case, make_case

import deform_conv

ROWS = table("ms_deform_attn")
NAMES = ("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights")


def standard_case() -> Case:
    """docs/errors.md's standard case: value (2, 27, 3, 4) float32 over levels (4, 5), (2, 3), (1, 1)."""
    return make_case(torch.float32, levels=((4, 5), (2, 3), (1, 1)), batch=2, queries=6, heads=3, channels=4,
                     points=2)


def arguments(case: Case, **changes):
    args = dict(zip(NAMES, case.args()))
    args.update(changes)
    return [args[name] for name in NAMES]


def call(case: Case, **changes):
    return deform_conv.ms_deform_attn(*arguments(case, **changes))


def direct_call(case: Case, **changes):
    return torch.ops.deform_conv.ms_deform_attn(*arguments(case, **changes))


def direct_backward_call(case: Case, **changes):
    grad_output = torch.ones(2, 6, 12)  # the standard case's output shape: a valid grad_output
    return torch.ops.deform_conv.ms_deform_attn_backward(grad_output, *arguments(case, **changes))


@pytest.fixture
def case() -> Case:
    return standard_case()


def test_the_standard_case_is_valid(case):
    """The premise of every row: unchanged, the call succeeds."""
    assert call(case).shape == (2, 6, 12)
    assert case.level_start_index.tolist() == [0, 20, 26] and case.value.shape == (2, 27, 3, 4)
    grads = direct_backward_call(case)
    assert [g.shape for g in grads] == [case.value.shape, case.sampling_locations.shape, case.attention_weights.shape]


def test_every_documented_row_is_tested_and_every_tested_input_documented():
    assert set(ROWS) == set(ATTENTION_CALLS)


@pytest.mark.parametrize("row", sorted(ROWS))
def test_bad_input_raises_the_documented_error(case, row):
    error, message = ROWS[row]
    with pytest.raises(ERRORS[error]) as raised:
        call(case, **ATTENTION_CALLS[row](case))
    assert str(raised.value) == message


# Where the C++ checks are not what refuses the input first: none (a sparse tensor meets the kernel registered for
# the sparse keys, which names the argument: _ops/shared/registration.py).
REFUSED_BEFORE_THE_CPP_CHECKS: set = set()


@pytest.mark.parametrize("op", [direct_call, direct_backward_call], ids=["forward", "backward"])
@pytest.mark.parametrize("row", sorted(ROWS))
def test_direct_op_call_refuses_it_too(case, row, op):
    """The schema's type check, the C++ backstop or (for a meta tensor among CPU ones) the fake kernel's Python
    checks: an error whose first line names the argument."""
    with pytest.raises((RuntimeError, ValueError, TypeError)) as raised:
        op(case, **ATTENTION_CALLS[row](case))
    if row not in REFUSED_BEFORE_THE_CPP_CHECKS:
        argument = row.split()[0]
        assert argument in str(raised.value).splitlines()[0], f"{raised.value} does not name {argument}"


def test_no_bad_input_crashes_the_process():
    """Every row, through the public function and both ops, in a child process: an error each time, and the
    process lives to say so."""
    code = textwrap.dedent(
        """
        import sys, torch
        sys.path[:0] = sys.argv[1:]  # this file's folder, and tests/ for helpers
        from helpers.bad_inputs import ATTENTION_CALLS
        from test_ms_deform_attn_errors import call, direct_call, direct_backward_call, standard_case
        refused = 0
        for row, changes in ATTENTION_CALLS.items():
            for fn in (call, direct_call, direct_backward_call):
                case = standard_case()
                try:
                    fn(case, **changes(case))
                except Exception:
                    refused += 1
        print("refused", refused)
        """
    )
    tests = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(tests)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"the child died (exit {result.returncode}):\n{result.stderr[-3000:]}"
    assert result.stdout.split()[-1] == str(3 * len(ATTENTION_CALLS))


def test_fake_kernels_check_shapes_like_the_real_ones(case):
    """On meta tensors (no data) the ops run their fake kernels, which refuse the shapes the real ones refuse
    (the level values they cannot read)."""
    meta = [t.to("meta") for t in case.args()]
    out = torch.ops.deform_conv.ms_deform_attn(*meta)
    assert out.shape == (2, 6, 12) and out.device.type == "meta"
    grads = torch.ops.deform_conv.ms_deform_attn_backward(torch.empty(2, 6, 12, device="meta"), *meta)
    assert [g.shape for g in grads] == [meta[0].shape, meta[3].shape, meta[4].shape]
    with pytest.raises(ValueError, match=r"^attention_weights must have shape \(2, 6, 3, 3, 2\)"):
        torch.ops.deform_conv.ms_deform_attn(*meta[:4], meta[4][..., :1])
    with pytest.raises(ValueError, match=r"^sampling_locations must have shape \(2, 6, 3, 3, 2, 2\)"):
        torch.ops.deform_conv.ms_deform_attn_backward(torch.empty(2, 6, 12, device="meta"), *meta[:3],
                                                      meta[3][:, :, :2], meta[4])
    with pytest.raises(ValueError, match=r"^grad_output must have shape \(2, 6, 12\), got \(2, 6, 11\)"):
        torch.ops.deform_conv.ms_deform_attn_backward(torch.empty(2, 6, 11, device="meta"), *meta)


def test_direct_op_call_has_a_backstop(case):
    """torch.ops.deform_conv.* skip the Python checks; the C++ ops still refuse with a message of their own,
    the level values included (read from the CPU tensors)."""
    ops = torch.ops.deform_conv
    args = case.args()
    with pytest.raises(RuntimeError, match=r"^value.shape\[1\] must be the levels' pixel count sum\(H_l \* W_l\) "
                                           r"from spatial_shapes, got 26, fewer than the 26 \+ 1 \* 1 that levels 0 "
                                           r"to 2 need"):
        ops.ms_deform_attn(args[0][:, :-1], *args[1:])
    with pytest.raises(RuntimeError, match=r"^value.shape\[1\] must be the levels' pixel count sum\(H_l \* W_l\) = "
                                           r"27 from spatial_shapes, got 28"):
        ops.ms_deform_attn(torch.cat([args[0], args[0][:, :1]], 1), *args[1:])
    with pytest.raises(RuntimeError, match=r"^level_start_index\[1\] must be 20 \(the pixels of the levels before "
                                           r"it, sum of H_l \* W_l\), got 19"):
        ops.ms_deform_attn(args[0], args[1], torch.tensor([0, 19, 26]), *args[3:])
    with pytest.raises(RuntimeError, match=r"^spatial_shapes\[2\] \(height, width\) must be at least 1x1, "
                                           r"got \(1, 0\)"):
        ops.ms_deform_attn(args[0], torch.tensor([[4, 5], [2, 3], [1, 0]]), *args[2:])
    with pytest.raises(RuntimeError, match=r"^attention_weights must have shape \[2, 6, 3, 3, 2\] "
                                           r"\[batch, queries, heads, levels, points\], got \[2, 6, 3, 3, 1\]"):
        ops.ms_deform_attn(*args[:4], args[4][..., :1])
    with pytest.raises(RuntimeError, match=r"^grad_output must have value's dtype and device \(Float, cpu\), "
                                           r"got Double, cpu"):
        ops.ms_deform_attn_backward(torch.ones(2, 6, 12, dtype=torch.float64), *args)
    with pytest.raises(RuntimeError, match=r"^grad_output must have shape \[2, 6, 12\], got \[2, 6, 11\]"):
        ops.ms_deform_attn_backward(torch.ones(2, 6, 11), *args)
