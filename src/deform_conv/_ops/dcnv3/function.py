"""The Python face of DCNv3 (InternImage's op): the public function, the fake kernels, the autograd formula and
the autocast rule, registered with the library's schema (csrc/schemas.h) once it is loaded."""

from __future__ import annotations

from typing import Set

import torch
from torch import Tensor

from ..shared.checks import IntPair, check_grad_output
from ..shared.function import autocast_cast, autocast_coordinates, autocast_inputs, in_onnx_export, script_pair
from ..shared.registration import register_op
from .checks import check_dcnv3_args
from .reference import checked_dcnv3_reference

_compiled_devices: Set[str] = set()


def dcnv3(
    input: Tensor,
    offset: Tensor,
    mask: Tensor,
    kernel_size: IntPair,
    stride: IntPair = 1,
    padding: IntPair = 0,
    dilation: IntPair = 1,
    group: int = 1,
    offset_scale: float = 1.0,
    remove_center: bool = False,
) -> Tensor:
    """DCNv3, as InternImage's ``DCNv3Function`` (its CUDA kernel's semantics), channels last.

    Args:
        input: ``[N, H, W, group * group_channels]``.
        offset: ``[N, H_out, W_out, group * K * 2]``, (x, y) of each point, K = kh * kw - remove_center, the points
            x-major (``for i < kw: for j < kh``, the centre left out with ``remove_center``).
        mask: ``[N, H_out, W_out, group * K]``, used as given (InternImage's module applies a softmax first).
        kernel_size, stride, padding, dilation: an int or an (h, w) pair; H_out and W_out as conv2d's.
        group: groups of channels, each with its own points.
        offset_scale: point (i, j) of output pixel (oy, ox) samples x = p0_x + (i * dilation_w - (dilation_w *
            (kw - 1)) // 2 + offset_x) * offset_scale with p0_x = (dilation_w * (kw - 1)) // 2 - padding_w + ox *
            stride_w, in input pixels (y likewise); bilinear, zero outside the image.
        remove_center: leave the centre point out (odd kernel sizes only).

    input float16, bfloat16, float32 or float64; offset and mask input's dtype, or float32 beside a half input
    (coordinates are computed in float32, float64 for float64, never in a half type). Sums in at least float32.

    Returns:
        ``[N, H_out, W_out, group * group_channels]`` in input's dtype.
    """
    if not torch.jit.is_scripting():
        if torch.overrides.has_torch_function_variadic(input, offset, mask):
            return torch.overrides.handle_torch_function(
                dcnv3, (input, offset, mask), input, offset, mask, kernel_size, stride, padding, dilation, group,
                offset_scale, remove_center)
        if not torch.jit.is_tracing():
            input, offset, mask = _autocast_args(input, offset, mask)
            sizes = check_dcnv3_args(input, offset, mask, kernel_size, stride, padding, dilation, group,
                                     offset_scale, remove_center)
            if in_onnx_export():
                return _onnx_export().dcnv3_symbolic(input, offset, mask, kernel_size, stride, padding, dilation,
                                                     group, offset_scale, remove_center)
            if input.device.type not in _compiled_devices:
                return checked_dcnv3_reference(input, offset, mask, sizes, float(offset_scale), remove_center)
            kernel_size, stride, padding, dilation = sizes.kernel_size, sizes.stride, sizes.padding, sizes.dilation
        elif in_onnx_export():  # the TorchScript-based exporter traces the composition it exports
            return _onnx_export().dcnv3_symbolic(input, offset, mask, kernel_size, stride, padding, dilation, group,
                                                 offset_scale, remove_center)
    return torch.ops.deform_conv.dcnv3(input, offset, mask, script_pair(kernel_size), script_pair(stride),
                                       script_pair(padding), script_pair(dilation), group, float(offset_scale),
                                       remove_center)


@torch.jit.unused
def _autocast_args(input, offset, mask):
    """As the op's autocast kernel will see them (autocast_inputs casts the input only)."""
    (cast,) = autocast_inputs(input)
    if cast is input:
        return input, offset, mask
    return cast, autocast_coordinates(offset, cast.dtype), autocast_coordinates(mask, cast.dtype)


@torch.jit.unused
def _onnx_export():
    """This op's ONNX export (onnx.py), imported by the first call an export makes."""
    from . import onnx

    return onnx


def _forward_fake(input, offset, mask, kernel_size, stride, padding, dilation, group, offset_scale, remove_center):
    s = check_dcnv3_args(input, offset, mask, kernel_size, stride, padding, dilation, group, offset_scale,
                         remove_center)
    return input.new_empty((s.batch, s.out_height, s.out_width, s.channels))


def _backward_fake(grad_output, input, offset, mask, kernel_size, stride, padding, dilation, group, offset_scale,
                   remove_center):
    s = check_dcnv3_args(input, offset, mask, kernel_size, stride, padding, dilation, group, offset_scale,
                         remove_center)
    check_grad_output(grad_output, input, "input", (s.batch, s.out_height, s.out_width, s.channels))
    contiguous = torch.contiguous_format
    return (torch.empty_like(input, memory_format=contiguous), torch.empty_like(offset, memory_format=contiguous),
            torch.empty_like(mask, memory_format=contiguous))


def _setup_context(ctx, inputs, output) -> None:
    input, offset, mask, *geometry = inputs
    ctx.save_for_backward(input, offset, mask)
    ctx.geometry = geometry


def _backward(ctx, grad_output: Tensor):
    input, offset, mask = ctx.saved_tensors
    grads = torch.ops.deform_conv.dcnv3_backward(grad_output.contiguous(), input, offset, mask, *ctx.geometry)
    return (*grads, None, None, None, None, None, None, None)


def _autocast_kernel(device_type: str):
    """Under autocast: the input cast as conv2d's (shared/function.py), the offsets and mask kept in float32."""

    def kernel(input, offset, mask, kernel_size, stride, padding, dilation, group, offset_scale, remove_center):
        input = autocast_cast(input, torch.get_autocast_dtype(device_type))
        offset, mask = autocast_coordinates(offset, input.dtype), autocast_coordinates(mask, input.dtype)
        with torch.autocast(device_type, enabled=False):
            return torch.ops.deform_conv.dcnv3(input, offset, mask, kernel_size, stride, padding, dilation, group,
                                               offset_scale, remove_center)

    return kernel


def use_compiled_kernels(devices: Set[str]) -> None:
    """Registers the Python parts once the CPU library (which defines the schemas) is loaded, and routes calls on
    ``devices`` to the compiled kernels."""
    if "cpu" in devices:
        register_op("dcnv3", _forward_fake, _backward_fake, _backward, _setup_context, _autocast_kernel)
    # Meta tensors go to the op too once its schema is loaded: its fake kernel infers their shapes.
    _compiled_devices.update(devices | ({"meta"} if "cpu" in devices else set()))
