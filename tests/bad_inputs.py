"""The bad inputs of docs/errors.md, by row id: each a function of the standard case that returns the
changed arguments of one deform_conv2d call (or, for module rows, the constructor's keyword arguments).

The standard case (conftest.make_case(torch.float32)): input (3, 6, 13, 8), weight (4, 3, 3, 2) (2 groups),
offset (3, 36, 6, 7) (3 offset groups), mask (3, 18, 6, 7), bias (4,), stride (2, 1), padding (1, 0),
dilation (2, 1)."""

from __future__ import annotations

import torch

CALLS = {
    "input not a tensor": lambda c: dict(input=c.input.tolist()),
    "input sparse": lambda c: dict(input=c.input.to_sparse()),
    "input 3-D": lambda c: dict(input=c.input[0]),
    "input integer": lambda c: dict(input=c.input.long()),
    "input complex": lambda c: dict(input=c.input.to(torch.complex64)),
    "input float8": lambda c: dict(input=c.input.to(torch.float8_e4m3fn)),
    "input no channels": lambda c: dict(input=c.input[:, :0]),
    "weight 3-D": lambda c: dict(weight=c.weight[0]),
    "weight dtype": lambda c: dict(weight=c.weight.double()),
    "weight device": lambda c: dict(weight=c.weight.to("meta")),
    "weight empty kernel": lambda c: dict(weight=c.weight[:, :, :0]),
    "weight in_channels": lambda c: dict(weight=torch.randn(4, 4, 3, 2)),
    "weight out_channels": lambda c: dict(weight=torch.randn(5, 3, 3, 2), bias=None),
    "offset 3-D": lambda c: dict(offset=c.offset[0]),
    "offset dtype": lambda c: dict(offset=c.offset.double()),
    "offset device": lambda c: dict(offset=c.offset.to("meta")),
    "offset channels": lambda c: dict(offset=c.offset[:, :-1]),
    "offset groups": lambda c: dict(offset=torch.cat([c.offset, c.offset[:, :12]], 1)),
    "offset batch": lambda c: dict(offset=c.offset[:2]),
    "offset size": lambda c: dict(offset=c.offset[:, :, :-1]),
    "mask 3-D": lambda c: dict(mask=c.mask[0]),
    "mask dtype": lambda c: dict(mask=c.mask.double()),
    "mask device": lambda c: dict(mask=c.mask.to("meta")),
    "mask channels": lambda c: dict(mask=c.mask[:, :-1]),
    "mask size": lambda c: dict(mask=c.mask[..., :-2]),
    "bias 2-D": lambda c: dict(bias=c.bias[None]),
    "bias dtype": lambda c: dict(bias=c.bias.half()),
    "bias size": lambda c: dict(bias=torch.randn(5)),
    "stride zero": lambda c: dict(stride=(0, 1)),
    "stride negative": lambda c: dict(stride=-2),
    "stride float": lambda c: dict(stride=1.5),
    "stride bool": lambda c: dict(stride=True),
    "stride huge": lambda c: dict(stride=(2**63, 1)),
    "padding huge": lambda c: dict(padding=(0, 2**63)),
    "dilation huge": lambda c: dict(dilation=2**63),
    "padding negative": lambda c: dict(padding=(1, -1)),
    "padding three": lambda c: dict(padding=(1, 1, 1)),
    "dilation zero": lambda c: dict(dilation=0),
    "output empty": lambda c: dict(input=c.input[:, :, :2, :]),
    "border_gradient unknown": lambda c: dict(border_gradient="mmdet"),
}

# Module constructors: keyword arguments over (in_channels=6, out_channels=6, kernel_size=3).
MODULES = {
    "DeformConv2d groups": ("DeformConv2d", dict(groups=4)),
    "DeformConv2d out_channels": ("DeformConv2d", dict(groups=3, out_channels=4)),
    "DeformConv2d channels": ("DeformConv2d", dict(in_channels=0)),
    "DeformConv2dPack deform_groups": ("DeformConv2dPack", dict(deform_groups=4)),
    "ModulatedDeformConv2dPack kernel_size": ("ModulatedDeformConv2dPack", dict(kernel_size=0)),
    "DeformConv2dPack border_gradient": ("DeformConv2dPack", dict(border_gradient="torchvison")),
}
