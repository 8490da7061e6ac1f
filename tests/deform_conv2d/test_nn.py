"""The modules: torchvision's DeformConv2d, and mmcv's Pack layers (start, state_dict keys, old checkpoints)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import deform_conv
from deform_conv import DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack


def test_deform_conv2d_module_matches_torchvision():
    torch.manual_seed(0)
    ours = DeformConv2d(6, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1), groups=2)
    theirs = torchvision.ops.DeformConv2d(6, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1), groups=2)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 6, 13, 8)
    offset = 2 * torch.randn(2, 2 * 3 * 6, 6, 7)
    mask = torch.rand(2, 3 * 6, 6, 7)
    for m in (None, mask):
        torch.testing.assert_close(ours(x, offset, m), theirs(x, offset, m), rtol=1e-5, atol=1e-5)


def test_deform_conv2d_module_without_bias():
    layer = DeformConv2d(4, 8, 3, padding=1, bias=False)
    assert layer.bias is None and list(layer.state_dict()) == ["weight"]
    x = torch.randn(1, 4, 5, 5)
    out = layer(x, torch.zeros(1, 18, 5, 5))
    torch.testing.assert_close(out, F.conv2d(x, layer.weight, padding=1), rtol=1e-5, atol=1e-5)


def test_deform_conv2d_pack_starts_as_a_plain_convolution():
    torch.manual_seed(0)
    layer = DeformConv2dPack(8, 6, 3, stride=2, padding=1, dilation=1, groups=2, deform_groups=2)
    assert set(layer.state_dict()) == {"weight", "conv_offset.weight", "conv_offset.bias"}
    assert layer.conv_offset.weight.shape == (2 * 2 * 9, 8, 3, 3)
    assert torch.count_nonzero(layer.conv_offset.weight) == 0 and torch.count_nonzero(layer.conv_offset.bias) == 0
    x = torch.randn(2, 8, 11, 10)
    expected = F.conv2d(x, layer.weight, None, stride=2, padding=1, groups=2)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_modulated_pack_starts_with_mask_one_half():
    torch.manual_seed(0)
    layer = ModulatedDeformConv2dPack(4, 6, (3, 3), padding=1, deform_groups=2)
    assert set(layer.state_dict()) == {"weight", "bias", "conv_offset.weight", "conv_offset.bias"}
    assert layer.conv_offset.weight.shape == (2 * 3 * 9, 4, 3, 3)
    assert torch.count_nonzero(layer.bias) == 0  # mmcv initialises the bias to zero
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(2, 4, 9, 7)
    expected = 0.5 * F.conv2d(x, layer.weight, None, padding=1) + layer.bias.view(1, -1, 1, 1)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_modulated_pack_splits_offsets_and_mask_as_mmcv():
    """conv_offset's output is split in three: the first two thirds are the offset, the last the mask logits."""
    torch.manual_seed(0)
    layer = ModulatedDeformConv2dPack(4, 6, 3, padding=1, deform_groups=2).double()
    with torch.no_grad():
        layer.conv_offset.weight.normal_(std=0.3)
        layer.conv_offset.bias.normal_()
    x = torch.randn(2, 4, 9, 7, dtype=torch.float64)
    o1, o2, logits = torch.chunk(F.conv2d(x, layer.conv_offset.weight, layer.conv_offset.bias, padding=1), 3, dim=1)
    expected = deform_conv.deform_conv2d_reference(x, torch.cat((o1, o2), 1), layer.weight, layer.bias, 1, 1, 1,
                                                   torch.sigmoid(logits))
    torch.testing.assert_close(layer(x), expected, rtol=1e-10, atol=1e-10)


def test_pack_layers_train():
    torch.manual_seed(0)
    layer = ModulatedDeformConv2dPack(4, 4, 3, padding=1)
    out = layer(torch.randn(2, 4, 8, 8))
    out.square().mean().backward()
    # Zero offsets still get a gradient (as in mmcv), so the offsets can leave zero.
    assert layer.conv_offset.weight.grad.abs().sum() > 0
    assert layer.weight.grad.abs().sum() > 0


def test_mmcv_style_checkpoint_loads_strictly():
    """A checkpoint with mmcv's keys for a model that nests the layers loads into ours with strict=True."""
    torch.manual_seed(0)
    mmcv_keys = {
        "neck.dcn.weight": torch.randn(4, 4, 3, 3),
        "neck.dcn.bias": torch.randn(4),
        "neck.dcn.conv_offset.weight": torch.randn(27, 4, 3, 3),
        "neck.dcn.conv_offset.bias": torch.randn(27),
        "neck.dcn1.weight": torch.randn(4, 4, 3, 3),
        "neck.dcn1.conv_offset.weight": torch.randn(18, 4, 3, 3),
        "neck.dcn1.conv_offset.bias": torch.randn(18),
    }
    model = nn.Module()
    model.neck = nn.Module()
    model.neck.dcn = ModulatedDeformConv2dPack(4, 4, 3, padding=1)
    model.neck.dcn1 = DeformConv2dPack(4, 4, 3, padding=1)
    model.load_state_dict(mmcv_keys, strict=True)
    torch.testing.assert_close(model.neck.dcn.conv_offset.bias, mmcv_keys["neck.dcn.conv_offset.bias"])


def test_state_dict_records_version_2():
    layer = DeformConv2dPack(4, 4, 3)
    assert layer.state_dict()._metadata[""]["version"] == 2


def test_deprecated_deformable_groups_keyword_still_works():
    with pytest.warns(DeprecationWarning, match="deformable_groups is deprecated, use deform_groups"):
        layer = ModulatedDeformConv2dPack(4, 4, 3, padding=1, deformable_groups=2)
    assert layer.deform_groups == 2 and layer.conv_offset.out_channels == 2 * 3 * 9
