"""ONNX export of ``dcnv4``, which has no ONNX operator: its offset_mask sliced into each group's offsets and mask
(with a Softmax over the K points where asked), then DCNv3's composition (``dcnv3/onnx.py``: one ``GridSample``,
the Mul by the mask and a ReduceSum; opset >= 16), returned by ``dcnv4`` while either exporter traces it.
"""

from __future__ import annotations

from torch import Tensor

from ..dcnv3.onnx import grid_sample_sum, quiet_tracer
from ..dcnv3.reference import point_dtype
from .checks import check_dcnv4_args


def dcnv4_symbolic(input: Tensor, offset_mask: Tensor, kernel_size, stride, padding, dilation, group: int,
                   offset_scale: float, remove_center: bool, softmax: bool) -> Tensor:
    """What ``dcnv4`` returns while either exporter traces the model (arguments and result as ``dcnv4``'s): a
    Slice of offset_mask's first ``group * 3K`` channels (the padding channels after them are left out), Reshaped
    to each group's 2K offsets and K mask values, a Softmax over the K mask values (float32; float64 for a float64
    input) with ``softmax``, then :func:`~deform_conv._ops.dcnv3.onnx.grid_sample_sum`. Standard operators only.

    Dynamic sizes as dcnv3's (:func:`~deform_conv._ops.dcnv3.onnx.dcnv3_symbolic`): the batch and the input's
    height and width may be dynamic axes with either exporter; offset_mask's channel count P is read from its
    shape (only its first ``group * 3K`` channels are used). Values as dcnv3's: the op's up to float32 rounding
    for finite coordinates.
    """
    with quiet_tracer():
        s = check_dcnv4_args(input, offset_mask, kernel_size, stride, padding, dilation, group, offset_scale,
                             remove_center, softmax)
        k = s.points
        blocks = offset_mask[..., : s.group * 3 * k].reshape(s.batch, s.out_height, s.out_width, s.group, 3 * k)
        offsets = blocks[..., : 2 * k].reshape(s.batch, s.out_height, s.out_width, s.group, k, 2)
        weights = blocks[..., 2 * k:].to(point_dtype(input.dtype))
        if softmax:
            weights = weights.softmax(-1)
        return grid_sample_sum(input, s, offsets, weights, float(offset_scale), remove_center)
