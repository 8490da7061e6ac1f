"""Every bad argument to dcnv3, dcnv4 and flash_deform_attn gets an error naming it: the Python checks
(_ops/<op>/checks.py: TypeError or ValueError) through the public function; the C++ backstop (RuntimeError) for
the same calls straight to torch.ops.deform_conv.<op> and <op>_backward; and the fake kernels, which refuse a
meta grad_output beside CPU tensors instead of returning garbage."""

from __future__ import annotations

import math
import re

import pytest
import torch

import deform_conv

from helpers.errors_doc import ERRORS, table
from helpers.family import PUBLIC, Case, make_dcnv3, make_dcnv4, make_flash

# The standard cases: dcnv3 on input (2, 7, 6, 15) float32, kernel 3x2, stride (2, 1), padding (1, 0), dilation
# (2, 1), group 3 -> offset (2, 3, 5, 36), mask (2, 3, 5, 18); dcnv4 likewise with offset_mask (2, 3, 5, 54 + 2);
# flash_deform_attn on value (2, 42, 3, 5) over levels (5, 7), (1, 1), (3, 2), 4 points a level, 6 queries ->
# sampling_loc_attn (2, 6, 3, 36).
STANDARD = {
    "dcnv3": lambda: make_dcnv3(torch.float32),
    "dcnv4": lambda: make_dcnv4(torch.float32, extra_channels=2),
    "flash_deform_attn": lambda: make_flash(torch.float32),
}
POSITIONS = {
    "dcnv3": ("input", "offset", "mask", "kernel_size", "stride", "padding", "dilation", "group", "offset_scale",
              "remove_center"),
    "dcnv4": ("input", "offset_mask", "kernel_size", "stride", "padding", "dilation", "group", "offset_scale",
              "remove_center", "softmax"),
    "flash_deform_attn": ("value", "spatial_shapes", "level_start_index", "sampling_loc_attn", "n_points"),
}


def changed(case: Case, **changes) -> tuple:
    """case's arguments with some replaced: name=value, or name=callable(old value)."""
    args = dict(zip(POSITIONS[case.op], case.args))
    for name, change in changes.items():
        args[name] = change(args[name]) if callable(change) else change
    return tuple(args.values())


def dtype(d):
    return lambda t: t.to(d)


