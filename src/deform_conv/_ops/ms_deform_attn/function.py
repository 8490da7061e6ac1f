"""The Python face of multi-scale deformable attention (Deformable DETR's op): the public function, the fake
kernels, the autograd formula and the autocast rule, as deform_conv2d's (``_ops/deform_conv2d/function.py``).

The op is defined by the C++ library (csrc/ops.cpp); :func:`use_compiled_kernels` adds the Python parts once it is
loaded. Devices without compiled kernels (only with DEFORM_CONV_FALLBACK=reference) run the pure-PyTorch reference.
"""

from __future__ import annotations

from typing import Optional, Set

import torch
from torch import Tensor

from ..shared.function import autocast_cast, autocast_coordinates, autocast_inputs, in_onnx_export
from ..shared.registration import refuse_sparse
from .checks import check_ms_deform_attn_args
from .reference import ms_deform_attn_reference

# Device types ("cpu", "cuda") whose compiled kernels are loaded.
_compiled_devices: Set[str] = set()


def ms_deform_attn(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    im2col_step: Optional[int] = None,
) -> Tensor:
    """Multi-scale deformable attention, as Deformable DETR's ``MSDeformAttnFunction`` (and its pure-PyTorch
    ``ms_deform_attn_core_pytorch``).

    Args:
        value: ``[N, S, M, D]``: batch, the pixels of all levels one level after another (S = sum of H_l * W_l),
            heads, channels a head.
        spatial_shapes: ``[L, 2]`` int64, (H_l, W_l) of each level.
        level_start_index: ``[L]`` int64, where each level starts in S (0, H_0 * W_0, ...).
        sampling_locations: ``[N, Lq, M, L, P, 2]``, (x, y) of each query's points in each level, normalised to
            [0, 1]: grid_sample's convention (align_corners=False), the centre of pixel column w at (w + 0.5) / W_l.
        attention_weights: ``[N, Lq, M, L, P]``.
        im2col_step: accepted for Deformable DETR's signature and ignored (the kernels need no such chunking).

    value float16, bfloat16, float32 or float64; sampling_locations and attention_weights value's dtype, or float32
    beside a half value (the coordinates are then computed in float32: autocast keeps them so); every tensor on
    one device. Sampling is bilinear with zero outside the image; a location with a NaN coordinate samples NaN, one at +-inf samples 0
    (README, "Non-finite offsets"); the weights multiply the samples, so non-finite weights propagate as a
    multiplication does.

    Returns:
        ``[N, Lq, M * D]``: for each query and head, the weighted sum of its samples over levels and points.
    """
    if not torch.jit.is_scripting():
        if torch.overrides.has_torch_function_variadic(
                value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
            return torch.overrides.handle_torch_function(
                ms_deform_attn, (value, spatial_shapes, level_start_index, sampling_locations, attention_weights),
                value, spatial_shapes, level_start_index, sampling_locations, attention_weights, im2col_step)
        if not torch.jit.is_tracing():
            value, sampling_locations, attention_weights = _autocast_args(
                value, sampling_locations, attention_weights)
            # The level sizes are read (on CPU tensors) only in an eager call: under torch.compile and torch.export
            # their values are unknown, and the op's own checks apply.
            check_ms_deform_attn_args(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights, check_levels=not torch.compiler.is_compiling())
            if in_onnx_export():
                return _onnx_export().ms_deform_attn_symbolic(
                    value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
            if value.device.type not in _compiled_devices:
                return ms_deform_attn_reference(value, spatial_shapes, level_start_index, sampling_locations,
                                                attention_weights)
        elif in_onnx_export():  # the TorchScript-based exporter traces the composition it exports
            return _onnx_export().ms_deform_attn_symbolic(
                value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return torch.ops.deform_conv.ms_deform_attn(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


@torch.jit.unused
def _autocast_args(value, sampling_locations, attention_weights):
    """As the op's autocast kernel will see them: value cast, the locations and weights kept in float32."""
    (cast,) = autocast_inputs(value)
    if cast is value:
        return value, sampling_locations, attention_weights
    return (cast, autocast_coordinates(sampling_locations, cast.dtype),
            autocast_coordinates(attention_weights, cast.dtype))


@torch.jit.unused
def _onnx_export():
    """This op's ONNX export (onnx.py), imported by the first call an export makes: it imports torch.onnx."""
    from . import onnx

    return onnx


def _forward_fake(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    sizes = check_ms_deform_attn_args(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights, check_levels=False)
    return value.new_empty((sizes.batch, sizes.queries, sizes.heads * sizes.channels))


def _backward_fake(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    sizes = check_ms_deform_attn_args(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights, check_levels=False)
    expected = (sizes.batch, sizes.queries, sizes.heads * sizes.channels)
    if tuple(grad_output.shape) != expected:
        raise ValueError(f"grad_output must have shape {expected}, got {tuple(grad_output.shape)}")
    contiguous = torch.contiguous_format
    return (
        torch.empty_like(value, memory_format=contiguous),
        torch.empty_like(sampling_locations, memory_format=contiguous),
        torch.empty_like(attention_weights, memory_format=contiguous),
    )


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_output: Tensor):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = ctx.saved_tensors
    grad_value, grad_locations, grad_weights = torch.ops.deform_conv.ms_deform_attn_backward(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return grad_value, None, None, grad_locations, grad_weights


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "ms_deform_attn does not support double backward: its gradient is not differentiable "
        "(do not pass create_graph=True through it, e.g. for gradient penalties)"
    )


def _autocast_kernel(device_type: str):
    """The op under autocast: value cast as ``conv2d``'s input (autocast_cast, shared/function.py), the sampling
    locations and attention weights kept in float32 (a normalised location near 1 in bfloat16 is off by up to a
    third of a pixel on a 150-pixel level); the kernels accumulate in float32."""

    def kernel(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        value = autocast_cast(value, torch.get_autocast_dtype(device_type))
        sampling_locations = autocast_coordinates(sampling_locations, value.dtype)
        attention_weights = autocast_coordinates(attention_weights, value.dtype)
        with torch.autocast(device_type, enabled=False):
            return torch.ops.deform_conv.ms_deform_attn(
                value, spatial_shapes, level_start_index, sampling_locations, attention_weights)

    return kernel


# Holds the autocast registrations for as long as the process runs (dropping it would unregister them).
_autocast_library: Optional[torch.library.Library] = None


def use_compiled_kernels(devices: Set[str]) -> None:
    """Registers the fake kernels, the autograd formula and the autocast rule, once, after the CPU library (which
    defines the schemas) is loaded, and routes calls on ``devices`` to the compiled kernels."""
    global _autocast_library
    if "cpu" in devices and _autocast_library is None:
        torch.library.register_fake("deform_conv::ms_deform_attn", _forward_fake)
        torch.library.register_fake("deform_conv::ms_deform_attn_backward", _backward_fake)
        torch.library.register_autograd("deform_conv::ms_deform_attn", _backward, setup_context=_setup_context)
        torch.library.register_autograd(
            "deform_conv::ms_deform_attn_backward", _no_double_backward, setup_context=lambda ctx, inputs, output: None
        )
        _autocast_library = torch.library.Library("deform_conv", "IMPL")
        for device_type, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
            _autocast_library.impl("ms_deform_attn", _autocast_kernel(device_type), key)
        refuse_sparse("ms_deform_attn")
    # Meta tensors go to the op too once its schema is loaded: its fake kernel infers their shapes.
    _compiled_devices.update(devices | ({"meta"} if "cpu" in devices else set()))
