"""The derivative at a sampling point exactly on y = -1 or x = -1 (csrc/sampling.h), where torchvision and mmcv
differ: torchvision's one-sided derivative (deform_conv2d, DeformConv2d) or mmcv's 0 (the Pack layers), each
against the reference and, for the Pack layers, against mmcv's own fixed numbers."""

from __future__ import annotations

import pytest
import torch

from helpers.common import TOLERANCES
from helpers.deform_conv2d import make_case, output_and_grads

import deform_conv

ours = deform_conv.deform_conv2d


def border_case(dtype):
    """Zero offsets with padding 1 and stride 1: every tap of the first row and column sits exactly at -1 (a
    freshly initialised layer)."""
    return make_case(dtype, stride=(1, 1), padding=(1, 1), dilation=(1, 1), kernel=(3, 3), offset_scale=0.0)


def with_border(border):
    return lambda *args: ours(*args, border_gradient=border)


def reference_with_border(border):
    return lambda *args: deform_conv.deform_conv2d_reference(*args, border_gradient=border)


@pytest.mark.parametrize("border", ["torchvision", "mmcv"])
@pytest.mark.parametrize("geometry", ["gemm", "depthwise"])
def test_each_convention_matches_the_reference(dtype, border, geometry):
    case = border_case(dtype) if geometry == "gemm" else make_case(
        dtype, in_channels=6, out_channels=6, groups=6, offset_groups=3, stride=(1, 1), padding=(1, 1),
        dilation=(1, 1), kernel=(3, 3), offset_scale=0.0)
    rtol, atol = TOLERANCES[dtype]
    for name, got, want in zip(["output", "input", "offset", "weight", "bias", "mask"],
                               output_and_grads(with_border(border), case),
                               output_and_grads(reference_with_border(border), case)):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=name)


def test_the_conventions_differ_only_in_the_offset_gradient_at_the_border():
    case = border_case(torch.float64)
    torchvision_like = output_and_grads(with_border("torchvision"), case)
    mmcv_like = output_and_grads(with_border("mmcv"), case)
    for i in (0, 1, 3, 4, 5):  # output, input, weight, bias, mask: the same
        assert torch.equal(torchvision_like[i], mmcv_like[i])
    difference = (torchvision_like[2] - mmcv_like[2]) != 0
    assert difference.any()
    # Only the first row's y-offsets (taps 0-2) and the first column's x-offsets (taps 0, 3, 6) differ.
    batch, _, out_h, out_w = difference.shape
    offsets = difference.reshape(batch, 3, 9, 2, out_h, out_w)  # [B, offset group, tap, (dy, dx), H_out, W_out]
    assert not offsets[:, :, :, 0, 1:].any() and not offsets[:, :, :, 1, :, 1:].any()
    assert not offsets[:, :, 3:, 0].any() and not offsets[:, :, [1, 2, 4, 5, 7, 8], 1].any()


def test_the_default_of_each_api():
    case = border_case(torch.float64)
    tv_offset_grad = output_and_grads(with_border("torchvision"), case)[2]
    assert torch.equal(output_and_grads(ours, case)[2], tv_offset_grad)
    assert deform_conv.DeformConv2d(6, 4, 3).border_gradient == "torchvision"
    assert deform_conv.DeformConv2dPack(6, 4, 3).border_gradient == "mmcv"
    assert deform_conv.ModulatedDeformConv2dPack(6, 4, 3).border_gradient == "mmcv"
    assert deform_conv.DeformConv2d(6, 4, 3, border_gradient="mmcv").border_gradient == "mmcv"


@pytest.mark.parametrize("value", ["mmdet", "", None, 1])
def test_a_bad_value_is_refused(value):
    case = border_case(torch.float32)
    with pytest.raises(ValueError, match="border_gradient must be 'torchvision' or 'mmcv', got"):
        case.call(lambda *args: ours(*args, border_gradient=value), case.tensors())
    with pytest.raises(ValueError, match="border_gradient must be 'torchvision' or 'mmcv', got"):
        deform_conv.ModulatedDeformConv2dPack(6, 4, 3, border_gradient=value)
    if isinstance(value, str):
        with pytest.raises(RuntimeError, match="border_gradient must be 'torchvision' or 'mmcv', got"):
            torch.ops.deform_conv.deform_conv2d(case.input, case.offset, case.weight, case.mask, case.bias,
                                                [1, 1], [1, 1], [1, 1], value)