# id (docs/errors.md's tables, which give the error and its message) -> (op, changes to its standard case, the
# argument the C++ message names first)
CALLS = {
    "dcnv3 input sparse": ("dcnv3", dict(input=lambda t: t.to_sparse()), "input"),
    "dcnv3 offset sparse": ("dcnv3", dict(offset=lambda t: t.to_sparse()), "offset"),
    "dcnv4 offset_mask sparse": ("dcnv4", dict(offset_mask=lambda t: t.to_sparse()), "offset_mask"),
    "flash value sparse": ("flash_deform_attn", dict(value=lambda t: t.to_sparse()), "value"),
    "dcnv3 input 3-D": ("dcnv3", dict(input=lambda t: t[0]), "input"),
    "dcnv3 offset 3-D": ("dcnv3", dict(offset=lambda t: t[0]), "offset"),
    "dcnv3 mask 5-D": ("dcnv3", dict(mask=lambda t: t[..., None]), "mask"),
    "dcnv3 int input": ("dcnv3", dict(input=dtype(torch.int32)), "input"),
    "dcnv3 float64 offset beside float32 input": ("dcnv3", dict(offset=dtype(torch.float64)), "offset"),
    "dcnv3 float16 offset beside bfloat16 input": (
        "dcnv3", dict(input=dtype(torch.bfloat16), offset=dtype(torch.float16)), "offset"),
    "dcnv3 float64 mask beside float32 input": ("dcnv3", dict(mask=dtype(torch.float64)), "mask"),
    "dcnv3 meta offset beside cpu input": ("dcnv3", dict(offset=lambda t: t.to("meta")), "offset"),
    "dcnv3 offset shape": ("dcnv3", dict(offset=lambda t: t[..., :-2]), "offset"),
    "dcnv3 mask shape": ("dcnv3", dict(mask=lambda t: t[:, :2]), "mask"),
    "dcnv3 channels not divisible by group": ("dcnv3", dict(input=lambda t: t[..., :14]), "input"),
    "dcnv3 group 0": ("dcnv3", dict(group=0), "group"),
    "dcnv3 kernel_size 0": ("dcnv3", dict(kernel_size=[0, 2]), "kernel_size"),
    "dcnv3 stride 0": ("dcnv3", dict(stride=[2, 0]), "stride"),
    "dcnv3 padding -1": ("dcnv3", dict(padding=[-1, 0]), "padding"),
    "dcnv3 dilation 0": ("dcnv3", dict(dilation=[0, 1]), "dilation"),
    "dcnv3 kernel bigger than the padded input": ("dcnv3", dict(kernel_size=[6, 2]), "kernel"),
    "dcnv3 remove_center with an even kernel": ("dcnv3", dict(remove_center=True), "remove_center"),
    "dcnv3 offset_scale nan": ("dcnv3", dict(offset_scale=math.nan), "offset_scale"),
    "dcnv3 offset_scale inf": ("dcnv3", dict(offset_scale=-math.inf), "offset_scale"),
    "dcnv4 offset_mask 3-D": ("dcnv4", dict(offset_mask=lambda t: t[0]), "offset_mask"),
    "dcnv4 float64 offset_mask": ("dcnv4", dict(offset_mask=dtype(torch.float64)), "offset_mask"),
    "dcnv4 meta offset_mask": ("dcnv4", dict(offset_mask=lambda t: t.to("meta")), "offset_mask"),
    "dcnv4 P too small": ("dcnv4", dict(offset_mask=lambda t: t[..., :53]), "offset_mask"),
    "dcnv4 offset_mask batch": ("dcnv4", dict(offset_mask=lambda t: t[:1]), "offset_mask"),
    "dcnv4 group 0": ("dcnv4", dict(group=0), "group"),
    "dcnv4 remove_center with an even kernel": ("dcnv4", dict(remove_center=True), "remove_center"),
    "flash value 3-D": ("flash_deform_attn", dict(value=lambda t: t[0]), "value"),
    "flash int value": ("flash_deform_attn", dict(value=dtype(torch.int64)), "value"),
    "flash float64 sampling_loc_attn": (
        "flash_deform_attn", dict(sampling_loc_attn=dtype(torch.float64)), "sampling_loc_attn"),
    "flash float16 sampling_loc_attn beside bfloat16 value": (
        "flash_deform_attn", dict(value=dtype(torch.bfloat16), sampling_loc_attn=dtype(torch.float16)), "sampling_loc_attn"),
    "flash int32 spatial_shapes": ("flash_deform_attn", dict(spatial_shapes=dtype(torch.int32)), "spatial_shapes"),
    "flash meta sampling_loc_attn": (
        "flash_deform_attn", dict(sampling_loc_attn=lambda t: t.to("meta")), "sampling_loc_attn"),
    "flash n_points 0": ("flash_deform_attn", dict(n_points=0), "n_points"),
    "flash sampling_loc_attn shape": ("flash_deform_attn", dict(n_points=3), "sampling_loc_attn"),
    "flash spatial_shapes [L, 3]": (
        "flash_deform_attn", dict(spatial_shapes=lambda t: torch.cat([t, t[:, :1]], 1)), "spatial_shapes"),
    "flash level_start_index shape": (
        "flash_deform_attn", dict(level_start_index=lambda t: t[:2]), "level_start_index"),
    "flash spatial_shapes 0 wide": (
        "flash_deform_attn", dict(spatial_shapes=torch.tensor([[5, 7], [1, 0], [3, 2]])), "spatial_shapes"),
    "flash level_start_index value": (
        "flash_deform_attn", dict(level_start_index=torch.tensor([0, 35, 37])), "level_start_index"),
    "flash levels larger than value": (
        "flash_deform_attn", dict(spatial_shapes=torch.tensor([[5, 7], [1, 1],
                                                                                             [3, 3]])), "value"),
}


DOCUMENTED = {**table("dcnv3"), **table("dcnv4"), **table("flash_deform_attn")}


def call_row(row: str, fn):
    op, changes, _ = CALLS[row]
    return fn(op)(*changed(STANDARD[op](), **changes))


def test_every_documented_row_is_tested_and_every_tested_input_documented():
    assert set(DOCUMENTED) == set(CALLS)


@pytest.mark.parametrize("row", sorted(CALLS))
def test_public_function_raises_the_documented_error(row):
    error, message = DOCUMENTED[row]
    with pytest.raises(ERRORS[error]) as raised:
        call_row(row, lambda op: PUBLIC[op])
    assert str(raised.value) == message


def backward(op: str):
    """<op>_backward with a valid grad_output (the standard case's output) before the bad arguments."""
    expected = getattr(torch.ops.deform_conv, op)(*STANDARD[op]().args)
    return lambda *args: getattr(torch.ops.deform_conv, op + "_backward")(torch.ones_like(expected), *args)


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("row", sorted(CALLS))
def test_direct_op_call_has_the_cpp_backstop(row, direction):
    """Straight to torch.ops.deform_conv (no Python checks): the C++ checks raise a RuntimeError whose first line
    names the argument. A meta tensor among CPU ones dispatches to the fake kernel instead, whose Python checks
    raise the public function's ValueError; a sparse tensor to the sparse keys' kernel, which raises its
    TypeError."""
    _, _, argument = CALLS[row]
    message = DOCUMENTED[row][1]
    meta, sparse = "meta" in row, "sparse" in row
    fn = (lambda op: getattr(torch.ops.deform_conv, op)) if direction == "forward" else backward
    with pytest.raises(ValueError if meta else TypeError if sparse else RuntimeError) as raised:
        call_row(row, fn)
    first_line = str(raised.value).splitlines()[0]
    assert re.match(rf"^(the )?{re.escape(argument)}\b", first_line), f"{first_line!r} does not name {argument}"
    if meta or sparse:  # the fake kernel's Python checks, or the sparse keys' kernel: the public message
        assert first_line == message


