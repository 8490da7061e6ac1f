"""Code written for InternImage's and the DCNv4 repository's compiled extensions, run on this package's kernels:
:func:`install_dcnv3` puts stand-ins for InternImage's ``DCNv3`` extension and its ``ops_dcnv3`` package into
sys.modules, :func:`install_dcnv4` one for the DCNv4 package (``DCNv4.ext`` and its modules and functions). Neither
upstream package is imported here.

The extensions' functions take the extensions' arguments in their order and record no autograd graph (they stand
for compiled functions called inside an ``autograd.Function``); the arguments that only tuned upstream's CUDA
launches (``im2col_step``, ``d_stride``, ``block_thread``) are accepted and ignored. The modules and the
``*Function.apply`` stand-ins are ours, with autograd."""

from __future__ import annotations

import contextlib
import types
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor

from .._ops.dcnv3 import dcnv3, dcnv3_reference
from .._ops.dcnv3.function import _compiled_devices as _dcnv3_devices
from .._ops.dcnv4 import dcnv4, dcnv4_reference
from .._ops.dcnv4.function import _compiled_devices as _dcnv4_devices
from .._ops.flash_deform_attn import flash_deform_attn, flash_deform_attn_reference
from .._ops.flash_deform_attn.function import _compiled_devices as _flash_devices
from .installing import install_module, new_module


def _check_group_channels(input: Tensor, group: int, group_channels: int) -> None:
    channels = input.shape[-1] if input.dim() == 4 else None
    if channels is not None and group * group_channels != channels:
        raise ValueError(f"group * group_channels must be input's channels (input.shape[3] = {channels}), got "
                         f"group = {group} and group_channels = {group_channels}")


def _as_compiled(device_type: str):
    """What a compiled extension's function runs under: no autocast (its caller's ``custom_fwd`` decides the
    dtypes; an op of ours would apply its own autocast rule and return, say, bfloat16 for float32 tensors)."""
    if device_type in ("cpu", "cuda"):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _without_graph(devices, op: Callable, reference: Callable, args: Sequence) -> Tensor:
    """The compiled op (or, on a device without compiled kernels, the reference) on ``args``, recording no graph."""
    with torch.no_grad(), _as_compiled(args[0].device.type):
        if args[0].device.type in devices:
            return op(*args)
        return reference(*args)


def _gradients(devices, op_backward: Callable, reference: Callable, grad_output: Tensor, tensors: Sequence[Tensor],
               rest: Sequence) -> List[Tensor]:
    """The compiled backward, or autograd through the reference, as a list (the extensions' std::vector)."""
    if tensors[0].device.type in devices:
        with torch.no_grad():
            return list(op_backward(grad_output.contiguous(), *tensors, *rest))
    with torch.enable_grad(), _as_compiled(tensors[0].device.type):
        leaves = [t.detach().requires_grad_() for t in tensors]
        out = reference(*leaves, *rest)
        return list(torch.autograd.grad(out, leaves, grad_output))


# ------------------------------------------------------------------------------------------------------ DCNv3

def _dcnv3_args(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group, offset_scale,
                remove_center):
    return ([kernel_h, kernel_w], [stride_h, stride_w], [pad_h, pad_w], [dilation_h, dilation_w], group,
            float(offset_scale), bool(remove_center))


def dcnv3_forward(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                  group, group_channels, offset_scale, im2col_step, remove_center=0):
    """InternImage's ``DCNv3.dcnv3_forward`` (version 1.1; 1.0 had no remove_center)."""
    _check_group_channels(input, group, group_channels)
    rest = _dcnv3_args(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
                       offset_scale, remove_center)
    return _without_graph(_dcnv3_devices, dcnv3, dcnv3_reference, (input, offset, mask, *rest))


def dcnv3_backward(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
                   dilation_w, group, group_channels, offset_scale, grad_output, im2col_step, remove_center=0):
    """InternImage's ``DCNv3.dcnv3_backward`` -> [grad_input, grad_offset, grad_mask]."""
    _check_group_channels(input, group, group_channels)
    rest = _dcnv3_args(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
                       offset_scale, remove_center)
    return _gradients(_dcnv3_devices, torch.ops.deform_conv.dcnv3_backward, dcnv3_reference, grad_output,
                      (input, offset, mask), rest)


class DCNv3Function:
    """``ops_dcnv3.functions.DCNv3Function``: ``apply`` takes its arguments and runs :func:`deform_conv.dcnv3`
    (differentiable)."""

    @staticmethod
    def apply(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
              group, group_channels, offset_scale, im2col_step, remove_center=0):
        _check_group_channels(input, group, group_channels)
        return dcnv3(input, offset, mask, *_dcnv3_args(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                                                       dilation_h, dilation_w, group, offset_scale, remove_center))


