"""The bad inputs of docs/errors.md, by row id: each a function of the standard case that returns the
changed arguments of one deform_conv2d call (or, for module rows, the constructor's keyword arguments; in
ATTENTION_CALLS, of one ms_deform_attn call).

The standard case (helpers.deform_conv2d.make_case(torch.float32)): input (3, 6, 13, 8), weight (4, 3, 3, 2)
(2 groups), offset (3, 36, 6, 7) (3 offset groups), mask (3, 18, 6, 7), bias (4,), stride (2, 1), padding (1, 0),
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

# ms_deform_attn: functions of its standard case (test_ms_deform_attn_errors.standard_case(): levels (4, 5),
# (2, 3), (1, 1), so spatial_shapes [[4, 5], [2, 3], [1, 1]] and level_start_index [0, 20, 26]; value (2, 27, 3, 4)
# float32; sampling_locations (2, 6, 3, 3, 2, 2); attention_weights (2, 6, 3, 3, 2)) that return the changed
# arguments of one call.
ATTENTION_CALLS = {
    "value not a tensor": lambda c: dict(value=c.value.tolist()),
    "value sparse": lambda c: dict(value=c.value.to_sparse()),
    "value 3-D": lambda c: dict(value=c.value[0]),
    "value integer": lambda c: dict(value=c.value.long()),
    "value float8": lambda c: dict(value=c.value.to(torch.float8_e4m3fn)),
    "value no heads": lambda c: dict(value=c.value[:, :, :0]),
    "value pixels": lambda c: dict(value=c.value[:, :-1]),
    "spatial_shapes list": lambda c: dict(spatial_shapes=c.spatial_shapes.tolist()),
    "spatial_shapes 1-D": lambda c: dict(spatial_shapes=c.spatial_shapes.flatten()),
    "spatial_shapes int32": lambda c: dict(spatial_shapes=c.spatial_shapes.int()),
    "spatial_shapes float": lambda c: dict(spatial_shapes=c.spatial_shapes.float()),
    "spatial_shapes device": lambda c: dict(spatial_shapes=c.spatial_shapes.to("meta")),
    "spatial_shapes columns": lambda c: dict(spatial_shapes=torch.cat([c.spatial_shapes, c.spatial_shapes[:, :1]], 1)),
    "spatial_shapes no levels": lambda c: dict(spatial_shapes=c.spatial_shapes[:0]),
    "spatial_shapes empty level": lambda c: dict(spatial_shapes=torch.tensor([[4, 5], [0, 3], [1, 1]])),
    "spatial_shapes negative": lambda c: dict(spatial_shapes=torch.tensor([[4, 5], [-2, -3], [1, 1]])),
    "spatial_shapes sum": lambda c: dict(spatial_shapes=torch.tensor([[4, 5], [2, 3], [1, 2]])),
    # H * W = 2**64 wraps int64 to 0: checked without the product in C++ (level_fits).
    "spatial_shapes huge": lambda c: dict(spatial_shapes=torch.tensor([[4, 5], [2, 3], [2**32, 2**32]])),
    "level_start_index 2-D": lambda c: dict(level_start_index=c.level_start_index[None]),
    "level_start_index int32": lambda c: dict(level_start_index=c.level_start_index.int()),
    "level_start_index device": lambda c: dict(level_start_index=c.level_start_index.to("meta")),
    "level_start_index length": lambda c: dict(level_start_index=c.level_start_index[:2]),
    "level_start_index values": lambda c: dict(level_start_index=torch.tensor([0, 20, 25])),
    "sampling_locations 5-D": lambda c: dict(sampling_locations=c.sampling_locations[0]),
    "sampling_locations dtype": lambda c: dict(sampling_locations=c.sampling_locations.double()),
    "sampling_locations device": lambda c: dict(sampling_locations=c.sampling_locations.to("meta")),
    "sampling_locations batch": lambda c: dict(sampling_locations=c.sampling_locations[:1]),
    "sampling_locations heads": lambda c: dict(sampling_locations=c.sampling_locations[:, :, :2]),
    "sampling_locations levels": lambda c: dict(sampling_locations=c.sampling_locations[:, :, :, :2]),
    "sampling_locations xy": lambda c: dict(
        sampling_locations=torch.cat([c.sampling_locations, c.sampling_locations[..., :1]], -1)),
    "attention_weights 4-D": lambda c: dict(attention_weights=c.attention_weights[0]),
    "attention_weights dtype": lambda c: dict(attention_weights=c.attention_weights.half()),
    "attention_weights device": lambda c: dict(attention_weights=c.attention_weights.to("meta")),
    "attention_weights queries": lambda c: dict(attention_weights=c.attention_weights[:, :5]),
    "attention_weights points": lambda c: dict(attention_weights=c.attention_weights[..., :1]),
    "attention_weights levels": lambda c: dict(attention_weights=c.attention_weights[:, :, :, :2]),
}
