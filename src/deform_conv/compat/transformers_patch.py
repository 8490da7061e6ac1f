"""transformers' multi-scale deformable attention routed through :func:`deform_conv.ms_deform_attn`:
:func:`patch_transformers`, :func:`unpatch_transformers` and the context manager :func:`transformers_patched`.
transformers is imported only when one of them is called."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import Tensor

from .._ops.ms_deform_attn import ms_deform_attn

# transformers copies one module class, MultiScaleDeformableAttention (decorated for its hub kernel
# "MultiScaleDeformableAttention"), into every model that uses it (Deformable DETR, Grounding DINO, RT-DETR, ...),
# and one function, multi_scale_deformable_attention, into Mask2Former and OneFormer; both are Deformable DETR's
# grid_sample composition. Each copy is found by scanning the model files for its definition, so that a model
# added in a later release is covered too, and patched only if its signature is the one below (a changed copy is
# left alone, with a warning).

_CLASS_NAME = "MultiScaleDeformableAttention"
_FUNCTION_NAME = "multi_scale_deformable_attention"
_CLASS_PARAMETERS = ("self", "value", "value_spatial_shapes", "value_spatial_shapes_list", "level_start_index",
                     "sampling_locations", "attention_weights", "im2col_step")
_FUNCTION_PARAMETERS = ("value", "value_spatial_shapes", "sampling_locations", "attention_weights")

# "module.name" of each patched class or function -> (the class or module holding it, the attribute, its own value)
_transformers_patches: Dict[str, Tuple[Any, str, Any]] = {}


def _transformers_forward(self, value: Tensor, value_spatial_shapes: Tensor, value_spatial_shapes_list: Any,
                          level_start_index: Tensor, sampling_locations: Tensor, attention_weights: Tensor,
                          im2col_step: int) -> Tensor:
    """transformers' ``MultiScaleDeformableAttention.forward`` through :func:`deform_conv.ms_deform_attn`.
    value_spatial_shapes_list, the levels' (H, W) as Python ints, is what the grid_sample version splits value
    with; the op reads the same from the tensor."""
    return ms_deform_attn(value, value_spatial_shapes, level_start_index, sampling_locations, attention_weights,
                          im2col_step)


def _transformers_function(value: Tensor, value_spatial_shapes: Any, sampling_locations: Tensor,
                           attention_weights: Tensor) -> Tensor:
    """Mask2Former's and OneFormer's ``multi_scale_deformable_attention`` through :func:`deform_conv.ms_deform_attn`.
    They pass the levels' (H, W) as a list of Python ints; the op takes them as a tensor with the start of each
    level."""
    shapes = torch.as_tensor(value_spatial_shapes, dtype=torch.long, device=value.device)  # [L, 2]
    starts = torch.cat((shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]))  # [L]
    return ms_deform_attn(value, shapes, starts, sampling_locations, attention_weights)


def _parameters(fn: Any) -> Tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _transformers_targets() -> List[Tuple[str, Any, str, Tuple[str, ...], Any]]:
    """(name, owner, attribute, expected parameters, replacement) of each copy in the installed transformers,
    importing the model modules that define one (twelve in transformers 5.24)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        raise ImportError("patch_transformers: transformers is not installed")
    targets = []
    for path in sorted((Path(spec.origin).parent / "models").glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8")
        has_class = f"\nclass {_CLASS_NAME}(" in text
        has_function = f"\ndef {_FUNCTION_NAME}(" in text
        if not (has_class or has_function):
            continue
        module_name = f"transformers.models.{path.parent.name}.{path.stem}"
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # the model needs a package that is missing here: it cannot run in this process either
        if has_class and isinstance(getattr(module, _CLASS_NAME, None), type):
            cls = getattr(module, _CLASS_NAME)
            targets.append((f"{module_name}.{_CLASS_NAME}", cls, "forward", _CLASS_PARAMETERS, _transformers_forward))
        if has_function and callable(getattr(module, _FUNCTION_NAME, None)):
            targets.append((f"{module_name}.{_FUNCTION_NAME}", module, _FUNCTION_NAME, _FUNCTION_PARAMETERS,
                            _transformers_function))
    return targets


def patch_transformers() -> Tuple[str, ...]:
    """Routes transformers' multi-scale deformable attention through :func:`deform_conv.ms_deform_attn`, for
    every model of the installed transformers that has it: the forward of each model's
    ``MultiScaleDeformableAttention`` class (Deformable DETR, Grounding DINO, MM Grounding DINO, RT-DETR,
    OmDet-Turbo, LW-DETR, RF-DETR, PP-DocLayout in transformers 5) and Mask2Former's and OneFormer's
    ``multi_scale_deformable_attention`` function. Models built before the call are affected too (the class's
    forward changes, not the instances).

    Same values as transformers' grid_sample composition (bilinear, zero padding, align_corners=False), forward and
    backward, up to rounding. (Where a sampling point lies exactly on a pixel centre, as many of the encoder's
    points of a freshly initialised model do, the derivative of bilinear interpolation jumps, and which side each
    implementation's rounding lands on decides its gradient there: ours computes the pixel coordinate as Deformable
    DETR's kernel does, loc * W - 0.5, grid_sample as ((2 * loc - 1 + 1) * W - 1) / 2.)

    Idempotent. Returns the names ("module.attribute") of all that now runs ours, patched by this call or an
    earlier one. A copy whose signature is not the one patched here (a later transformers that changed it) is left
    alone with a ``UserWarning``; so is finding none at all.

    Imports transformers and those model modules (``import deform_conv`` imports neither). A model kernelized by
    the ``kernels`` package (transformers' ``use_kernels=True``) holds, in each instance, the forward that
    ``kernelize`` bound it to: the hub kernel, or the class's forward as it was at that moment; patching the class
    afterwards does not reach it. :func:`unpatch_transformers` undoes the patch; :func:`transformers_patched` is
    the context manager.
    """
    for name, owner, attribute, parameters, replacement in _transformers_targets():
        current = owner.__dict__.get(attribute)
        if current is replacement:
            continue
        if _parameters(current) != parameters:
            warnings.warn(f"patch_transformers: left {name} unchanged: its parameters {_parameters(current)} are not "
                          f"the ones it replaces {parameters}", UserWarning, stacklevel=2)
            continue
        _transformers_patches[name] = (owner, attribute, current)
        setattr(owner, attribute, replacement)
    if not _transformers_patches:
        import transformers

        warnings.warn(f"patch_transformers: transformers {transformers.__version__} has no {_CLASS_NAME} class nor "
                      f"{_FUNCTION_NAME} function with the signatures patched here; nothing was patched",
                      UserWarning, stacklevel=2)
    return tuple(sorted(_transformers_patches))


def _restore(names) -> Tuple[str, ...]:
    restored = []
    for name in names:
        owner, attribute, original = _transformers_patches.pop(name)
        setattr(owner, attribute, original)
        restored.append(name)
    return tuple(sorted(restored))


def unpatch_transformers() -> Tuple[str, ...]:
    """Undoes :func:`patch_transformers`: every patched class and function gets its own code back. Returns their
    names; () when nothing was patched. Does not import transformers."""
    return _restore(list(_transformers_patches))


@contextlib.contextmanager
def transformers_patched() -> Iterator[Tuple[str, ...]]:
    """``with deform_conv.compat.transformers_patched() as names:`` :func:`patch_transformers` for the block; on
    leaving it, restores what the block patched (what was patched before it stays patched)."""
    before = set(_transformers_patches)
    names = patch_transformers()
    try:
        yield names
    finally:
        _restore([name for name in names if name not in before and name in _transformers_patches])
