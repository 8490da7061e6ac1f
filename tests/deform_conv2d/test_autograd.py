"""gradcheck in float64, opcheck on both ops, and the double-backward error."""

from __future__ import annotations

import pytest
import torch

from helpers.deform_conv2d import make_case

import deform_conv


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_gradcheck(with_mask, with_bias):
    case = make_case(torch.float64, batch=2, in_channels=6, out_channels=4, size=(7, 6), with_mask=with_mask,
                     with_bias=with_bias)
    tensors = [t.detach().clone().requires_grad_() for t in case.tensors()]

    def fn(*leaves):
        return case.call(deform_conv.deform_conv2d, list(leaves))

    assert torch.autograd.gradcheck(fn, tensors, eps=1e-6, atol=1e-5, rtol=1e-4)


def _op_args(case):
    return (case.input, case.offset, case.weight, case.mask, case.bias,
            list(case.stride), list(case.padding), list(case.dilation))


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("batch", [2, 0])
def test_opcheck_forward(with_mask, with_bias, batch):
    case = make_case(torch.float32, batch=batch, with_mask=with_mask, with_bias=with_bias)
    for t in case.tensors():
        t.requires_grad_()
    torch.library.opcheck(torch.ops.deform_conv.deform_conv2d.default, _op_args(case))


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
def test_opcheck_backward(with_mask):
    case = make_case(torch.float32, batch=2, with_mask=with_mask)
    out = deform_conv.deform_conv2d(case.input, case.offset, case.weight, case.bias, case.stride, case.padding,
                                    case.dilation, case.mask)
    args = (torch.randn_like(out), case.input, case.offset, case.weight, case.mask,
            list(case.stride), list(case.padding), list(case.dilation), True)
    torch.library.opcheck(torch.ops.deform_conv.deform_conv2d_backward.default, args)


def test_backward_op_returns_none_for_absent_mask_and_bias():
    case = make_case(torch.float32, batch=2, with_mask=False)
    out = deform_conv.deform_conv2d(case.input, case.offset, case.weight, None, case.stride, case.padding, case.dilation)
    grads = torch.ops.deform_conv.deform_conv2d_backward(
        torch.ones_like(out), case.input, case.offset, case.weight, None,
        list(case.stride), list(case.padding), list(case.dilation), False)
    assert grads[3] is None and grads[4] is None


def test_double_backward_raises():
    case = make_case(torch.float64, batch=2)
    leaves = [t.detach().clone().requires_grad_() for t in case.tensors()]
    out = case.call(deform_conv.deform_conv2d, leaves)
    (grad_input,) = torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        grad_input.sum().backward()


def test_gradients_when_only_some_tensors_require_them():
    """The first layer of a network: the input needs no gradient, the offset and the weight do."""
    case = make_case(torch.float64)
    offset = case.offset.clone().requires_grad_()
    weight = case.weight.clone().requires_grad_()
    out = deform_conv.deform_conv2d(case.input, offset, weight, case.bias, case.stride, case.padding,
                                    case.dilation, case.mask)
    out.sum().backward()
    expected = deform_conv.deform_conv2d_reference(case.input, offset, weight, case.bias, case.stride, case.padding,
                                                   case.dilation, case.mask)
    expected_offset, expected_weight = torch.autograd.grad(expected.sum(), (offset, weight))
    torch.testing.assert_close(offset.grad, expected_offset, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weight.grad, expected_weight, rtol=1e-10, atol=1e-10)
