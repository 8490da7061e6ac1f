"""ONNX export of ``dcnv3`` (and of ``dcnv4``, which samples on the same grid), which has no ONNX operator: a
composition of standard operators (one ``GridSample``, bilinear, zeros padding, align_corners=0; opset >= 16), which
plain onnxruntime runs, returned by ``dcnv3`` while either exporter traces it. See :func:`dcnv3_symbolic`.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import GridSizes, check_dcnv3_args
from .reference import grid_coordinates, point_dtype


def dcnv3_symbolic(input: Tensor, offset: Tensor, mask: Tensor, kernel_size, stride, padding, dilation, group: int,
                   offset_scale: float, remove_center: bool) -> Tensor:
    """What ``dcnv3`` returns while either exporter traces the model (arguments and result as ``dcnv3``'s): the
    points' pixel coordinates from the op's grid formula (the reference's, ``grid_coordinates``), normalised for
    grid_sample, one ``GridSample`` over the ``N * group`` images of ``group_channels`` channels, then the Mul by
    the mask and a ReduceSum over the K points (:func:`grid_sample_sum`). The graph holds only standard operators.

    Which sizes the graph may change between runs: the sizes are read from the tensors' shapes (never from their
    values), and both exporters record how the graph computes with them, so the batch and the input's height and
    width (with them H_out and W_out: the grid's bases are a Range over each, the normalisation a Div by H and W)
    may be dynamic axes with either exporter. With the dynamo-based one, the offset's and mask's H_out and W_out
    must be declared as derived from the input's (``torch.export.Dim``), or follow from it inside the model, since
    the op's shape check relates them. The kernel's geometry, ``group``, ``offset_scale`` and ``remove_center``
    are the graph's constants (the taps, K).

    Values equal the op's up to float32 rounding for finite coordinates, far ones (offsets of 1e6) included. At a
    non-finite coordinate they are the runtime's GridSample's, not the op's (NaN for NaN, 0 for +-inf): torch's
    grid_sample samples NaN for either, onnxruntime (1.32) some finite value.
    """
    with quiet_tracer():
        s = check_dcnv3_args(input, offset, mask, kernel_size, stride, padding, dilation, group, offset_scale,
                             remove_center)
        offsets = offset.reshape(s.batch, s.out_height, s.out_width, s.group, s.points, 2)
        weights = mask.reshape(s.batch, s.out_height, s.out_width, s.group, s.points)
        return grid_sample_sum(input, s, offsets, weights, float(offset_scale), remove_center)


@contextlib.contextmanager
def quiet_tracer():
    """Leaves out two TracerWarnings the TorchScript-based exporter's trace of these compositions would give and
    that do not apply: the sizes are traced 0-d tensors there, so the argument checks' comparisons are "converted
    to Python booleans", but they only decide whether to raise (an export either raises or traces the same graph
    for every size); and the kernel's taps are ``torch.tensor`` "constants in the trace", which they are (Python
    ints of the geometry). Any other warning (a size converted to a Python int, say) still shows."""
    with warnings.catch_warnings():
        if torch.jit.is_tracing():
            for message in ("Converting a tensor to a Python boolean", "torch.tensor results are registered as "
                                                                       "constants in the trace"):
                warnings.filterwarnings("ignore", message=message, category=torch.jit.TracerWarning)
        yield


def grid_sample_sum(input: Tensor, s: GridSizes, offsets: Tensor, weights: Tensor, offset_scale: float,
                    remove_center: bool) -> Tensor:
    """DCNv3's and DCNv4's sampled sum as standard operators: input [N, H, W, G * C], offsets
    [N, H_out, W_out, G, K, 2] (x, y), weights [N, H_out, W_out, G, K] -> [N, H_out, W_out, G * C] in input's
    dtype.

    The coordinates are computed as the op computes them (float32; float64 for a float64 input), never in a half
    type: a half input is sampled in float32 (ONNX's GridSample would take a float32 grid beside a half image, but
    torch's grid_sample wants one dtype) and the sum rounded to its dtype once, as the op does. Pixel coordinate p
    of a side of ``size`` pixels is grid_sample's (2 * p + 1) / size - 1 (align_corners=False: pixel i's centre at
    (2 * i + 1) / size - 1).
    """
    dtype = point_dtype(input.dtype)
    x, y = grid_coordinates(s, offsets, offset_scale, remove_center, dtype)  # [N, H_out, W_out, G, K] each
    grid = torch.stack(((2 * x + 1) / s.width - 1, (2 * y + 1) / s.height - 1), dim=-1)  # [N, Ho, Wo, G, K, 2]
    outputs = s.out_height * s.out_width
    # [N, Ho, Wo, G, K, 2] -> [N * G, Ho * Wo, K, 2]: each group's points are the rows of its image's grid.
    grid = grid.permute(0, 3, 1, 2, 4, 5).reshape(s.batch * s.group, outputs, s.points, 2)
    channels = s.channels // s.group
    # [N, H, W, G * C] -> [N * G, C, H, W]
    images = input.to(dtype).reshape(s.batch, s.height, s.width, s.group, channels).permute(0, 3, 4, 1, 2)
    images = images.reshape(s.batch * s.group, channels, s.height, s.width)
    samples = F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    # [N, Ho, Wo, G, K] -> [N * G, 1, Ho * Wo, K], beside the samples [N * G, C, Ho * Wo, K]
    weights = weights.to(dtype).permute(0, 3, 1, 2, 4).reshape(s.batch * s.group, 1, outputs, s.points)
    out = (samples * weights).sum(-1)  # [N * G, C, Ho * Wo]
    out = out.reshape(s.batch, s.group, channels, s.out_height, s.out_width).permute(0, 3, 4, 1, 2)
    return out.reshape(s.batch, s.out_height, s.out_width, s.channels).to(input.dtype)
