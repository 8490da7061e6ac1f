"""The Python face of deform_conv2d: the public function, the fake kernels, the autograd formula and the autocast
rule.

The op is defined by the C++ library (csrc/ops.cpp); :func:`use_compiled_kernels` registers the Python
parts once it is loaded. Devices without compiled kernels (only with DEFORM_CONV_FALLBACK=reference) run the
pure-PyTorch reference.
"""

from __future__ import annotations

from typing import Optional, Sequence, Set

import torch
from torch import Tensor

from ..shared.checks import IntPair
from ..shared.function import autocast_cast, autocast_inputs, in_onnx_export, script_pair
from ..shared.registration import refuse_sparse
from .checks import check_args, check_border_gradient
from .reference import deform_conv2d_reference

# Device types ("cpu", "cuda") whose compiled kernels are loaded.
_compiled_devices: Set[str] = set()


def deform_conv2d(
    input: Tensor,
    offset: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: IntPair = 1,
    padding: IntPair = 0,
    dilation: IntPair = 1,
    mask: Optional[Tensor] = None,
    border_gradient: str = "torchvision",
) -> Tensor:
    """Deformable convolution (DCNv1; DCNv2 when ``mask`` is given), as ``torchvision.ops.deform_conv2d``.

    Args:
        input: ``[B, C_in, H, W]``.
        offset: ``[B, 2 * offset_groups * kh * kw, H_out, W_out]``; channel ``2 * (g * kh * kw + i * kw + j)`` is
            the y-offset of kernel tap (i, j) in offset group g and the next channel its x-offset.
        weight: ``[C_out, C_in / groups, kh, kw]``; ``groups`` is inferred from its shape.
        bias: ``[C_out]`` or None.
        stride, padding, dilation: an int or a (height, width) pair.
        mask: ``[B, offset_groups * kh * kw, H_out, W_out]`` modulation (DCNv2) or None.
        border_gradient: the derivative with respect to a sampling point's y and x where it lies exactly at
            y = -1 or x = -1 (where zero offsets with padding 1 put the border taps): ``"torchvision"``, the
            one-sided derivative from above (torchvision's), or ``"mmcv"``, 0 (mmcv's). The forward is the same.

    All tensors float16, bfloat16, float32 or float64 (one dtype), on one device. A sampling point with a NaN
    coordinate samples NaN; one at +-inf or beyond the image samples 0 (see README, "Non-finite offsets").

    Returns:
        ``[B, C_out, H_out, W_out]``, with ``H_out = (H + 2 * pad_h - dil_h * (kh - 1) - 1) // stride_h + 1``
        (likewise W_out).
    """
    # TorchScript compiles only the last call (the C++ op checks its arguments); the tracer (TorchScript-based ONNX
    # export) takes it too, since the Python checks would read traced sizes.
    if not torch.jit.is_scripting():
        # torch.fx's Proxy (symbolic tracing, create_feature_extractor) and tensor subclasses with
        # __torch_function__: the call is handed to them whole, so a trace records it as one node.
        if torch.overrides.has_torch_function_variadic(input, offset, weight, bias, mask):
            return torch.overrides.handle_torch_function(
                deform_conv2d, (input, offset, weight, bias, mask), input, offset, weight, bias, stride, padding,
                dilation, mask, border_gradient)
        if not torch.jit.is_tracing():
            input, offset, weight, bias, mask = autocast_inputs(input, offset, weight, bias, mask)
            geo = check_args(input, offset, weight, mask, bias, stride, padding, dilation)
            check_border_gradient(border_gradient)
            if in_onnx_export():
                symbolic = _onnx_export().deform_conv_symbolic(input, offset, weight, bias, geo, mask)
                if symbolic is not None:
                    return symbolic
            if input.device.type not in _compiled_devices:
                return deform_conv2d_reference(input, offset, weight, bias, stride, padding, dilation, mask,
                                               border_gradient)
            return torch.ops.deform_conv.deform_conv2d(
                input, offset, weight, mask, bias, list(geo.stride), list(geo.padding), list(geo.dilation),
                border_gradient)
        if in_onnx_export():  # the TorchScript-based exporter: it maps the traced op with our symbolic
            _onnx_export().register_torchscript_symbolic()
    return torch.ops.deform_conv.deform_conv2d(
        input, offset, weight, mask, bias, script_pair(stride), script_pair(padding), script_pair(dilation),
        border_gradient)


@torch.jit.unused
def _onnx_export():
    """This op's ONNX export (onnx.py), imported by the first call an export makes: it imports torch.onnx."""
    from . import onnx

    return onnx


