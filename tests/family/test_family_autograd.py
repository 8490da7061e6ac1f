"""The family's autograd: gradcheck in float64 on small awkward cases, torch.library.opcheck on the six ops, the
double-backward error, and a CPU backward with the same bits for 1 and 2 threads."""

from __future__ import annotations

import pytest
import torch

from helpers.family import GRAD_NAMES, PUBLIC, Case, assert_identical, grad_output_for, make_case

OPS = ("dcnv3", "dcnv4", "flash_deform_attn")

# Small (gradcheck perturbs every element) and awkward: unequal kernel sides, stride, padding, dilation, groups of
# 2 channels, offset_scale 0.5, remove_center; dcnv4 with its softmax and 4 padding channels (zero gradient on
# both sides); flash_deform_attn over a 1x1, a 1xW and an Hx1 level, some locations outside them.
GRADCHECK_CASES = {
    "dcnv3": dict(batch=1, size=(4, 5), group=2, group_channels=2, offset_scale=0.5),
    "dcnv3_remove_center": dict(batch=2, size=(3, 3), group=1, group_channels=3, kernel=3, stride=1, padding=1,
                                dilation=1, remove_center=True, offset_scale=2.0),
    "dcnv4": dict(batch=1, size=(4, 5), group=2, group_channels=2, softmax=False, extra_channels=4),
    "dcnv4_softmax": dict(batch=1, size=(4, 3), group=1, group_channels=3, kernel=(2, 3), stride=1, padding=(0, 1),
                          dilation=(1, 2), softmax=True, extra_channels=4),
    "flash_deform_attn": dict(levels=((3, 4), (1, 1), (1, 3), (2, 1)), batch=1, queries=3, group=2, channels=2,
                              n_points=2),
}


def case_for(name: str, dtype=torch.float64) -> Case:
    op = next(op for op in sorted(OPS, key=len, reverse=True) if name.startswith(op))
    return make_case(op, dtype, **GRADCHECK_CASES[name])


@pytest.mark.parametrize("name", sorted(GRADCHECK_CASES))
def test_gradcheck(name):
    case = case_for(name)
    leaves = [t.detach().clone().requires_grad_() for t in case.floats()]

    def fn(*floats):
        return PUBLIC[case.op](*case.with_floats(floats).args)

    # The op is linear in the value and the weights and, along one coordinate, linear within a cell of the
    # bilinear interpolant (no point lies within 1e-6 of a cell edge here): central differences are exact but
    # for rounding, ~1e-16 / eps = 1e-10 relative.
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8, rtol=1e-7)


def op_args(op: str, requires_grad: bool, batch: int = 2):
    case = make_case(op, torch.float32, batch=batch)
    args = list(case.args)
    if requires_grad:
        for i in case.float_indices:
            args[i] = args[i].clone().requires_grad_()
    return tuple(args)


@pytest.mark.parametrize("batch", [2, 0])
@pytest.mark.parametrize("op", OPS)
def test_opcheck_forward(op, batch):
    torch.library.opcheck(getattr(torch.ops.deform_conv, op).default, op_args(op, True, batch))


@pytest.mark.parametrize("op", OPS)
def test_opcheck_backward(op):
    args = op_args(op, False)
    grad_output = grad_output_for(getattr(torch.ops.deform_conv, op)(*args))
    torch.library.opcheck(getattr(torch.ops.deform_conv, op + "_backward").default, (grad_output, *args))


@pytest.mark.parametrize("op", OPS)
def test_double_backward_raises(op):
    case = make_case(op)
    leaves = [t.detach().clone().requires_grad_() for t in case.floats()]
    out = PUBLIC[op](*case.with_floats(leaves).args)
    (grad_points,) = torch.autograd.grad(out.square().sum(), leaves[1], create_graph=True)
    with pytest.raises(RuntimeError, match=f"^{op} does not support double backward"):
        grad_points.sum().backward()


# Many points reading each pixel (a 5x5 kernel at stride 1 over a small image, 300 queries over small levels),
# in float32: another order of the gradients' sums would show in their last bits.
THREAD_CASES = {
    "dcnv3": dict(batch=2, size=(6, 7), group=2, group_channels=3, kernel=5, stride=1, padding=2, dilation=1,
                  offset_std=0.7, seed=3),
    "dcnv4": dict(batch=2, size=(6, 7), group=2, group_channels=3, kernel=5, stride=1, padding=2, dilation=1,
                  offset_std=0.7, softmax=True, extra_channels=2, seed=3),
    "flash_deform_attn": dict(levels=((4, 3), (2, 2)), batch=2, queries=300, group=2, channels=5, n_points=4,
                              low=0.0, high=1.0, seed=7),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("op", OPS)
def test_backward_is_bitwise_reproducible_across_thread_counts(op, dtype):
    case = make_case(op, dtype, **THREAD_CASES[op])
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (2, 1, 2):
            torch.set_num_threads(n)
            leaves = [t.detach().clone().requires_grad_() for t in case.floats()]
            out = PUBLIC[op](*case.with_floats(leaves).args)
            runs.append([out.detach(), *torch.autograd.grad(out, leaves, grad_output_for(out))])
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:]:
        assert_identical(run, runs[0], GRAD_NAMES[op])