@pytest.mark.parametrize("op", sorted(STANDARD))
def test_direct_backward_refuses_a_bad_grad_output(op):
    case = STANDARD[op]()
    out = getattr(torch.ops.deform_conv, op)(*case.args)
    bwd = getattr(torch.ops.deform_conv, op + "_backward")
    with pytest.raises(RuntimeError, match=r"^grad_output must have (input|value)'s dtype Float, got Double"):
        bwd(out.double(), *case.args)
    with pytest.raises(RuntimeError, match=r"^grad_output must have shape \["):
        bwd(out[..., :-1], *case.args)
    with pytest.raises(RuntimeError, match=r"^grad_output must be"):
        bwd(out[0], *case.args)


@pytest.mark.parametrize("op", sorted(STANDARD))
def test_fake_kernels_refuse_a_meta_grad_output_beside_cpu_tensors(op):
    """grad_output on the meta device, the other tensors on the CPU: the dispatcher runs the fake kernel (meta
    outranks CPU), which must raise, not return empty tensors the caller would take for gradients."""
    case = STANDARD[op]()
    out = getattr(torch.ops.deform_conv, op)(*case.args)
    bwd = getattr(torch.ops.deform_conv, op + "_backward")
    with pytest.raises(ValueError, match=r"^grad_output must be on (input|value)'s device cpu, got meta"):
        bwd(torch.empty_like(out, device="meta"), *case.args)


@pytest.mark.parametrize("op", sorted(STANDARD))
def test_fake_kernels_give_the_real_shapes_on_meta_tensors(op):
    case = STANDARD[op]()
    real = getattr(torch.ops.deform_conv, op)(*case.args)
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in case.args]
    out = getattr(torch.ops.deform_conv, op)(*meta)
    assert out.device.type == "meta" and out.shape == real.shape and out.dtype == real.dtype
    grads = getattr(torch.ops.deform_conv, op + "_backward")(torch.empty_like(out), *meta)
    assert [g.shape for g in grads] == [t.shape for t in case.floats()]


def test_all_meta_calls_infer_shapes_as_the_op_does():
    """Every op called with meta tensors only returns a meta tensor of the op's output shape (its fake kernel),
    instead of failing in autocast's device lookup or in the pure-PyTorch reference."""
    meta = dict(device="meta")
    shapes = torch.empty(3, 2, dtype=torch.long, **meta)
    starts = torch.empty(3, dtype=torch.long, **meta)
    value = torch.empty(2, 41, 3, 4, **meta)
    out = deform_conv.ms_deform_attn(value, shapes, starts, torch.empty(2, 7, 3, 3, 4, 2, **meta),
                                     torch.empty(2, 7, 3, 3, 4, **meta))
    assert out.device.type == "meta" and tuple(out.shape) == (2, 7, 12)
    out = deform_conv.flash_deform_attn(value, shapes, starts, torch.empty(2, 7, 3, 3 * 4 * 3, **meta), 4)
    assert out.device.type == "meta" and tuple(out.shape) == (2, 7, 12)
    x = torch.empty(2, 6, 5, 12, **meta)
    out = deform_conv.dcnv3(x, torch.empty(2, 6, 5, 3 * 9 * 2, **meta), torch.empty(2, 6, 5, 27, **meta), 3, 1, 1, 1,
                            3)
    assert out.device.type == "meta" and tuple(out.shape) == (2, 6, 5, 12)
    out = deform_conv.dcnv4(x, torch.empty(2, 6, 5, 3 * 9 * 3 + 3, **meta), 3, 1, 1, 1, 3)
    assert out.device.type == "meta" and tuple(out.shape) == (2, 6, 5, 12)
    out = deform_conv.deform_conv2d(torch.empty(1, 4, 5, 5, **meta), torch.empty(1, 18, 5, 5, **meta),
                                    torch.empty(2, 4, 3, 3, **meta), padding=1)
    assert out.device.type == "meta" and tuple(out.shape) == (1, 2, 5, 5)


def test_direct_call_with_an_overflowing_kernel_names_it():
    """kernel_size 2^32 x 2^32 straight to the op: K would wrap around int64 to 0 (and the grid's tables loop for
    ever); the C++ check names the product."""
    with pytest.raises(RuntimeError, match=r"^kernel_size\[0\] \* kernel_size\[1\] overflows int64"):
        torch.ops.deform_conv.dcnv3(torch.randn(1, 1, 1, 4), torch.zeros(1, 2, 2, 0), torch.zeros(1, 2, 2, 0),
                                    [2**32, 2**32], [1, 1], [2**31, 2**31], [1, 1], 1, 1.0, False)
