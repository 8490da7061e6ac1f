"""ONNX export of ``ms_deform_attn``, which has no ONNX operator: Deformable DETR's pure-PyTorch composition of
standard operators (a GridSample a level and the weighted sum; opset >= 16), returned by ``ms_deform_attn`` while
either exporter traces it. See :func:`ms_deform_attn_symbolic` for the level shapes each exporter's graph can take.
"""

from __future__ import annotations

import torch

from .checks import check_levels_fit, check_ms_deform_attn_args
from .reference import ms_deform_attn_grid_sample


def ms_deform_attn_symbolic(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """What ``ms_deform_attn`` returns while either exporter traces the model: Deformable DETR's pure-PyTorch
    composition (:func:`ms_deform_attn_grid_sample`, beside it in reference.py), so that the ONNX graph holds only
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
