"""convert_modules swaps InternImage's and the DCNv4 repository's modules (the unchanged upstream copies) for ours:
the same parameters (the same tensors), the same outputs."""

from __future__ import annotations

import torch
from torch import nn

import deform_conv
from deform_conv.compat import convert_modules


def _randomised(module: nn.Module) -> nn.Module:
    """Upstream's init zeroes the offsets and masks, which would hide a wrong conversion: small random weights."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def test_internimage_dcnv3_layers_become_ours(upstream_dcnv3):
    model = nn.Sequential(_randomised(upstream_dcnv3.DCNv3(16, group=4, center_feature_scale=True)),
                          _randomised(upstream_dcnv3.DCNv3_pytorch(16, group=2, norm_layer="BN", act_layer="ReLU")))
    model = model.double().eval()
    x = torch.randn(2, 7, 6, 16, dtype=torch.float64)
    before = model(x)
    parameters = [p for p in model.parameters()]
    convert_modules(model)
    assert all(isinstance(m, deform_conv.nn.DCNv3) for m in model)
    assert all(a is b for a, b in zip(model.parameters(), parameters))  # the same tensors
    # The first ran on our extension shim (the same op): equal; the second upstream's grid_sample path, whose grid
    # is float32 (about 1e-7 relative of the coordinates): close.
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)


def test_dcnv4_modules_become_ours(upstream_dcnv4):
    dcnv4 = _randomised(upstream_dcnv4.DCNv4(32, group=2, dw_kernel_size=3)).double()
    flash = _randomised(upstream_dcnv4.FlashDeformAttn(32, n_levels=2, n_heads=2, n_points=3)).double()
    model = nn.ModuleDict({"dcnv4": dcnv4, "flash": flash})
    x = torch.randn(2, 36, 32, dtype=torch.float64)
    before = model["dcnv4"](x)
    convert_modules(model)
    assert isinstance(model["dcnv4"], deform_conv.nn.DCNv4)
    assert isinstance(model["flash"], deform_conv.nn.FlashDeformAttn)
    assert model["flash"].sampling_offsets is flash.sampling_offsets
    torch.testing.assert_close(model["dcnv4"](x), before, rtol=1e-12, atol=1e-12)
