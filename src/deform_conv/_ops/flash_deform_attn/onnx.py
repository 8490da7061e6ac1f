"""ONNX export of ``flash_deform_attn``, which has no ONNX operator: a Softmax over each query's logits, then
``ms_deform_attn``'s export (``ms_deform_attn/onnx.py``: a GridSample a level and the weighted sum; opset >= 16),
returned by ``flash_deform_attn`` while either exporter traces it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dcnv3.onnx import quiet_tracer
from ..ms_deform_attn.onnx import ms_deform_attn_symbolic
from .checks import check_flash_deform_attn_args


def flash_deform_attn_symbolic(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                               sampling_loc_attn: Tensor, n_points: int) -> Tensor:
    """What ``flash_deform_attn`` returns while either exporter traces the model (arguments and result as its):
    sampling_loc_attn sliced into the L * n_points locations and the logits, a Softmax over each query's
    L * n_points logits, both Reshaped to ``ms_deform_attn``'s [N, Lq, group, L, n_points(, 2)], then
    :func:`~deform_conv._ops.ms_deform_attn.onnx.ms_deform_attn_symbolic`. Standard operators only.

    As the op, the locations and the softmax are float32 beside a half value (float64 beside a float64 one): the
    value is sampled in that dtype and the result rounded to value's dtype once.

    Which level shapes the graph can take is ms_deform_attn's export's (see there): with the TorchScript-based
    exporter the levels of the example input are the graph's constants (spatial_shapes and level_start_index leave
    the graph's inputs; their values are checked while tracing), with the dynamo-based one the graph reads them at
    run time (only the number of levels is fixed). Batch and query count may be dynamic axes with either.
    """
    # quiet_tracer leaves ms_deform_attn_symbolic's warning that the levels become constants.
    with quiet_tracer():
        sizes = check_flash_deform_attn_args(value, spatial_shapes, level_start_index, sampling_loc_attn, n_points,
                                             check_levels=False)  # the levels: ms_deform_attn_symbolic's checks
        dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
        points = sizes.levels * n_points
        shape = (sizes.batch, sizes.queries, sizes.group, sizes.levels, n_points)
        locations = sampling_loc_attn[..., : 2 * points].to(dtype).reshape(*shape, 2)
        weights = sampling_loc_attn[..., 2 * points:].to(dtype).softmax(-1).reshape(shape)
        out = ms_deform_attn_symbolic(value.to(dtype), spatial_shapes, level_start_index, locations, weights)
        return out.to(value.dtype)