def dcnv3_core_pytorch(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h,
                       dilation_w, group, group_channels, offset_scale, remove_center):
    """``ops_dcnv3.functions.dcnv3_core_pytorch``'s arguments, computed by :func:`deform_conv.dcnv3` (upstream's
    grid_sample version pads W by pad_h and H by pad_w; this follows the CUDA kernel's padding)."""
    return DCNv3Function.apply(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                               dilation_h, dilation_w, group, group_channels, offset_scale, 64, remove_center)


# ------------------------------------------------------------------------------------------------------ DCNv4

def _dcnv4_args(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group, offset_scale,
                remove_center, softmax):
    return (*_dcnv3_args(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
                         offset_scale, remove_center), bool(softmax))


def dcnv4_forward(input, offset_mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                  group, group_channels, offset_scale, im2col_step, remove_center, d_stride=8, block_thread=0,
                  softmax=False):
    """The DCNv4 extension's ``dcnv4_forward``."""
    _check_group_channels(input, group, group_channels)
    rest = _dcnv4_args(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
                       offset_scale, remove_center, softmax)
    return _without_graph(_dcnv4_devices, dcnv4, dcnv4_reference, (input, offset_mask, *rest))


def dcnv4_backward(input, offset_mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                   group, group_channels, offset_scale, im2col_step, grad_output, remove_center, d_stride=1,
                   block_thread=0, softmax=False):
    """The DCNv4 extension's ``dcnv4_backward`` -> [grad_input, grad_offset_mask]."""
    _check_group_channels(input, group, group_channels)
    rest = _dcnv4_args(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
                       offset_scale, remove_center, softmax)
    return _gradients(_dcnv4_devices, torch.ops.deform_conv.dcnv4_backward, dcnv4_reference, grad_output,
                      (input, offset_mask), rest)


def flash_deform_attn_forward(value, spatial_shapes, level_start_index, sampling_loc_attn, im2col_step, K,
                              d_stride=8, block_thread=0):
    """The DCNv4 extension's ``flash_deform_attn_forward`` (K: points a level)."""
    return _without_graph(_flash_devices, flash_deform_attn, flash_deform_attn_reference,
                          (value, spatial_shapes, level_start_index, sampling_loc_attn, K))


def flash_deform_attn_backward(value, spatial_shapes, level_start_index, sampling_loc_attn, grad_output, im2col_step,
                               K, d_stride=1, block_thread=0):
    """The DCNv4 extension's ``flash_deform_attn_backward`` -> [grad_value, grad_sampling_loc_attn]."""
    grads = _gradients(_flash_devices, _flash_backward, _flash_reference, grad_output,
                       (value, sampling_loc_attn), (spatial_shapes, level_start_index, K))
    return grads


def _flash_backward(grad_output, value, sampling_loc_attn, spatial_shapes, level_start_index, K):
    return torch.ops.deform_conv.flash_deform_attn_backward(grad_output, value, spatial_shapes, level_start_index,
                                                            sampling_loc_attn, K)


def _flash_reference(value, sampling_loc_attn, spatial_shapes, level_start_index, K):
    return flash_deform_attn_reference(value, spatial_shapes, level_start_index, sampling_loc_attn, K)


class DCNv4Function:
    """``DCNv4.DCNv4Function``: ``apply`` takes its arguments and runs :func:`deform_conv.dcnv4` (differentiable;
    without softmax, as upstream's)."""

    @staticmethod
    def apply(input, offset_mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
              group, group_channels, offset_scale, im2col_step, remove_center):
        _check_group_channels(input, group, group_channels)
        return dcnv4(input, offset_mask, *_dcnv4_args(kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w,
                                                      dilation_h, dilation_w, group, offset_scale, remove_center,
                                                      False))


class FlashDeformAttnFunction:
    """``DCNv4.FlashDeformAttnFunction``: ``apply(value, spatial_shapes, level_start_index, sampling_loc_attn,
    im2col_step, K=8)`` runs :func:`deform_conv.flash_deform_attn` (differentiable)."""

    @staticmethod
    def apply(value, value_spatial_shapes, value_level_start_index, sampling_loc_attn, im2col_step, K=8):
        return flash_deform_attn(value, value_spatial_shapes, value_level_start_index, sampling_loc_attn, K)


# ------------------------------------------------------------------------------------------------ installing

_dcnv3_modules: Optional[dict] = None
_dcnv4_modules: Optional[dict] = None


