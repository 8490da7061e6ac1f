"""Every bad input gets a clear error naming the argument, the expected and the actual value."""

from __future__ import annotations

import pytest
import torch

from conftest import make_case

import deform_conv


def call(case, **changes):
    args = dict(input=case.input, offset=case.offset, weight=case.weight, bias=case.bias, stride=case.stride,
                padding=case.padding, dilation=case.dilation, mask=case.mask)
    args.update(changes)
    return deform_conv.deform_conv2d(**args)


@pytest.fixture
def case():
    return make_case(torch.float32)  # input (3, 6, 13, 8), 3x2 kernel, output 6x7, 3 offset groups


BAD_INPUTS = [
    # (what, changes as a function of the case, error type, message pattern)
    ("offset channels", lambda c: dict(offset=c.offset[:, :-1]), ValueError,
     r"offset must have a positive multiple of 2 \* kernel_h \* kernel_w = 12 channels .*got 35"),
    ("offset groups not dividing channels", lambda c: dict(offset=torch.cat([c.offset, c.offset[:, :12]], 1)),
     ValueError, r"offset_groups = offset.shape\[1\] // 12 = 4 must divide the input's 6 channels"),
    ("offset spatial size", lambda c: dict(offset=c.offset[:, :, :-1]), ValueError,
     r"offset must have shape \(3, 36, 6, 7\) .*got \(3, 36, 5, 7\)"),
    ("offset batch", lambda c: dict(offset=c.offset[:2]), ValueError,
     r"offset must have shape \(3, 36, 6, 7\) .*got \(2, 36, 6, 7\)"),
    ("mask channels", lambda c: dict(mask=c.mask[:, :-1]), ValueError,
     r"mask must have shape \(3, 18, 6, 7\) .*got \(3, 17, 6, 7\)"),
    ("mask spatial size", lambda c: dict(mask=c.mask[..., :-2]), ValueError,
     r"mask must have shape \(3, 18, 6, 7\) .*got \(3, 18, 6, 5\)"),
    ("weight.shape[1] not dividing the channels", lambda c: dict(weight=torch.randn(4, 4, 3, 2)), ValueError,
     r"weight.shape\[1\] \(in_channels / groups\) must divide the input's 6 channels, got weight of shape "
     r"\(4, 4, 3, 2\)"),
    ("out_channels not divisible by groups", lambda c: dict(weight=torch.randn(5, 3, 3, 2), bias=None), ValueError,
     r"weight.shape\[0\] \(out_channels\) must be divisible by groups = 6 // 3 = 2, got 5"),
    ("3-D input", lambda c: dict(input=c.input[0]), ValueError,
     r"input must be a 4-D tensor \[batch, channels, height, width\], got a 3-D tensor of shape \(6, 13, 8\)"),
    ("3-D weight", lambda c: dict(weight=c.weight[0]), ValueError, r"weight must be a 4-D tensor"),
    ("zero stride", lambda c: dict(stride=(0, 1)), ValueError, r"stride must be >= 1 in both dimensions, got \(0, 1\)"),
    ("negative stride", lambda c: dict(stride=-2), ValueError, r"stride must be >= 1 in both dimensions, got \(-2, -2\)"),
    ("zero dilation", lambda c: dict(dilation=(2, 0)), ValueError, r"dilation must be >= 1 in both dimensions, got \(2, 0\)"),
    ("negative padding", lambda c: dict(padding=(1, -1)), ValueError, r"padding must be >= 0 in both dimensions, got \(1, -1\)"),
    ("float stride", lambda c: dict(stride=1.5), TypeError, r"stride must be an int or a pair of ints \(height, width\), got 1.5"),
    ("three-element padding", lambda c: dict(padding=(1, 1, 1)), TypeError, r"padding must be an int or a pair of ints"),
    ("output below 1", lambda c: dict(input=c.input[:, :, :2, :]), ValueError,
     r"output size must be at least 1x1, but input 2x8 with kernel 3x2, padding \(1, 0\) and dilation \(2, 1\)"),
    ("bias shape", lambda c: dict(bias=torch.randn(5)), ValueError, r"bias must have shape \(4,\) \[out_channels\], got \(5,\)"),
    ("dtype mismatch", lambda c: dict(offset=c.offset.double()), TypeError,
     r"offset must have the input's dtype torch.float32, got torch.float64"),
    ("integer input", lambda c: dict(input=c.input.long()), TypeError, r"input must be float16, bfloat16, float32 or float64, got torch.int64"),
    ("device mismatch", lambda c: dict(mask=c.mask.to("meta")), ValueError, r"mask must be on the input's device cpu, got meta"),
    ("not a tensor", lambda c: dict(input=c.input.tolist()), TypeError, r"input must be a torch.Tensor, got list"),
    ("no input channels", lambda c: dict(input=c.input[:, :0]), ValueError,
     r"input must have at least 1 channel, got shape \(3, 0, 13, 8\)"),
]


@pytest.mark.parametrize("what,changes,error,pattern", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_clear_error(case, what, changes, error, pattern):
    with pytest.raises(error, match=pattern):
        call(case, **changes(case))


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


@pytest.mark.parametrize(
    "cls,kwargs,pattern",
    [
        (deform_conv.DeformConv2d, dict(groups=4), r"in_channels \(6\) must be divisible by groups \(4\)"),
        (deform_conv.DeformConv2d, dict(groups=3, out_channels=4), r"out_channels \(4\) must be divisible by groups \(3\)"),
        (deform_conv.DeformConv2dPack, dict(deform_groups=4), r"in_channels \(6\) must be divisible by deform_groups \(4\)"),
        (deform_conv.ModulatedDeformConv2dPack, dict(kernel_size=0), r"kernel_size must be >= 1 in both dimensions"),
        (deform_conv.DeformConv2d, dict(in_channels=0), r"in_channels and out_channels must be >= 1, got 0 and 6"),
    ],
)
def test_module_constructor_errors(cls, kwargs, pattern):
    args = dict(in_channels=6, out_channels=6, kernel_size=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        cls(**args)
