"""The Python face of FlashDeformAttn (the DCNv4 repository's): the public function, the fake kernels, the
autograd formula and the autocast rule, as DCNv3's (dcnv3/function.py)."""

from __future__ import annotations

from typing import Set

import torch
from torch import Tensor

from ..shared.checks import check_grad_output
from ..shared.function import autocast_cast, autocast_coordinates, autocast_inputs, in_onnx_export
from ..shared.registration import register_op
from .checks import check_flash_deform_attn_args
from .reference import checked_flash_deform_attn_reference

_compiled_devices: Set[str] = set()


def flash_deform_attn(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_loc_attn: Tensor,
                      n_points: int) -> Tensor:
    """FlashDeformAttn: multi-scale deformable attention with the softmax of its weights fused.

    Args:
        value: ``[N, S, group, group_channels]`` (S = sum of H_l * W_l).
        spatial_shapes: ``[L, 2]`` int64, (H_l, W_l); level_start_index: ``[L]`` int64.
        sampling_loc_attn: ``[N, Lq, group, L * n_points * 3]``: L * n_points (x, y) locations, level by level,
            normalised as :func:`ms_deform_attn`'s (grid_sample's align_corners=False), then L * n_points logits
            under one softmax. Its dtype is value's, or float32 beside a half value.
        n_points: points a level.

    Returns:
        ``[N, Lq, group * group_channels]`` in value's dtype: softmax + :func:`ms_deform_attn`.
    """
    if not torch.jit.is_scripting():
        if torch.overrides.has_torch_function_variadic(value, spatial_shapes, level_start_index, sampling_loc_attn):
            return torch.overrides.handle_torch_function(
                flash_deform_attn, (value, spatial_shapes, level_start_index, sampling_loc_attn), value,
                spatial_shapes, level_start_index, sampling_loc_attn, n_points)
        if not torch.jit.is_tracing():
            value, sampling_loc_attn = _autocast_args(value, sampling_loc_attn)
            sizes = check_flash_deform_attn_args(value, spatial_shapes, level_start_index, sampling_loc_attn,
                                                 n_points, check_levels=not torch.compiler.is_compiling())
            if in_onnx_export():
                return _onnx_export().flash_deform_attn_symbolic(value, spatial_shapes, level_start_index,
                                                                 sampling_loc_attn, n_points)
            if value.device.type not in _compiled_devices:
                return checked_flash_deform_attn_reference(value, spatial_shapes, level_start_index,
                                                           sampling_loc_attn, sizes)
        elif in_onnx_export():  # the TorchScript-based exporter traces the composition it exports
            return _onnx_export().flash_deform_attn_symbolic(value, spatial_shapes, level_start_index,
                                                             sampling_loc_attn, n_points)
    return torch.ops.deform_conv.flash_deform_attn(value, spatial_shapes, level_start_index, sampling_loc_attn,
                                                   n_points)


@torch.jit.unused
def _autocast_args(value, sampling_loc_attn):
    (cast,) = autocast_inputs(value)
    if cast is value:
        return value, sampling_loc_attn
    return cast, autocast_coordinates(sampling_loc_attn, cast.dtype)


@torch.jit.unused
def _onnx_export():
    """This op's ONNX export (onnx.py), imported by the first call an export makes."""
    from . import onnx

    return onnx


def _forward_fake(value, spatial_shapes, level_start_index, sampling_loc_attn, n_points):
    s = check_flash_deform_attn_args(value, spatial_shapes, level_start_index, sampling_loc_attn, n_points,
                                     check_levels=False)
    return value.new_empty((s.batch, s.queries, s.group * s.channels))


def _backward_fake(grad_output, value, spatial_shapes, level_start_index, sampling_loc_attn, n_points):
    s = check_flash_deform_attn_args(value, spatial_shapes, level_start_index, sampling_loc_attn, n_points,
                                     check_levels=False)
    check_grad_output(grad_output, value, "value", (s.batch, s.queries, s.group * s.channels))
    contiguous = torch.contiguous_format
    return (torch.empty_like(value, memory_format=contiguous),
            torch.empty_like(sampling_loc_attn, memory_format=contiguous))


def _setup_context(ctx, inputs, output) -> None:
    value, spatial_shapes, level_start_index, sampling_loc_attn, n_points = inputs
    ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_loc_attn)
    ctx.n_points = n_points


def _backward(ctx, grad_output: Tensor):
    value, spatial_shapes, level_start_index, sampling_loc_attn = ctx.saved_tensors
    grad_value, grad_loc_attn = torch.ops.deform_conv.flash_deform_attn_backward(
        grad_output.contiguous(), value, spatial_shapes, level_start_index, sampling_loc_attn, ctx.n_points)
    return grad_value, None, None, grad_loc_attn, None


def _autocast_kernel(device_type: str):
    """Under autocast: value cast as conv2d's input, sampling_loc_attn kept in float32."""

    def kernel(value, spatial_shapes, level_start_index, sampling_loc_attn, n_points):
        value = autocast_cast(value, torch.get_autocast_dtype(device_type))
        sampling_loc_attn = autocast_coordinates(sampling_loc_attn, value.dtype)
        with torch.autocast(device_type, enabled=False):
            return torch.ops.deform_conv.flash_deform_attn(value, spatial_shapes, level_start_index,
                                                           sampling_loc_attn, n_points)

    return kernel


def use_compiled_kernels(devices: Set[str]) -> None:
    """As dcnv3's."""
    if "cpu" in devices:
        register_op("flash_deform_attn", _forward_fake, _backward_fake, _backward, _setup_context,
                    _autocast_kernel)
    # Meta tensors go to the op too once its schema is loaded: its fake kernel infers their shapes.
    _compiled_devices.update(devices | ({"meta"} if "cpu" in devices else set()))
