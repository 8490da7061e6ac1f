"""ONNX export of ``deform_conv2d`` to the standard ``DeformConv`` operator (opset >= 19): the symbolic of the
TorchScript-based exporter (registered when this module is imported, and by ``deform_conv2d`` when the exporter
traces it), the node ``deform_conv2d`` emits while the dynamo-based exporter traces it, and the translation table.
What users see of it, and what the graph needs to be static, is told in ``deform_conv.onnx``'s docstring.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.onnx import symbolic_helper

OPSET = 19  # the first opset with DeformConv
_OP_NAME = "deform_conv::deform_conv2d"


def _attributes(
    weight_shape: Sequence[Optional[int]],
    in_channels: Optional[int],
    offset_channels: Optional[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> Dict[str, object]:
    """DeformConv's attributes; ``group`` and ``offset_group`` are inferred from the shapes as the op does."""
    if any(not isinstance(s, int) for s in (*weight_shape, in_channels, offset_channels)):
        raise ValueError(
            "ONNX export of deform_conv2d needs a static weight shape and static channel counts of input and "
            f"offset (they set DeformConv's group and offset_group), got weight {list(weight_shape)}, "
            f"input channels {in_channels}, offset channels {offset_channels}"
        )
    _, in_per_group, kernel_h, kernel_w = weight_shape
    return dict(
        kernel_shape=[kernel_h, kernel_w],
        strides=list(stride),
        pads=[padding[0], padding[1], padding[0], padding[1]],  # [top, left, bottom, right]
        dilations=list(dilation),
        group=in_channels // in_per_group,
        offset_group=offset_channels // (2 * kernel_h * kernel_w),
    )


# -- the TorchScript-based exporter ------------------------------------------------------------------------------


def _static_sizes(value: torch._C.Value) -> List[Optional[int]]:
    """The value's sizes, None where dynamic (varyingSizes: sizes() gives nothing once any size is dynamic)."""
    sizes = value.type().varyingSizes() if isinstance(value.type(), torch._C.TensorType) else None
    return list(sizes) if sizes is not None else [None] * 4


def _is_none(value: torch._C.Value) -> bool:
    return value.node().mustBeNone()


@symbolic_helper.parse_args("v", "v", "v", "v", "v", "is", "is", "is", "s")
def _torchscript_symbolic(g, input, offset, weight, mask, bias, stride, padding, dilation, border_gradient):
    attributes = _attributes(_static_sizes(weight), _static_sizes(input)[1], _static_sizes(offset)[1],
                             stride, padding, dilation)
    inputs = [input, weight, offset]
    if not _is_none(mask):
        if _is_none(bias):
            bias = g.op("prim::Constant")  # ONNX's "input left out" placeholder
            bias.setType(torch._C.OptionalType.ofTensor())
        inputs += [bias, mask]
    elif not _is_none(bias):
        inputs.append(bias)
    return g.op("DeformConv", *inputs, **{f"{name}_i": value for name, value in attributes.items()})


_registered = False


def register_torchscript_symbolic() -> None:
    """Lets ``torch.onnx.export(..., dynamo=False)`` map the op to DeformConv (done on importing this module,
    and by ``deform_conv2d`` when the exporter traces it)."""
    global _registered
    if not _registered:
        torch.onnx.register_custom_op_symbolic(_OP_NAME, _torchscript_symbolic, OPSET)
        _registered = True


# -- the dynamo-based exporter ----------------------------------------------------------------------------------

def deform_conv_symbolic(input, offset, weight, bias, geo, mask):
    """The DeformConv node, as ``deform_conv2d`` returns it while the dynamo-based exporter traces the model;
    None where torch has no ``torch.onnx.ops.symbolic`` (before 2.8: the translation table does it)."""
    ops = getattr(torch.onnx, "ops", None)
    if ops is None or not hasattr(ops, "symbolic"):
        return None
    attributes = _attributes(list(weight.shape), input.shape[1], offset.shape[1], geo.stride, geo.padding,
                             geo.dilation)
    return ops.symbolic(
        "DeformConv", (input, weight, offset, bias, mask), attributes, dtype=input.dtype,
        shape=(input.shape[0], weight.shape[0], geo.out_h, geo.out_w), version=OPSET)


def translation_table() -> Dict[Callable, Callable]:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``: the op as DeformConv."""
    from onnxscript import opset19 as op

    def deform_conv2d(input, offset, weight, mask=None, bias=None, stride=(1, 1), padding=(0, 0),
                      dilation=(1, 1), border_gradient="torchvision"):
        def channels(value) -> Optional[int]:
            return value.shape[1] if value.shape is not None else None

        weight_shape = list(weight.shape) if weight.shape is not None else [None] * 4
        attributes = _attributes(weight_shape, channels(input), channels(offset), stride, padding, dilation)
        return op.DeformConv(input, weight, offset, bias, mask, **attributes)

    return {torch.ops.deform_conv.deform_conv2d.default: deform_conv2d}


register_torchscript_symbolic()
