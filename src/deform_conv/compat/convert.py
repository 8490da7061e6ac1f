"""Models built on other libraries' deformable layers: ``convert_modules`` swaps torchvision's, mmcv's,
detectron2's, InternImage's and the DCNv4 repository's layers for ours, and ``Detectron2DeformConv`` is the layer
detectron2's become.

Sources are recognised by the module that defines their class and its name, never by importing the library:
this module imports neither mmcv nor detectron2."""

from __future__ import annotations

import itertools
import warnings
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn

from .._ops.shared.checks import IntPair
from ..nn import DCNv3, DCNv4, DeformConv2d, DeformConv2dPack, FlashDeformAttn, ModulatedDeformConv2dPack


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


def _norm_and_activation(m: nn.Module) -> Tuple[str, str]:
    """InternImage's DCNv3 keeps neither norm_layer nor act_layer: read them off its dw_conv (depthwise conv, norm,
    activation)."""
    norm = "BN" if any(isinstance(layer, nn.BatchNorm2d) for layer in m.dw_conv[1].modules()) else "LN"
    return norm, type(m.dw_conv[2]).__name__


def _from_internimage_dcnv3(m: nn.Module) -> nn.Module:
    norm, act = _norm_and_activation(m)
    return DCNv3(m.channels, m.kernel_size, m.dw_kernel_size, m.stride, m.pad, m.dilation, m.group, m.offset_scale,
                 act_layer=act, norm_layer=norm, center_feature_scale=m.center_feature_scale,
                 remove_center=bool(m.remove_center))


def _from_dcnv4(m: nn.Module) -> nn.Module:
    output_bias = m.without_pointwise or m.output_proj.bias is not None
    return DCNv4(m.channels, m.kernel_size, m.stride, m.pad, m.dilation, m.group, m.offset_scale, m.dw_kernel_size,
                 m.center_feature_scale, bool(m.remove_center), output_bias, m.without_pointwise)


def _from_flash_deform_attn(m: nn.Module) -> nn.Module:
    return FlashDeformAttn(m.d_model, m.n_levels, m.n_heads, m.n_points)


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

# InternImage's and the DCNv4 repository's modules live in packages copied into each project (InternImage's
# classification/, detection/ and segmentation/ each hold an ops_dcnv3; FlashInternImage's hold a DCNv4), imported
# under whatever name the project gives the package, but always from the same files: (the defining module's last
# two components -- the package's modules/<file> -- and the class name) -> how to build ours.
_SUFFIX_CONVERSIONS: Dict[Tuple[str, str], Callable[[nn.Module], nn.Module]] = {
    ("modules.dcnv3", "DCNv3"): _from_internimage_dcnv3,
    ("modules.dcnv3", "DCNv3_pytorch"): _from_internimage_dcnv3,
    ("modules.dcnv4", "DCNv4"): _from_dcnv4,
    ("modules.flash_deform_attn", "FlashDeformAttn"): _from_flash_deform_attn,
}

_OURS = (DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack, DCNv3, DCNv4, FlashDeformAttn)


def _class_key(cls: type) -> Tuple[str, str]:
    return cls.__module__, cls.__qualname__


def _conversion(cls: type) -> Optional[Callable[[nn.Module], nn.Module]]:
    """How to build ours from an instance of ``cls``, or None: by its exact class (defining module and name)."""
    module, name = _class_key(cls)
    if (module, name) in _CONVERSIONS:
        return _CONVERSIONS[(module, name)]
    if cls in _OURS:
        return None
    return _SUFFIX_CONVERSIONS.get((".".join(module.split(".")[-2:]), name))


def _looks_deformable(cls: type) -> bool:
    name = cls.__name__.lower()
    return ("deformconv" in name or "dcn" in name or "deformattn" in name
            or any(_conversion(base) is not None for base in cls.__mro__))


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
            new = _conversion(cls)(module)
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
    InternImage's ``ops_dcnv3.modules.DCNv3``, ``DCNv3_pytorch``  ``nn.DCNv3``
    the DCNv4 repository's ``DCNv4.DCNv4``                      ``nn.DCNv4``
    the DCNv4 repository's ``DCNv4.FlashDeformAttn``            ``nn.FlashDeformAttn``
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
        if _conversion(type(module)) is None:
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