# mmcv's own fixed numbers (tests/test_ops/test_modulated_deform_conv.py and test_deform_conv.py in
# open-mmlab/mmcv): a 3x3 input, a 2x2 kernel, and for the modulated layer padding 1 with zero offsets, so that
# taps sit exactly at -1. mmcv checks them with rtol 1e-2 (numpy.allclose's default atol 1e-8); so do we, and in
# float64 they hold to 1e-12.
MDCONV_INPUT = [[[[1., 2., 3.], [1., 2., 3.], [1., 2., 3.]]]]
MDCONV_OUTPUT = [[[[0.5, 1.5, 2.5, 1.5], [1.0, 3.0, 5.0, 3.0], [1.0, 3.0, 5.0, 3.0], [0.5, 1.5, 2.5, 1.5]]]]
MDCONV_INPUT_GRAD = [[[[2., 2., 2.], [2., 2., 2.], [2., 2., 2.]]]]
MDCONV_WEIGHT_GRAD = [[[[9., 9.], [9., 9.]]]]
MDCONV_OFFSET_WEIGHT_GRAD = [
    [[[-7.0, -4.0], [0.0, 0.0]]], [[[-9.0, 7.5], [-6.0, 5.0]]], [[[-4.0, -7.0], [0.0, 0.0]]],
    [[[-7.5, -9.0], [-5.0, -6.0]]], [[[-7.0, -4.0], [-7.0, -4.0]]], [[[-6.0, 5.0], [-9.0, 7.5]]],
    [[[-4.0, -7.0], [-4.0, -7.0]]], [[[-5.0, -6.0], [-7.5, -9.0]]], [[[10.5, 6.0], [7.0, 4.0]]],
    [[[6.0, 10.5], [4.0, 7.0]]], [[[7.0, 4.0], [10.5, 6.0]]], [[[4.0, 7.0], [6.0, 10.5]]]]
MDCONV_OFFSET_BIAS_GRAD = [-3.0, -1.5, -3.0, -1.5, -3.0, -1.5, -3.0, -1.5, 4.5, 4.5, 4.5, 4.5]


