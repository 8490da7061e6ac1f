"""ONNX export of ``deform_conv2d`` (the function and every module) to the standard ``DeformConv`` operator
(opset >= 19), which plain onnxruntime runs (no custom domain, no plugin). Nothing to import or pass: after
``import deform_conv``, either exporter does it::

    torch.onnx.export(model, args, "model.onnx", opset_version=19)                # dynamo-based (the default)
    torch.onnx.export(model, args, "model.onnx", opset_version=19, dynamo=False)  # TorchScript-based

During an export ``deform_conv2d`` emits the ONNX node itself: with the dynamo-based exporter through
``torch.onnx.ops.symbolic`` (torch >= 2.8), with the TorchScript-based one by registering the symbolic below the
first time it is traced. ``translation_table()`` still works for code that passes it (and is what the
dynamo-based exporter needs with torch older than 2.8).

``group`` and ``offset_group`` are attributes in ONNX but follow from tensor shapes here, so the weight's
shape and the input's and offset's channel counts must be static (batch and spatial sizes may be dynamic).
The op's ``border_gradient`` only changes the backward, so it is not exported.

``ms_deform_attn`` (multi-scale deformable attention) has no ONNX operator: it exports, with either exporter and
after the same plain import, as Deformable DETR's pure-PyTorch composition of standard operators (a GridSample a
level and the weighted sum; opset >= 16). Which level shapes the graph can take depends on the exporter: see
:func:`ms_deform_attn_symbolic`.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.onnx import symbolic_helper

import deform_conv  # noqa: F401  (defines the op)
from deform_conv._checks import check_levels_fit, check_ms_deform_attn_args
from deform_conv._reference import ms_deform_attn_grid_sample

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


# -- multi-scale deformable attention -----------------------------------------------------------------------------


def ms_deform_attn_symbolic(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """What ``ms_deform_attn`` returns while either exporter traces the model: Deformable DETR's pure-PyTorch
    composition (:func:`deform_conv._reference.ms_deform_attn_grid_sample`), so that the ONNX graph holds only
    standard operators (ONNX has none for the op itself): per level a Split of ``value``, a Reshape to an image and
    a ``GridSample`` (bilinear, zeros padding, align_corners=0; opset >= 16), then the Mul by the attention
    weights and a ReduceSum, which plain onnxruntime runs. Shapes as ``ms_deform_attn``.

    The composition needs each level's (H_l, W_l) to split ``value`` and reshape it, and how the exporter knows
    them decides what the graph can do:

    * the TorchScript-based exporter (``dynamo=False``) runs the model on real tensors, so
      ``spatial_shapes.tolist()`` reads the levels of the example input and the graph holds them as constants
      (torch's TracerWarning on converting a tensor to a Python list says so). The export is therefore valid for
      those spatial shapes only: a model whose levels are fixed, as a deployed Deformable DETR at one input size
      (batch and query count may still be dynamic axes). ``spatial_shapes`` and ``level_start_index`` leave the graph; where they
      were inputs of the model they are not inputs of the ONNX graph. Their values are checked here, as in an
      eager call, since the graph will not see them again.
    * the dynamo-based exporter (the default) traces with fake tensors, whose values nobody knows:
      ``tolist()`` gives unbacked symbolic ints (``torch.export``'s data-dependent sizes), and the graph computes
      the split sizes and image shapes from ``spatial_shapes`` at run time (Gathers of its elements and Muls
      feeding the Split's sizes and the Reshapes' shapes). The levels' sizes may then change between runs,
      ``spatial_shapes`` may be a graph input, a buffer or a constant, and ``value``'s pixel count may be a
      dynamic axis; only the number of levels (L, ``spatial_shapes.shape[0]``, which unrolls the loop) is fixed.
      Nothing checks the values at export time (there are none to check): ``level_start_index`` is not read,
      since the composition takes the levels to lie one after another in ``value`` (which an eager call checks),
      and shapes whose pixels do not add up to ``value.shape[1]`` fail in the Split when the graph runs.

    Values are grid_sample's: equal to the op's up to rounding for finite locations (a NaN location samples 0
    here, NaN in the op).
    """
    level_shapes = spatial_shapes.tolist()  # ints while tracing, unbacked SymInts under torch.export
    if torch.jit.is_tracing():  # ms_deform_attn checks nothing on this path: the op is not called
        check_ms_deform_attn_args(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                                  check_levels=False)
        check_levels_fit(level_shapes, level_start_index.tolist(), value.shape[1])
    return ms_deform_attn_grid_sample(value, [(h, w) for h, w in level_shapes], sampling_locations,
                                      attention_weights)
