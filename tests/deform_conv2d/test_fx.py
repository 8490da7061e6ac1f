"""torch.fx: symbolic tracing and torchvision's create_feature_extractor see deform_conv2d as one call node (the
function hands a Proxy call to __torch_function__), with no leaf_modules argument; the traced module gives the same
outputs and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.deform_conv2d import make_case

import deform_conv

feature_extraction = pytest.importorskip("torchvision.models.feature_extraction")
torchvision_models = pytest.importorskip("torchvision.models")


class FunctionCall(nn.Module):
    """The functional op on the awkward geometry, offsets and mask predicted by plain convolutions."""

    def __init__(self) -> None:
        super().__init__()
        case = make_case(torch.float64)
        self.weight = nn.Parameter(case.weight)
        self.bias = nn.Parameter(case.bias)
        self.offset = nn.Conv2d(6, 36, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1)).double()
        self.mask = nn.Conv2d(6, 18, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1)).double()

    def forward(self, x):
        return deform_conv.deform_conv2d(x, self.offset(x), self.weight, self.bias, (2, 1), (1, 0), (2, 1),
                                         torch.sigmoid(self.mask(x)))


class OffsetsGiven(nn.Module):
    """Our DeformConv2d, offsets from a convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Conv2d(6, 2 * 3 * 9, 3, padding=1).double()
        self.conv = deform_conv.DeformConv2d(6, 4, 3, padding=1, groups=2).double()

    def forward(self, x):
        return self.conv(x, self.offset(x))


MODELS = {
    "deform_conv2d": FunctionCall,
    "DeformConv2d": OffsetsGiven,
    "DeformConv2dPack": lambda: deform_conv.DeformConv2dPack(6, 4, 3, padding=1, deform_groups=3).double(),
    "ModulatedDeformConv2dPack": lambda: deform_conv.ModulatedDeformConv2dPack(6, 4, 3, padding=1, groups=2,
                                                                             deform_groups=3).double(),
}


def outputs_and_grads(model, x):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    grads = torch.autograd.grad(out, [x, *model.parameters()], torch.ones_like(out))
    return [out, *grads]


def randomise(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)  # non-zero offsets: points off the grid, across the border
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_symbolic_trace_records_one_call(name):
    model = randomise(MODELS[name]())
    traced = torch.fx.symbolic_trace(model)
    calls = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is deform_conv.deform_conv2d]
    assert len(calls) == 1, traced.graph
    x = torch.randn(3, 6, 13, 8, dtype=torch.float64)
    for got, want in zip(outputs_and_grads(traced, x), outputs_and_grads(model, x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def resnet_with_deformable_stage():
    """torchvision's ResNet-18 whose 3x3 convolutions in layer3 are our ModulatedDeformConv2dPack."""
    model = torchvision_models.resnet18(weights=None)
    for block in model.layer3:
        for name in ("conv1", "conv2"):
            conv = getattr(block, name)
            setattr(block, name, deform_conv.ModulatedDeformConv2dPack(
                conv.in_channels, conv.out_channels, 3, stride=conv.stride, padding=1, bias=False))
    return randomise(model).double().eval()


def test_create_feature_extractor_on_a_resnet():
    model = resnet_with_deformable_stage()
    extractor = feature_extraction.create_feature_extractor(model, return_nodes={"layer3": "c4", "layer4": "c5"})
    calls = [n for n in extractor.graph.nodes if n.op == "call_function" and n.target is deform_conv.deform_conv2d]
    assert len(calls) == 4  # two blocks, two convolutions each
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64, requires_grad=True)
    features = extractor(x)
    reference = {}
    model.layer3.register_forward_hook(lambda m, i, o: reference.__setitem__("c4", o))
    model.layer4.register_forward_hook(lambda m, i, o: reference.__setitem__("c5", o))
    x_ref = x.detach().clone().requires_grad_()
    model(x_ref)
    for key in ("c4", "c5"):
        torch.testing.assert_close(features[key], reference[key], rtol=0, atol=0)
    loss, loss_ref = features["c5"].square().sum(), reference["c5"].square().sum()
    grads = torch.autograd.grad(loss, [x, *extractor.parameters()])
    grads_ref = torch.autograd.grad(loss_ref, [x_ref, *model.parameters()], allow_unused=True)
    used = [g for g in grads_ref if g is not None]  # the head after layer4 (fc) is not in the extractor
    assert len(grads) == len(used)
    for got, want in zip(grads, used):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