def assert_mmcv_close(got, expected, rtol, dtype):
    expected = torch.tensor(expected, dtype=torch.float64)
    assert torch.allclose(got.detach().double(), expected, rtol=rtol, atol=1e-8 if dtype == torch.float64 else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_mmcv_modulated_pack_numbers(dtype):
    x = torch.tensor(MDCONV_INPUT, dtype=dtype, requires_grad=True)
    layer = deform_conv.ModulatedDeformConv2dPack(1, 1, kernel_size=(2, 2), stride=1, padding=1, deform_groups=1,
                                                  bias=False).to(dtype)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    out = layer(x)
    out.sum().backward()
    rtol = 1e-12 if dtype == torch.float64 else 1e-2
    assert_mmcv_close(out, MDCONV_OUTPUT, rtol, dtype)
    assert_mmcv_close(x.grad, MDCONV_INPUT_GRAD, rtol, dtype)
    assert_mmcv_close(layer.weight.grad, MDCONV_WEIGHT_GRAD, rtol, dtype)
    assert_mmcv_close(layer.conv_offset.weight.grad, MDCONV_OFFSET_WEIGHT_GRAD, rtol, dtype)
    assert_mmcv_close(layer.conv_offset.bias.grad, MDCONV_OFFSET_BIAS_GRAD, rtol, dtype)


def test_torchvision_convention_fails_mmcv_modulated_numbers():
    """The numbers above tell the conventions apart: with torchvision's, conv_offset's gradient differs."""
    x = torch.tensor(MDCONV_INPUT, dtype=torch.float64, requires_grad=True)
    layer = deform_conv.ModulatedDeformConv2dPack(1, 1, kernel_size=(2, 2), stride=1, padding=1, bias=False,
                                                  border_gradient="torchvision").double()
    with torch.no_grad():
        layer.weight.fill_(1.0)
    layer(x).sum().backward()
    expected = torch.tensor(MDCONV_OFFSET_WEIGHT_GRAD, dtype=torch.float64)
    assert not torch.allclose(layer.conv_offset.weight.grad, expected, rtol=1e-2)


DCONV_INPUT = [[[[1., 2., 3.], [0., 1., 2.], [3., 5., 2.]]]]
DCONV_OFFSET_WEIGHT = [[[0.1, 0.4, 0.6, 0.1]], [[0.3, 0.2, 0.1, 0.3]], [[0.5, 0.5, 0.2, 0.8]],
                       [[0.8, 0.3, 0.9, 0.1]], [[0.3, 0.1, 0.2, 0.5]], [[0.3, 0.7, 0.5, 0.3]],
                       [[0.6, 0.2, 0.5, 0.3]], [[0.4, 0.1, 0.8, 0.4]]]
DCONV_OFFSET_BIAS = [0.7, 0.1, 0.8, 0.5, 0.6, 0.5, 0.4, 0.7]
DCONV_WEIGHT = [[[0.4, 0.2, 0.1, 0.9]]]
DCONV_OUTPUT = [[[[1.650, 0.], [0.000, 0.]]]]
DCONV_INPUT_GRAD = [[[[-0.666, 0.204, 0.000], [0.030, -0.416, 0.012], [0.000, 0.252, 0.129]]]]
DCONV_OFFSET_WEIGHT_GRAD = [
    [[[1.44, 2.88], [0.00, 1.44]]], [[[-0.72, -1.44], [0.00, -0.72]]], [[[0.00, 0.00], [0.00, 0.00]]],
    [[[0.00, 0.00], [0.00, 0.00]]], [[[-0.10, -0.20], [0.00, -0.10]]], [[[-0.08, -0.16], [0.00, -0.08]]],
    [[[-0.54, -1.08], [0.00, -0.54]]], [[[-0.54, -1.08], [0.00, -0.54]]]]
DCONV_OFFSET_BIAS_GRAD = [1.44, -0.72, 0., 0., -0.10, -0.08, -0.54, -0.54]
DCONV_WEIGHT_GRAD = [[[[3.62, 0.], [0.40, 0.18]]]]


@pytest.mark.parametrize("dtype, threshold", [(torch.float64, 1e-3), (torch.float32, 1e-1)], ids=["fp64", "fp32"])
def test_mmcv_pack_numbers(dtype, threshold):
    """mmcv's DCNv1 case, a batch of 10 copies (its gradients of shared parameters divided by 10), with mmcv's
    rtol (1e-3 in float64, 1e-1 in float32): the numbers are given to 2-3 decimals."""
    batch = 10
    x = torch.tensor(DCONV_INPUT, dtype=dtype).repeat(batch, 1, 1, 1).requires_grad_()
    layer = deform_conv.DeformConv2dPack(1, 1, kernel_size=2, stride=1, padding=0, im2col_step=2).to(dtype)
    with torch.no_grad():
        layer.conv_offset.weight.copy_(torch.tensor(DCONV_OFFSET_WEIGHT).reshape(8, 1, 2, 2))
        layer.conv_offset.bias.copy_(torch.tensor(DCONV_OFFSET_BIAS))
        layer.weight.copy_(torch.tensor(DCONV_WEIGHT).reshape(1, 1, 2, 2))
    out = layer(x)
    out.backward(torch.ones_like(out))

    def close(got, expected):
        expected = torch.tensor(expected, dtype=torch.float64)
        return torch.allclose(got.detach().double(), expected.expand_as(got), rtol=threshold, atol=1e-8)

    assert close(out, DCONV_OUTPUT)
    assert close(x.grad, DCONV_INPUT_GRAD)
    assert close(layer.conv_offset.weight.grad / batch, DCONV_OFFSET_WEIGHT_GRAD)
    assert close(layer.conv_offset.bias.grad / batch, DCONV_OFFSET_BIAS_GRAD)
    assert close(layer.weight.grad / batch, DCONV_WEIGHT_GRAD)
