"""Working with models built on other libraries' deformable layers: ``convert_modules`` swaps torchvision's,
mmcv's and detectron2's layers for ours, and ``Detectron2DeformConv`` is the layer detectron2's become.

Sources are recognised by the module that defines their class and its name, never by importing the library:
this module imports neither mmcv nor detectron2."""

from __future__ import annotations

import itertools
import warnings
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn

from ._checks import IntPair
from .nn import DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack


class Detectron2DeformConv(DeformConv2d):
    """detectron2's ``DeformConv`` and ``ModulatedDeformConv`` (``detectron2.layers``): their constructor
    arguments, initialisation and state_dict keys (``weight``, ``bias``, ``norm.*``), and mmcv's border
    gradient, which is that of the mmdetection kernels detectron2 compiles.

    ``forward(x [B, C_in, H, W], offset [B, 2*deformable_groups*kh*kw, H_out, W_out],
    mask [B, deformable_groups*kh*kw, H_out, W_out] or None) -> activation(norm(conv)) [B, C_out, H_out, W_out]``.
    A mask makes it ``ModulatedDeformConv``; without one it is ``DeformConv``. ``deformable_groups`` is kept
    for the record: as everywhere in this package, the offset's channel count decides.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntPair,
        stride: IntPair = 1,
        padding: IntPair = 0,
        dilation: IntPair = 1,
        groups: int = 1,
        deformable_groups: int = 1,
        bias: bool = False,
        norm: Optional[nn.Module] = None,
        activation: Optional[Callable[[Tensor], Tensor]] = None,
        *,
        border_gradient: str = "mmcv",
    ) -> None:
        if deformable_groups < 1 or in_channels % deformable_groups != 0:
            raise ValueError(
                f"deformable_groups must be >= 1 and divide in_channels ({in_channels}), got {deformable_groups}"
            )
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         border_gradient=border_gradient)
        self.deformable_groups = deformable_groups
        self.norm = norm
        self.activation = activation

    def reset_parameters(self) -> None:
        """detectron2's initialisation: Kaiming-uniform for ReLU, bias 0."""
        nn.init.kaiming_uniform_(self.weight, nonlinearity="relu")
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, offset: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        if x.numel() == 0:
            # detectron2 returns an empty tensor of the output's shape without running norm or activation
            # (a BatchNorm would fail or update its statistics on no data), still attached to x's graph so
            # that a loss summed over an empty batch backpropagates.
            size = [
                (i + 2 * p - (d * (k - 1) + 1)) // s + 1
                for i, p, d, k, s in zip(x.shape[-2:], self.padding, self.dilation, self.kernel_size, self.stride)
            ]
            return x.new_zeros([x.shape[0], self.out_channels, *size]) + x.sum()
        out = super().forward(x, offset, mask)
        if self.norm is not None:
            out = self.norm(out)
        if self.activation is not None:
            out = self.activation(out)
        return out

    def extra_repr(self) -> str:
        text = super().extra_repr() + f", deformable_groups={self.deformable_groups}"
        if self.activation is not None and not isinstance(self.activation, nn.Module):
            text += f", activation={getattr(self.activation, '__name__', self.activation)}"
        return text


def _bias(module: nn.Module) -> bool:
    # mmcv's DeformConv2d has no bias attribute at all; the others hold None when there is no bias.
    return getattr(module, "bias", None) is not None


def _geometry(m: nn.Module) -> Tuple[int, int, IntPair, IntPair, IntPair, IntPair, int]:
    return (m.in_channels, m.out_channels, tuple(m.kernel_size), _as_arg(m.stride), _as_arg(m.padding),
            _as_arg(m.dilation), m.groups)


def _as_arg(value) -> IntPair:
    # detectron2's ModulatedDeformConv keeps stride, padding and dilation as plain ints; the others as pairs.
    return value if isinstance(value, int) else tuple(value)


def _from_torchvision(m: nn.Module) -> nn.Module:
    return DeformConv2d(*_geometry(m), bias=_bias(m), border_gradient="torchvision")


def _from_mmcv(m: nn.Module) -> nn.Module:
    return DeformConv2d(*_geometry(m), bias=_bias(m), border_gradient="mmcv")


def _from_mmcv_pack(m: nn.Module) -> nn.Module:
    return DeformConv2dPack(*_geometry(m), m.deform_groups, bias=_bias(m), im2col_step=m.im2col_step)


def _from_mmcv_modulated_pack(m: nn.Module) -> nn.Module:
    return ModulatedDeformConv2dPack(*_geometry(m), m.deform_groups, bias=_bias(m))


def _from_detectron2(m: nn.Module) -> nn.Module:
    return Detectron2DeformConv(*_geometry(m), m.deformable_groups, bias=_bias(m), norm=m.norm,
                                activation=m.activation)


