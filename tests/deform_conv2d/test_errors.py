"""Every bad input gets a clear error naming the argument, the expected and the actual value: the table in
docs/errors.md, row by row, through the public function, through torch.ops and in a child process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers.bad_inputs import CALLS, MODULES
from helpers.deform_conv2d import make_case
from helpers.errors_doc import ERRORS, table

import deform_conv


def call(case, **changes):
    args = dict(input=case.input, offset=case.offset, weight=case.weight, bias=case.bias, stride=case.stride,
                padding=case.padding, dilation=case.dilation, mask=case.mask)
    args.update(changes)
    return deform_conv.deform_conv2d(**args)


@pytest.fixture
def case():
    return make_case(torch.float32)  # input (3, 6, 13, 8), 3x2 kernel, output 6x7, 3 offset groups


CALL_ROWS = table("deform_conv2d")
MODULE_ROWS = table("Module constructors")


def test_every_documented_row_is_tested_and_every_tested_input_documented():
    assert set(CALL_ROWS) == set(CALLS)
    assert set(MODULE_ROWS) == set(MODULES)


@pytest.mark.parametrize("row", sorted(CALL_ROWS))
def test_bad_input_raises_the_documented_error(case, row):
    error, message = CALL_ROWS[row]
    with pytest.raises(ERRORS[error]) as raised:
        call(case, **CALLS[row](case))
    assert str(raised.value) == message


# Direct torch.ops calls where the C++ checks are not what refuses the input first: the schema turns True into the
# int 1 (so the call fails on the offset's shape instead). (A sparse tensor meets the kernel registered for the
# sparse keys, which names the argument: _ops/shared/registration.py.)
REFUSED_BEFORE_THE_CPP_CHECKS = {"stride bool"}


def direct_call(case, **changes):
    args = dict(input=case.input, offset=case.offset, weight=case.weight, bias=case.bias, stride=case.stride,
                padding=case.padding, dilation=case.dilation, mask=case.mask)
    args.update(changes)
    return torch.ops.deform_conv.deform_conv2d(args["input"], args["offset"], args["weight"], args["mask"],
                                               args["bias"], args["stride"], args["padding"], args["dilation"],
                                               args.get("border_gradient", "torchvision"))


@pytest.mark.parametrize("row", sorted(CALL_ROWS))
def test_direct_op_call_refuses_it_too(case, row):
    with pytest.raises((RuntimeError, ValueError, TypeError)) as raised:
        direct_call(case, **CALLS[row](case))
    if row not in REFUSED_BEFORE_THE_CPP_CHECKS:
        argument = row.split()[0]
        assert argument in str(raised.value).splitlines()[0], f"{raised.value} does not name {argument}"


def test_no_bad_input_crashes_the_process():
    """Every row, through the public function and through torch.ops, in a child process: an error each time,
    and the process lives to say so."""
    code = textwrap.dedent(
        """
        import sys, torch
        sys.path[:0] = sys.argv[1:]  # this file's folder, and tests/ for helpers
        from helpers.deform_conv2d import make_case
        from helpers.bad_inputs import CALLS
        from test_errors import call, direct_call
        refused = 0
        for row, changes in CALLS.items():
            for fn in (call, direct_call):
                case = make_case(torch.float32)
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
    assert result.stdout.split()[-1] == str(2 * len(CALLS))


def test_fake_kernel_checks_shapes_like_the_real_one(case):
    """On meta tensors (no data) the op runs its fake kernel, which must refuse what the real one refuses."""
    meta = {name: t.to("meta") for name, t in dict(input=case.input, offset=case.offset, weight=case.weight,
                                                   mask=case.mask, bias=case.bias).items()}
    out = torch.ops.deform_conv.deform_conv2d(meta["input"], meta["offset"], meta["weight"], meta["mask"],
                                              meta["bias"], [2, 1], [1, 0], [2, 1])
    assert out.shape == (3, 4, 6, 7) and out.device.type == "meta"
    with pytest.raises(ValueError, match=r"mask must have shape \(3, 18, 6, 7\)"):
        torch.ops.deform_conv.deform_conv2d(meta["input"], meta["offset"], meta["weight"], meta["mask"][:, :-1],
                                            meta["bias"], [2, 1], [1, 0], [2, 1])
    with pytest.raises(ValueError, match=r"grad_output must have shape \(3, 4, 6, 7\), got \(3, 4, 6, 6\)"):
        torch.ops.deform_conv.deform_conv2d_backward(torch.empty(3, 4, 6, 6, device="meta"), meta["input"],
                                                     meta["offset"], meta["weight"], meta["mask"], [2, 1], [1, 0],
                                                     [2, 1], True)


