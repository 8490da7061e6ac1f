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

``dcnv3``, ``dcnv4`` and ``flash_deform_attn`` have no ONNX operator either and export the same way (opset >= 16,
either exporter, the same plain import): DCNv3 and DCNv4 as one GridSample over the ``N * group`` images, the grid
from the op's sampling formula (computed in float32, also beside a half input), times the mask and summed over the
points (DCNv4's offset_mask sliced per group first, its Softmax where asked); batch, height and width may be
dynamic axes with both exporters. FlashDeformAttn as a Softmax of its logits, then ``ms_deform_attn``'s export
(and its rules for the levels). See :func:`dcnv3_symbolic`, :func:`dcnv4_symbolic` and
:func:`flash_deform_attn_symbolic`.

Each op's export lives beside the op (``deform_conv/_ops/<op>/onnx.py``); this module gathers what callers use.
Importing it imports ``torch.onnx``, which ``import deform_conv`` never does.
"""

from __future__ import annotations

import deform_conv  # noqa: F401  (defines the op)

from ._ops.deform_conv2d.onnx import OPSET, deform_conv_symbolic, register_torchscript_symbolic, translation_table
from ._ops.dcnv3.onnx import dcnv3_symbolic
from ._ops.dcnv4.onnx import dcnv4_symbolic
from ._ops.flash_deform_attn.onnx import flash_deform_attn_symbolic
from ._ops.ms_deform_attn.onnx import ms_deform_attn_symbolic

__all__ = ["OPSET", "dcnv3_symbolic", "dcnv4_symbolic", "deform_conv_symbolic", "flash_deform_attn_symbolic",
           "ms_deform_attn_symbolic", "register_torchscript_symbolic", "translation_table"]
