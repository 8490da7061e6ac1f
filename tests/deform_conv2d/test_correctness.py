"""Forward and all five gradients against the pure-PyTorch reference and against torchvision."""

from __future__ import annotations

import pytest
import torch
import torchvision

from helpers.deform_conv2d import assert_all_close, make_case, output_and_grads

import deform_conv

ours = deform_conv.deform_conv2d
reference = deform_conv.deform_conv2d_reference


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("peer", ["reference", "torchvision"])
def test_awkward_geometry_matches(dtype, with_mask, with_bias, peer):
    case = make_case(dtype, with_mask=with_mask, with_bias=with_bias)
    peer_fn = reference if peer == "reference" else torchvision.ops.deform_conv2d
    assert_all_close(output_and_grads(ours, case), output_and_grads(peer_fn, case), dtype)


def test_integer_offsets_and_borders(dtype):
    """Sampling points exactly on pixel centres, on the last row/column and on y = -1 or x = -1 (the edge of
    the 'outside' rule), where the interpolant has kinks: the gradients are the one-sided ones from above."""
    case = make_case(dtype, size=(6, 5))
    case.offset = torch.round(case.offset)
    # Output pixel (0, 3), tap (i, j) of offset group 0 samples at base (-1 + 2 i, 3 + j) + offset: put every
    # tap on y = -1 with x inside, and tap 0 of output pixel (1, 0) on x = -1 with y inside.
    for i in range(3):
        for j in range(2):
            case.offset[:, 2 * (i * 2 + j), 0, 3] = -2.0 * i
            case.offset[:, 2 * (i * 2 + j) + 1, 0, 3] = 0.0
    case.offset[:, 0, 1, 0] = 0.0  # y = 2 * 1 - 1 = 1
    case.offset[:, 1, 1, 0] = -1.0  # x = 0 - 1 = -1
    ours_results = output_and_grads(ours, case)
    torchvision_results = output_and_grads(torchvision.ops.deform_conv2d, case)
    # The border points do move the result: their offset gradients are not 0 (a sum of rows 0 and column 0).
    assert torch.all(torchvision_results[2][:, 0:12:2, 0, 3] != 0)
    assert torch.all(torchvision_results[2][:, 1, 1, 0] != 0)
    assert_all_close(ours_results, torchvision_results, dtype)
    assert_all_close(ours_results, output_and_grads(reference, case), dtype)


def test_points_far_outside_give_zero(dtype):
    case = make_case(dtype, with_bias=False)
    case.offset = torch.full_like(case.offset, 1e6)
    out = ours(case.input, case.offset, case.weight, None, case.stride, case.padding, case.dilation, case.mask)
    assert torch.equal(out, torch.zeros_like(out))


def test_zero_batch(dtype):
    case = make_case(dtype, batch=0)
    results = output_and_grads(ours, case)
    assert results[0].shape == (0, 4, 6, 7)
    for tensor, grad in zip(case.tensors(), results[1:]):
        assert grad.shape == tensor.shape
    # With no images, the weight's and the bias' gradients are sums over nothing.
    assert torch.equal(results[3], torch.zeros_like(results[3]))
    assert torch.equal(results[4], torch.zeros_like(results[4]))


def test_batch_larger_than_a_chunk_of_images(dtype):
    """At most 32 images share one column buffer: 37 images cross a chunk boundary."""
    case = make_case(dtype, batch=37, size=(7, 6))
    results = output_and_grads(ours, case)
    assert_all_close(results, output_and_grads(reference, case), dtype)
    assert_all_close(results, output_and_grads(torchvision.ops.deform_conv2d, case), dtype)


def test_images_larger_than_the_column_budget():
    """One image of 64 channels at 64x64 in float64 takes 18 MiB of columns, more than the 8 MiB budget:
    every image is its own chunk."""
    case = make_case(torch.float64, batch=3, in_channels=64, out_channels=8, size=(64, 64), kernel=(3, 3),
                     stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1, offset_groups=1)
    assert_all_close(output_and_grads(ours, case), output_and_grads(reference, case), torch.float64)


def test_non_contiguous_inputs(dtype):
    case = make_case(dtype)
    contiguous = output_and_grads(ours, case)
    # Same values, other memory layouts: a channels-last input, every other tensor a strided view.
    strided = [
        case.input.contiguous(memory_format=torch.channels_last),
        torch.cat([case.offset, case.offset], dim=3)[..., : case.offset.shape[3]],
        case.weight.transpose(2, 3).contiguous().transpose(2, 3),
        torch.stack([case.bias, case.bias], dim=1)[:, 0],
        case.mask.transpose(2, 3).contiguous().transpose(2, 3),
    ]
    assert not any(t.is_contiguous() for t in strided)
    assert_all_close(output_and_grads(ours, case, strided), contiguous, dtype)
    assert_all_close(output_and_grads(ours, case, strided), output_and_grads(reference, case), dtype)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kernel=(1, 1), stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1, offset_groups=1),
        dict(out_channels=6, kernel=(5, 3), stride=(3, 2), padding=(2, 3), dilation=(1, 2), groups=3, offset_groups=2),
        dict(in_channels=4, out_channels=4, groups=4, offset_groups=4, kernel=(3, 3), stride=(1, 1),
             padding=(1, 1), dilation=(1, 1)),
        dict(in_channels=48, out_channels=10, groups=2, offset_groups=3, size=(9, 8)),
    ],
    ids=["1x1", "5x3_groups3", "depthwise", "48_channels_in_blocks"],
)
def test_other_geometries(kwargs):
    case = make_case(torch.float64, **kwargs)
    assert_all_close(output_and_grads(ours, case), output_and_grads(reference, case), torch.float64)


def test_reference_agrees_with_torchvision(dtype):
    """The ground truth itself is checked against an independent implementation."""
    case = make_case(dtype)
    assert_all_close(output_and_grads(reference, case), output_and_grads(torchvision.ops.deform_conv2d, case), dtype)
