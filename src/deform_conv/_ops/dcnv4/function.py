"""The Python face of DCNv4 (the DCNv4 repository's op): the public function, the fake kernels, the autograd
formula and the autocast rule, as DCNv3's (dcnv3/function.py)."""

from __future__ import annotations

from typing import Set

import torch
from torch import Tensor

from ..shared.checks import IntPair, check_grad_output
from ..shared.function import autocast_cast, autocast_coordinates, autocast_inputs, in_onnx_export, script_pair
from ..shared.registration import register_op
from .checks import check_dcnv4_args
from .reference import checked_dcnv4_reference

_compiled_devices: Set[str] = set()


def dcnv4(
    input: Tensor,
    offset_mask: Tensor,
    kernel_size: IntPair,
    stride: IntPair = 1,
    padding: IntPair = 0,
    dilation: IntPair = 1,
    group: int = 1,
    offset_scale: float = 1.0,
    remove_center: bool = False,
    softmax: bool = False,
) -> Tensor:
    """DCNv4, as the DCNv4 repository's extension, channels last, with none of its restrictions (any kernel size,
    any channels a group, any stride).

    Args:
        input: ``[N, H, W, group * group_channels]``.
        offset_mask: ``[N, H_out, W_out, P]``, P >= group * K * 3: group g's block at g * 3K holds its 2K offsets
            ((x, y) per point, points as :func:`dcnv3`'s) then its K mask values; the channels after the last block
            are padding (ignored, zero gradient).
        kernel_size, stride, padding, dilation, group, offset_scale, remove_center: as :func:`dcnv3`.
        softmax: the mask values are logits, under a softmax over each group's K.

    offset_mask has input's dtype, or float32 beside a half input.

    Returns:
        ``[N, H_out, W_out, group * group_channels]`` in input's dtype.
    """
    if not torch.jit.is_scripting():
        if torch.overrides.has_torch_function_variadic(input, offset_mask):
            return torch.overrides.handle_torch_function(
                dcnv4, (input, offset_mask), input, offset_mask, kernel_size, stride, padding, dilation, group,
                offset_scale, remove_center, softmax)
        if not torch.jit.is_tracing():
            input, offset_mask = _autocast_args(input, offset_mask)
            sizes = check_dcnv4_args(input, offset_mask, kernel_size, stride, padding, dilation, group,
                                     offset_scale, remove_center, softmax)
            if in_onnx_export():
                return _onnx_export().dcnv4_symbolic(input, offset_mask, kernel_size, stride, padding, dilation,
                                                     group, offset_scale, remove_center, softmax)
            if input.device.type not in _compiled_devices:
                return checked_dcnv4_reference(input, offset_mask, sizes, float(offset_scale), remove_center,
                                               softmax)
            kernel_size, stride, padding, dilation = sizes.kernel_size, sizes.stride, sizes.padding, sizes.dilation
        elif in_onnx_export():  # the TorchScript-based exporter traces the composition it exports
            return _onnx_export().dcnv4_symbolic(input, offset_mask, kernel_size, stride, padding, dilation, group,
                                                 offset_scale, remove_center, softmax)
    return torch.ops.deform_conv.dcnv4(input, offset_mask, script_pair(kernel_size), script_pair(stride),
                                       script_pair(padding), script_pair(dilation), group, float(offset_scale),
                                       remove_center, softmax)


@torch.jit.unused
def _autocast_args(input, offset_mask):
    (cast,) = autocast_inputs(input)
    if cast is input:
        return input, offset_mask
    return cast, autocast_coordinates(offset_mask, cast.dtype)


@torch.jit.unused
def _onnx_export():
    """This op's ONNX export (onnx.py), imported by the first call an export makes."""
    from . import onnx

    return onnx


def _forward_fake(input, offset_mask, kernel_size, stride, padding, dilation, group, offset_scale, remove_center,
                  softmax):
    s = check_dcnv4_args(input, offset_mask, kernel_size, stride, padding, dilation, group, offset_scale,
                         remove_center, softmax)
    return input.new_empty((s.batch, s.out_height, s.out_width, s.channels))


def _backward_fake(grad_output, input, offset_mask, kernel_size, stride, padding, dilation, group, offset_scale,
                   remove_center, softmax):
    s = check_dcnv4_args(input, offset_mask, kernel_size, stride, padding, dilation, group, offset_scale,
                         remove_center, softmax)
    check_grad_output(grad_output, input, "input", (s.batch, s.out_height, s.out_width, s.channels))
    contiguous = torch.contiguous_format
    return (torch.empty_like(input, memory_format=contiguous),
            torch.empty_like(offset_mask, memory_format=contiguous))


def _setup_context(ctx, inputs, output) -> None:
    input, offset_mask, *geometry = inputs
    ctx.save_for_backward(input, offset_mask)
    ctx.geometry = geometry


def _backward(ctx, grad_output: Tensor):
    input, offset_mask = ctx.saved_tensors
    grads = torch.ops.deform_conv.dcnv4_backward(grad_output.contiguous(), input, offset_mask, *ctx.geometry)
    return (*grads, None, None, None, None, None, None, None, None)


def _autocast_kernel(device_type: str):
    """Under autocast: the input cast as conv2d's, offset_mask kept in float32."""

    def kernel(input, offset_mask, kernel_size, stride, padding, dilation, group, offset_scale, remove_center,
               softmax):
        input = autocast_cast(input, torch.get_autocast_dtype(device_type))
        offset_mask = autocast_coordinates(offset_mask, input.dtype)
        with torch.autocast(device_type, enabled=False):
            return torch.ops.deform_conv.dcnv4(input, offset_mask, kernel_size, stride, padding, dilation, group,
                                               offset_scale, remove_center, softmax)

    return kernel


def use_compiled_kernels(devices: Set[str]) -> None:
    """As dcnv3's."""
    if "cpu" in devices:
        register_op("dcnv4", _forward_fake, _backward_fake, _backward, _setup_context, _autocast_kernel)
    # Meta tensors go to the op too once its schema is loaded: its fake kernel infers their shapes.
    _compiled_devices.update(devices | ({"meta"} if "cpu" in devices else set()))
