"""Code written for Deformable DETR's compiled extension (``import MultiScaleDeformableAttention as MSDA``) run on
this package's kernels: :func:`install_multiscale_deformable_attention` puts a module of that name into sys.modules.
The extension itself is never imported here."""

from __future__ import annotations

import types
from typing import Any, List, Optional

import torch
from torch import Tensor

from .._ops.ms_deform_attn.checks import check_ms_deform_attn_args
from .._ops.ms_deform_attn.function import _compiled_devices
from .._ops.ms_deform_attn.reference import ms_deform_attn_reference
from .._ops.shared.checks import check_grad_output
from .installing import install_module, new_module

MSDA_MODULE_NAME = "MultiScaleDeformableAttention"


def _check_im2col_step(im2col_step: Any) -> None:
    # Accepted for Deformable DETR's signature and otherwise ignored: the kernels need no batch chunking.
    if isinstance(im2col_step, bool) or not isinstance(im2col_step, int):
        raise TypeError(f"im2col_step must be an int, got {type(im2col_step).__name__}")
    if im2col_step < 1:
        raise ValueError(f"im2col_step must be >= 1, got {im2col_step}")


def _msda_forward(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_loc: Tensor,
                  attn_weight: Tensor, im2col_step: int) -> Tensor:
    """Deformable DETR's ``MultiScaleDeformableAttention.ms_deform_attn_forward``: value [N, S, M, D],
    spatial_shapes [L, 2] int64, level_start_index [L] int64, sampling_loc [N, Lq, M, L, P, 2],
    attn_weight [N, Lq, M, L, P] -> [N, Lq, M * D]. Records no autograd graph, as the compiled function it stands
    for: the caller's autograd.Function supplies the backward."""
    _check_im2col_step(im2col_step)
    check_ms_deform_attn_args(value, spatial_shapes, level_start_index, sampling_loc, attn_weight)
    with torch.no_grad():
        if value.device.type not in _compiled_devices:  # as ms_deform_attn: no library for this device
            return ms_deform_attn_reference(value, spatial_shapes, level_start_index, sampling_loc, attn_weight)
        return torch.ops.deform_conv.ms_deform_attn(value, spatial_shapes, level_start_index, sampling_loc,
                                                    attn_weight)


def _msda_backward(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_loc: Tensor,
                   attn_weight: Tensor, grad_output: Tensor, im2col_step: int) -> List[Tensor]:
    """Deformable DETR's ``MultiScaleDeformableAttention.ms_deform_attn_backward``: the forward's arguments with
    grad_output [N, Lq, M * D] between the weights and im2col_step (its argument order) ->
    [grad_value, grad_sampling_loc, grad_attn_weight], a list as the extension's std::vector."""
    _check_im2col_step(im2col_step)
    sizes = check_ms_deform_attn_args(value, spatial_shapes, level_start_index, sampling_loc, attn_weight)
    # grad_output's dtype, device and shape, named as the forward names its arguments (the C++ check would raise a
    # RuntimeError).
    check_grad_output(grad_output, value, "value", (sizes.batch, sizes.queries, sizes.heads * sizes.channels))
    if value.device.type not in _compiled_devices:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (value, sampling_loc, attn_weight)]
            out = ms_deform_attn_reference(leaves[0], spatial_shapes, level_start_index, leaves[1], leaves[2])
            return list(torch.autograd.grad(out, leaves, grad_output))
    with torch.no_grad():
        return list(torch.ops.deform_conv.ms_deform_attn_backward(
            grad_output, value, spatial_shapes, level_start_index, sampling_loc, attn_weight))


_msda_module: Optional[types.ModuleType] = None


def _make_msda_module() -> types.ModuleType:
    module = new_module(MSDA_MODULE_NAME, "Deformable DETR's compiled extension MultiScaleDeformableAttention, "
                                          "computed by deform_conv (installed by "
                                          "deform_conv.compat.install_multiscale_deformable_attention).")
    module.ms_deform_attn_forward = _msda_forward
    module.ms_deform_attn_backward = _msda_backward
    return module


def install_multiscale_deformable_attention(replace: bool = False) -> types.ModuleType:
    """Makes ``import MultiScaleDeformableAttention`` (Deformable DETR's compiled extension, models/ops) give a
    module whose ``ms_deform_attn_forward(value, spatial_shapes, level_start_index, sampling_loc, attn_weight,
    im2col_step)`` and ``ms_deform_attn_backward(value, spatial_shapes, level_start_index, sampling_loc,
    attn_weight, grad_output, im2col_step) -> [grad_value, grad_sampling_loc, grad_attn_weight]`` run this
    package's kernels, and returns that module. Call it before the code that imports the extension (Deformable
    DETR's ``models/ops/functions/ms_deform_attn_func.py`` and its many copies) is imported.

    The functions take the extension's arguments and shapes (see :func:`deform_conv.ms_deform_attn`); unlike
    it they also run on the CPU, accept non-contiguous tensors and any batch size (``im2col_step`` is ignored),
    and raise ``TypeError``/``ValueError`` naming the argument for bad input. Like it, they record no autograd
    graph: they are meant to be called inside an ``autograd.Function``.

    It is a call, not a top-level ``MultiScaleDeformableAttention`` package in this distribution, so that it takes
    effect only where asked: an installed package of that name would shadow a user's own build of the extension
    in every process, and claim a name that is not ours.

    Calling it again returns the same module. If a different module of that name is already imported (the real
    extension, say), it raises ``RuntimeError`` instead of replacing it, since code that already imported that one
    keeps using it whatever sys.modules says; with ``replace=True`` ours takes its place for imports from then
    on. An extension that is installed but not yet imported is shadowed for this process without a word: calling
    this function is the choice.
    """
    global _msda_module
    if _msda_module is None:
        _msda_module = _make_msda_module()
    install_module(MSDA_MODULE_NAME, _msda_module, replace)
    return _msda_module
