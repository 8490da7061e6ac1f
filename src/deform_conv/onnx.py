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

Each op's export lives beside the op (``deform_conv/_ops/<op>/onnx.py``); this module gathers what callers use.
Importing it imports ``torch.onnx``, which ``import deform_conv`` never does.
"""

from __future__ import annotations

import deform_conv  # noqa: F401  (defines the op)

from ._ops.deform_conv2d.onnx import OPSET, deform_conv_symbolic, register_torchscript_symbolic, translation_table
from ._ops.ms_deform_attn.onnx import ms_deform_attn_symbolic

__all__ = ["OPSET", "deform_conv_symbolic", "ms_deform_attn_symbolic", "register_torchscript_symbolic",
           "translation_table"]