def _populated(name: str, doc: str, package: bool = False, **attributes) -> types.ModuleType:
    module = new_module(name, doc, package)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def _make_dcnv3_modules() -> dict:
    from ..nn.dcnv3 import DCNv3

    extension = _populated("DCNv3", "InternImage's DCNv3 extension, computed by deform_conv (install_dcnv3).",
                           dcnv3_forward=dcnv3_forward, dcnv3_backward=dcnv3_backward, __version__="1.1")
    functions = _populated("ops_dcnv3.functions", "InternImage's ops_dcnv3.functions, deform_conv's.",
                           DCNv3Function=DCNv3Function, dcnv3_core_pytorch=dcnv3_core_pytorch)
    modules = _populated("ops_dcnv3.modules", "InternImage's ops_dcnv3.modules, deform_conv's.", DCNv3=DCNv3,
                         DCNv3_pytorch=DCNv3)
    package = _populated("ops_dcnv3", "InternImage's ops_dcnv3, deform_conv's (install_dcnv3).", package=True,
                         functions=functions, modules=modules)
    return {"DCNv3": extension, "ops_dcnv3": package, "ops_dcnv3.functions": functions,
            "ops_dcnv3.modules": modules}


def _make_dcnv4_modules() -> dict:
    from ..nn.dcnv4 import DCNv4
    from ..nn.flash_deform_attn import FlashDeformAttn

    ext = _populated("DCNv4.ext", "The DCNv4 extension, computed by deform_conv (install_dcnv4).",
                     dcnv4_forward=dcnv4_forward, dcnv4_backward=dcnv4_backward,
                     flash_deform_attn_forward=flash_deform_attn_forward,
                     flash_deform_attn_backward=flash_deform_attn_backward)
    functions = _populated("DCNv4.functions", "DCNv4.functions, deform_conv's.", DCNv4Function=DCNv4Function,
                           FlashDeformAttnFunction=FlashDeformAttnFunction)
    modules = _populated("DCNv4.modules", "DCNv4.modules, deform_conv's.", DCNv4=DCNv4,
                         FlashDeformAttn=FlashDeformAttn)
    package = _populated("DCNv4", "The DCNv4 package, deform_conv's (install_dcnv4).", package=True, ext=ext,
                         functions=functions, modules=modules, DCNv4=DCNv4, FlashDeformAttn=FlashDeformAttn,
                         DCNv4Function=DCNv4Function, FlashDeformAttnFunction=FlashDeformAttnFunction)
    return {"DCNv4": package, "DCNv4.ext": ext, "DCNv4.functions": functions, "DCNv4.modules": modules}


def _install(modules: dict, replace: bool) -> None:
    # Every name is checked before any is installed: a refusal leaves sys.modules as it was.
    import sys

    if not replace:
        for name, module in modules.items():
            existing = sys.modules.get(name)
            if existing is not None and existing is not module:
                install_module(name, module, replace=False)  # raises, naming the module
    for name, module in modules.items():
        install_module(name, module, replace=True)


def install_dcnv3(replace: bool = False) -> types.ModuleType:
    """Makes ``import DCNv3`` (InternImage's compiled extension) and ``import ops_dcnv3`` (its package:
    ``functions.DCNv3Function``, ``functions.dcnv3_core_pytorch``, ``modules.DCNv3``, ``modules.DCNv3_pytorch``) give
    this package's stand-ins, so that InternImage's unchanged model code (``from ops_dcnv3 import modules as
    opsm``) runs on our kernels, on the CPU too. Returns the ``DCNv3`` module. ``dcnv3_forward`` and
    ``dcnv3_backward`` take the extension's arguments in its order (version 1.1; version 1.0's, without
    ``remove_center``, as well). Refuses to shadow an already imported module of those names unless
    ``replace=True``, as :func:`install_multiscale_deformable_attention` does.

    InternImage's own ``ops_dcnv3/functions/dcnv3_func.py`` in some versions reads
    ``pkg_resources.get_distribution('DCNv3').version``, which fails on current setuptools and without a ``DCNv3``
    distribution; the ``ops_dcnv3`` installed here does not."""
    global _dcnv3_modules
    if _dcnv3_modules is None:
        _dcnv3_modules = _make_dcnv3_modules()
    _install(_dcnv3_modules, replace)
    return _dcnv3_modules["DCNv3"]


def install_dcnv4(replace: bool = False) -> types.ModuleType:
    """Makes ``import DCNv4`` give this package's stand-in for the DCNv4 package: ``DCNv4.ext`` with
    ``dcnv4_forward``/``dcnv4_backward`` and ``flash_deform_attn_forward``/``flash_deform_attn_backward`` (the
    extension's arguments; ``d_stride`` and ``block_thread`` accepted and ignored), ``DCNv4.DCNv4``,
    ``DCNv4.FlashDeformAttn``, ``DCNv4.DCNv4Function``, ``DCNv4.FlashDeformAttnFunction`` (also under
    ``DCNv4.modules`` and ``DCNv4.functions``), so FlashInternImage's model code imports and runs unchanged, on a
    CPU-only machine too. Returns the package. Refuses to shadow already imported modules unless
    ``replace=True``."""
    global _dcnv4_modules
    if _dcnv4_modules is None:
        _dcnv4_modules = _make_dcnv4_modules()
    _install(_dcnv4_modules, replace)
    return _dcnv4_modules["DCNv4"]