def _deform_conv2d_fake(
    input: Tensor,
    offset: Tensor,
    weight: Tensor,
    mask: Optional[Tensor],
    bias: Optional[Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    border_gradient: str = "torchvision",
) -> Tensor:
    geo = check_args(input, offset, weight, mask, bias, tuple(stride), tuple(padding), tuple(dilation))
    check_border_gradient(border_gradient)
    return input.new_empty((input.shape[0], weight.shape[0], geo.out_h, geo.out_w))


def _deform_conv2d_backward_fake(
    grad_output: Tensor,
    input: Tensor,
    offset: Tensor,
    weight: Tensor,
    mask: Optional[Tensor],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    bias_defined: bool,
    border_gradient: str = "torchvision",
):
    geo = check_args(input, offset, weight, mask, None, tuple(stride), tuple(padding), tuple(dilation))
    check_border_gradient(border_gradient)
    expected = (input.shape[0], weight.shape[0], geo.out_h, geo.out_w)
    if tuple(grad_output.shape) != expected:
        raise ValueError(f"grad_output must have shape {expected}, got {tuple(grad_output.shape)}")
    contiguous = torch.contiguous_format
    return (
        torch.empty_like(input, memory_format=contiguous),
        torch.empty_like(offset, memory_format=contiguous),
        torch.empty_like(weight, memory_format=contiguous),
        None if mask is None else torch.empty_like(mask, memory_format=contiguous),
        weight.new_empty((weight.shape[0],)) if bias_defined else None,
    )


def _setup_context(ctx, inputs, output) -> None:
    input, offset, weight, mask, bias, stride, padding, dilation, border_gradient = inputs
    ctx.save_for_backward(input, offset, weight, mask)
    ctx.geometry = (stride, padding, dilation)
    ctx.bias_defined = bias is not None
    ctx.border_gradient = border_gradient


def _backward(ctx, grad_output: Tensor):
    input, offset, weight, mask = ctx.saved_tensors
    grad_input, grad_offset, grad_weight, grad_mask, grad_bias = torch.ops.deform_conv.deform_conv2d_backward(
        grad_output, input, offset, weight, mask, *ctx.geometry, ctx.bias_defined, ctx.border_gradient
    )
    return grad_input, grad_offset, grad_weight, grad_mask, grad_bias, None, None, None, None


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "deform_conv2d does not support double backward: its gradient is not differentiable "
        "(do not pass create_graph=True through it, e.g. for gradient penalties)"
    )


def _autocast_kernel(device_type: str):
    """The op under autocast on ``device_type``, as autocast treats ``conv2d``: float32 (and half) tensors are cast
    to the autocast dtype, float64 ones are left alone, and the op runs in that dtype (the kernels accumulate in
    float32). The backward then sees the same dtypes through autograd."""

    def kernel(input, offset, weight, mask, bias, stride, padding, dilation, border_gradient="torchvision"):
        dtype = torch.get_autocast_dtype(device_type)
        input, offset, weight, mask, bias = (autocast_cast(t, dtype) for t in (input, offset, weight, mask, bias))
        with torch.autocast(device_type, enabled=False):
            return torch.ops.deform_conv.deform_conv2d(
                input, offset, weight, mask, bias, stride, padding, dilation, border_gradient)

    return kernel


# Holds the autocast registrations for as long as the process runs (dropping it would unregister them).
_autocast_library: Optional[torch.library.Library] = None


def _register_autocast() -> None:
    global _autocast_library
    _autocast_library = torch.library.Library("deform_conv", "IMPL")
    for device_type, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
        _autocast_library.impl("deform_conv2d", _autocast_kernel(device_type), key)
    refuse_sparse("deform_conv2d")


def use_compiled_kernels(devices: Set[str]) -> None:
    """Registers the fake kernels and the autograd formula once the library with the schemas ("cpu") is
    loaded, and routes calls on ``devices`` to the compiled kernels."""
    if "cpu" in devices and not _compiled_devices:
        torch.library.register_fake("deform_conv::deform_conv2d", _deform_conv2d_fake)
        torch.library.register_fake("deform_conv::deform_conv2d_backward", _deform_conv2d_backward_fake)
        torch.library.register_autograd("deform_conv::deform_conv2d", _backward, setup_context=_setup_context)
        torch.library.register_autograd(
            "deform_conv::deform_conv2d_backward", _no_double_backward, setup_context=lambda ctx, inputs, output: None
        )
        _register_autocast()
    # Meta tensors go to the op too once its schema is loaded: its fake kernel infers their shapes.
    _compiled_devices.update(devices | ({"meta"} if "cpu" in devices else set()))