# (defining module, class name) -> how to build ours. Exact classes only: a subclass defined elsewhere may
# change the forward, and a silent swap would drop that change.
_CONVERSIONS: Dict[Tuple[str, str], Callable[[nn.Module], nn.Module]] = {
    ("torchvision.ops.deform_conv", "DeformConv2d"): _from_torchvision,
    ("mmcv.ops.deform_conv", "DeformConv2d"): _from_mmcv,
    ("mmcv.ops.modulated_deform_conv", "ModulatedDeformConv2d"): _from_mmcv,
    ("mmcv.ops.deform_conv", "DeformConv2dPack"): _from_mmcv_pack,
    ("mmcv.ops.modulated_deform_conv", "ModulatedDeformConv2dPack"): _from_mmcv_modulated_pack,
    ("detectron2.layers.deform_conv", "DeformConv"): _from_detectron2,
    ("detectron2.layers.deform_conv", "ModulatedDeformConv"): _from_detectron2,
}

_OURS = (DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack)


def _class_key(cls: type) -> Tuple[str, str]:
    return cls.__module__, cls.__qualname__


def _looks_deformable(cls: type) -> bool:
    name = cls.__name__.lower()
    return "deformconv" in name or "dcn" in name or any(_class_key(base) in _CONVERSIONS for base in cls.__mro__)


def _tensor_shapes(module: nn.Module) -> Tuple[Dict[str, torch.Size], Dict[str, torch.Size]]:
    return ({n: p.shape for n, p in module.named_parameters()}, {n: b.shape for n, b in module.named_buffers()})


def _adopt(new: nn.Module, old: nn.Module) -> None:
    """Moves ``old``'s parameters and sub-layers into ``new`` as they are, the same objects, as
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` does: device, dtype, requires_grad and an optimizer built
    before the conversion all carry over, and no memory is copied."""
    old_children = dict(old.named_children())
    for name, _ in list(new.named_children()):
        setattr(new, name, old_children[name])
    old_parameters = dict(old.named_parameters(recurse=False))
    for name, _ in list(new.named_parameters(recurse=False)):
        setattr(new, name, old_parameters[name])
    new.training = old.training  # children keep their own modes: they are the old module's


def _replacement(module: nn.Module, where: str) -> Optional[nn.Module]:
    """Ours in place of ``module``, a known source; None, with a warning saying why, if it cannot be."""
    cls = type(module)
    try:
        # On the meta device: nothing allocated, no random numbers drawn; _adopt supplies every tensor.
        with torch.device("meta"):
            new = _CONVERSIONS[_class_key(cls)](module)
    except (AttributeError, TypeError, ValueError) as error:
        _warn(where, cls, f"its configuration has no equivalent here ({error})")
        return None
    if _tensor_shapes(new) != _tensor_shapes(module):
        # A reparametrised weight (weight_norm's weight_g/weight_v) or a module changed after construction:
        # swapping would lose tensors or break its state_dict.
        _warn(where, cls, f"its parameters and buffers {_describe(module)} are not those of the layer it "
                          f"would become {_describe(new)}")
        return None
    _adopt(new, module)
    return new


def _describe(module: nn.Module) -> str:
    params, buffers = _tensor_shapes(module)
    return "{" + ", ".join(f"{n}: {tuple(s)}" for n, s in {**params, **buffers}.items()) + "}"


def _warn(where: str, cls: type, reason: str) -> None:
    place = f"'{where}'" if where else "the model itself"
    # stacklevel: the caller of convert_modules, three frames up from here.
    warnings.warn(f"convert_modules: left {place} ({cls.__module__}.{cls.__qualname__}) unchanged: {reason}",
                  UserWarning, stacklevel=4)


def _warn_about_lookalikes(model: nn.Module, refused: Set[int]) -> None:
    """One warning for each remaining deformable-looking module with parameters, at the deepest level: a
    block named "DCNBlock" whose layer was converted (or is warned about itself) is just a container."""
    suspects = [
        (path, m) for path, m in model.named_modules()
        if id(m) not in refused and not isinstance(m, _OURS) and _looks_deformable(type(m))
        and any(True for _ in m.parameters())
    ]
    accounted = refused | {id(m) for _, m in suspects}
    for path, module in suspects:
        inner = itertools.islice(module.modules(), 1, None)
        if not any(isinstance(m, _OURS) or id(m) in accounted for m in inner):
            _warn(path, type(module), "not a layer convert_modules knows (torchvision's, mmcv's or detectron2's "
                                      "own classes, not subclasses defined elsewhere)")