def test_direct_op_call_has_a_backstop(case):
    """torch.ops.deform_conv.* skips the Python checks; the C++ op still refuses bad shapes with a message."""
    with pytest.raises(RuntimeError, match=r"offset must have shape \[3, 36, 6, 7\], got \[3, 36, 5, 7\]"):
        torch.ops.deform_conv.deform_conv2d(case.input, case.offset[:, :, :-1], case.weight, case.mask, case.bias,
                                            [2, 1], [1, 0], [2, 1])
    with pytest.raises(RuntimeError, match=r"stride must be >= 1 in both dimensions, got \[0, 1\]"):
        torch.ops.deform_conv.deform_conv2d(case.input, case.offset, case.weight, case.mask, case.bias,
                                            [0, 1], [1, 0], [2, 1])
    with pytest.raises(RuntimeError, match=r"input must have at least 1 channel, got shape \[3, 0, 13, 8\]"):
        torch.ops.deform_conv.deform_conv2d(case.input[:, :0], case.offset, case.weight[:, :0], case.mask, case.bias,
                                            [2, 1], [1, 0], [2, 1])
    with pytest.raises(RuntimeError, match=r"grad_output must have the input's dtype Float, got Double"):
        torch.ops.deform_conv.deform_conv2d_backward(torch.ones(3, 4, 6, 7, dtype=torch.float64), case.input,
                                                     case.offset, case.weight, case.mask, [2, 1], [1, 0], [2, 1], True)
    with pytest.raises(RuntimeError, match=r"grad_output must have shape \[3, 4, 6, 7\], got \[3, 4, 6, 6\]"):
        torch.ops.deform_conv.deform_conv2d_backward(torch.ones(3, 4, 6, 6), case.input, case.offset, case.weight,
                                                     case.mask, [2, 1], [1, 0], [2, 1], True)


@pytest.mark.parametrize("row", sorted(MODULE_ROWS))
def test_module_constructor_raises_the_documented_error(row):
    error, message = MODULE_ROWS[row]
    cls, changes = MODULES[row]
    args = dict(in_channels=6, out_channels=6, kernel_size=3)
    args.update(changes)
    with pytest.raises(ERRORS[error]) as raised:
        getattr(deform_conv, cls)(**args)
    assert str(raised.value) == message


@pytest.mark.parametrize("stride, padding, dilation, argument", [
    ([1, 1], [1, 0], [2**63 - 1, 1], "dilation"),    # dilation * (kernel_h - 1) wrapped: tap 2 sampled row oy - 2
    ([1, 1], [2**63 - 1] * 2, [1, 1], "padding"),   # height + 2 * padding wrapped: a bias-only output
    ([1, 1], [2**62, 0], [1, 1], "padding"),
])
def test_direct_op_call_refuses_sizes_that_overflow_int64(case, stride, padding, dilation, argument):
    """TorchScript and exported programs call the op directly, where nothing in Python bounds these values: the
    C++ size arithmetic is checked (the sanitizer run executes these calls too, so it would also report a signed
    overflow the checks missed)."""
    with pytest.raises(RuntimeError, match=rf"^{argument}: .* overflows int64"):
        torch.ops.deform_conv.deform_conv2d(case.input, case.offset, case.weight, case.mask, case.bias, stride,
                                            padding, dilation)


def test_direct_op_call_refuses_an_output_too_large_to_index(case):
    """With a batch of 0 every tensor is empty whatever its other sizes, so only the checked product of the
    output's height and width stops the kernels' per-image indexing from wrapping."""
    pad = 2**40
    out_h, out_w = (13 + 2 * pad - 4 - 1) // 2 + 1, (8 + 2 * pad - 1 - 1) + 1
    offset = torch.empty_strided((0, 36, out_h, out_w), (1, 1, 1, 1))  # contiguous strides would overflow
    mask = torch.empty_strided((0, 18, out_h, out_w), (1, 1, 1, 1))
    with pytest.raises(RuntimeError, match=r"^padding/stride: the output size out_h \* out_w overflows int64"):
        torch.ops.deform_conv.deform_conv2d(case.input[:0], offset, case.weight, mask, case.bias, [2, 1],
                                            [pad, pad], [2, 1])


def test_direct_op_call_refuses_expanded_tensors_too_large_to_index(case):
    """Expanded (stride-0) tensors have any sizes without memory behind them: 2^61 channels of a 1x1 image would
    make the kernels' tile sizes (channels * bytes * pixels) wrap."""
    channels = 2**61
    image = torch.ones(1, 1, 1, 1).expand(1, channels, 1, 1)
    weight = torch.ones(1, 1, 1, 1).expand(1, channels, 1, 1)
    with pytest.raises(RuntimeError, match=r"^input: channels \* height \* width is 2305843009213693952 elements, "
                                           r"more than the 281474976710656 this op supports"):
        torch.ops.deform_conv.deform_conv2d(image, torch.zeros(1, 2, 1, 1), weight, None, None, [1, 1], [0, 0],
                                            [1, 1])