def convert_modules(model: nn.Module) -> nn.Module:
    """Replaces, in place and at any depth, torchvision's, mmcv's and detectron2's deformable convolution
    layers in ``model`` by this package's, keeping their semantics, and returns the model (the replacement
    when ``model`` itself is such a layer).

    ==========================================================  ==============================================
    source                                                      becomes
    ==========================================================  ==============================================
    ``torchvision.ops.DeformConv2d``                            ``DeformConv2d(border_gradient="torchvision")``
    ``mmcv.ops.DeformConv2d``, ``ModulatedDeformConv2d``        ``DeformConv2d(border_gradient="mmcv")``
    ``mmcv.ops.DeformConv2dPack``                               ``DeformConv2dPack``
    ``mmcv.ops.ModulatedDeformConv2dPack``                      ``ModulatedDeformConv2dPack``
    ``detectron2.layers.DeformConv``, ``ModulatedDeformConv``   ``compat.Detectron2DeformConv`` (norm, activation)
    ==========================================================  ==============================================

    Each replacement computes what the original computes, forward and backward (including the original's
    derivative at a sampling point exactly on y = -1 or x = -1), accepts its forward arguments positionally,
    and holds the original's parameters and sub-layers themselves (the same tensors: device, dtype,
    requires_grad, optimizer references and state_dict keys stay), with its training mode. A module reached
    by several paths becomes one replacement. Hooks registered on a replaced layer are not carried over.

    Any other module whose class name contains "DeformConv" or "DCN", or that subclasses one of the sources
    above outside its library, is left as it is with a ``UserWarning`` naming its path in the model and its
    class (modules inside it are still converted; a container whose deformable layers were converted is not
    warned about).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__module__}.{type(model).__qualname__}")
    decided: Dict[int, Optional[nn.Module]] = {}
    replaced_paths: List[str] = []
    result = model
    # Every path, duplicates included: a layer registered under two names must be replaced under both.
    for path, module in list(model.named_modules(remove_duplicate=False)):
        if any(done == "" or path.startswith(done + ".") for done in replaced_paths):
            continue  # inside a replaced layer: its sub-layers moved into the replacement as they are
        if _class_key(type(module)) not in _CONVERSIONS:
            continue
        if id(module) not in decided:
            decided[id(module)] = _replacement(module, path)
        new = decided[id(module)]
        if new is None:
            continue
        replaced_paths.append(path)
        if path == "":
            result = new
        else:
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, new)
    _warn_about_lookalikes(result, {key for key, new in decided.items() if new is None})
    return result


# ---------------------------------------------------------------------------------------------------------------
# Multi-scale deformable attention: code written for Deformable DETR's compiled extension, and transformers'
# attention modules, routed through ms_deform_attn. Neither transformers nor the extension is imported here until a
# function below is called.

import contextlib  # noqa: E402
import importlib  # noqa: E402
import importlib.machinery  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402

from . import _ops  # noqa: E402
from ._checks import check_ms_deform_attn_args  # noqa: E402
from ._ms_deform_attn import ms_deform_attn  # noqa: E402
from ._reference import ms_deform_attn_reference  # noqa: E402

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
        if value.device.type not in _ops._compiled_devices:  # as ms_deform_attn: no library for this device
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
    expected = (sizes.batch, sizes.queries, sizes.heads * sizes.channels)
    if tuple(grad_output.shape) != expected:
        raise ValueError(f"grad_output must have shape {expected} [N, Lq, M * D] (from value and sampling_loc), "
                         f"got {tuple(grad_output.shape)}")
    if value.device.type not in _ops._compiled_devices:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (value, sampling_loc, attn_weight)]
            out = ms_deform_attn_reference(leaves[0], spatial_shapes, level_start_index, leaves[1], leaves[2])
            return list(torch.autograd.grad(out, leaves, grad_output))
    with torch.no_grad():
        return list(torch.ops.deform_conv.ms_deform_attn_backward(
            grad_output, value, spatial_shapes, level_start_index, sampling_loc, attn_weight))


_msda_module: Optional[types.ModuleType] = None


def _make_msda_module() -> types.ModuleType:
    module = types.ModuleType(MSDA_MODULE_NAME, "Deformable DETR's compiled extension MultiScaleDeformableAttention, "
                                                "computed by deform_conv (installed by "
                                                "deform_conv.compat.install_multiscale_deformable_attention).")
    # A spec of its own: importlib.util.find_spec(name), which some code uses to ask whether the extension is
    # there, raises on a module in sys.modules whose __spec__ is None.
    module.__spec__ = importlib.machinery.ModuleSpec(MSDA_MODULE_NAME, None, origin=__name__)
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
    if MSDA_MODULE_NAME in sys.modules and sys.modules[MSDA_MODULE_NAME] is not _msda_module and not replace:
        existing = sys.modules[MSDA_MODULE_NAME]
        where = getattr(existing, "__file__", None) or repr(existing)
        raise RuntimeError(
            f"sys.modules[{MSDA_MODULE_NAME!r}] is already another module ({where}); code that imported it keeps "
            f"using it. Pass replace=True to install deform_conv's in its place for later imports, or call this "
            f"before anything imports {MSDA_MODULE_NAME}"
        )
    sys.modules[MSDA_MODULE_NAME] = _msda_module
    return _msda_module


# --- transformers ----------------------------------------------------------------------------------------------
#
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
