"""convert_modules: torchvision's, mmcv's and detectron2's layers replaced by ours, with the same numbers.

torchvision's layer is the real one. mmcv's and detectron2's are stand-ins defined here with their libraries'
constructor arguments, attributes and forward code, computed with our reference at mmcv's border gradient
(what mmcv's and detectron2's kernels compute), and with their libraries' module paths, which is how the
converter recognises a class."""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.nn.modules.utils import _pair

from helpers.common import TOLERANCES

import deform_conv
from deform_conv import DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack, deform_conv2d_reference
from deform_conv.compat import Detectron2DeformConv

DTYPE = torch.float64
RTOL, ATOL = TOLERANCES[DTYPE]


def _as_if_from(module: str, name: str):
    def rename(cls):
        cls.__module__, cls.__name__, cls.__qualname__ = module, name, name
        return cls
    return rename


def _mmcv_reference(x, offset, weight, bias, stride, padding, dilation, mask=None):
    return deform_conv2d_reference(x, offset, weight, bias, stride, padding, dilation, mask, border_gradient="mmcv")


@_as_if_from("mmcv.ops.deform_conv", "DeformConv2d")
class MmcvDeformConv2d(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 deform_groups=1, bias=False, im2col_step=32):
        super().__init__()
        if bias:
            raise ValueError("bias is not supported in mmcv's DeformConv2d")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride = _pair(kernel_size), _pair(stride)
        self.padding, self.dilation = _pair(padding), _pair(dilation)
        self.groups, self.deform_groups, self.im2col_step = groups, deform_groups, im2col_step
        self.transposed, self.output_padding = False, (0,)
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        nn.init.kaiming_uniform_(self.weight, nonlinearity="relu")  # and no bias attribute at all

    def forward(self, x, offset):
        return _mmcv_reference(x, offset, self.weight, None, self.stride, self.padding, self.dilation)


@_as_if_from("mmcv.ops.deform_conv", "DeformConv2dPack")
class MmcvDeformConv2dPack(MmcvDeformConv2d):
    _version = 2

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conv_offset = nn.Conv2d(self.in_channels, self.deform_groups * 2 * self.kernel_size[0] *
                                     self.kernel_size[1], self.kernel_size, self.stride, self.padding,
                                     self.dilation, bias=True)
        nn.init.zeros_(self.conv_offset.weight)
        nn.init.zeros_(self.conv_offset.bias)

    def forward(self, x):
        return _mmcv_reference(x, self.conv_offset(x), self.weight, None, self.stride, self.padding, self.dilation)


@_as_if_from("mmcv.ops.modulated_deform_conv", "ModulatedDeformConv2d")
class MmcvModulatedDeformConv2d(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 deform_groups=1, bias=True):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride = _pair(kernel_size), _pair(stride)
        self.padding, self.dilation = _pair(padding), _pair(dilation)
        self.groups, self.deform_groups = groups, deform_groups
        self.transposed, self.output_padding = False, (0,)
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_channels))
        else:
            self.register_parameter("bias", None)
        nn.init.uniform_(self.weight, -0.3, 0.3)

    def forward(self, x, offset, mask):
        return _mmcv_reference(x, offset, self.weight, self.bias, self.stride, self.padding, self.dilation, mask)


@_as_if_from("mmcv.ops.modulated_deform_conv", "ModulatedDeformConv2dPack")
class MmcvModulatedDeformConv2dPack(MmcvModulatedDeformConv2d):
    _version = 2

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conv_offset = nn.Conv2d(self.in_channels, self.deform_groups * 3 * self.kernel_size[0] *
                                     self.kernel_size[1], self.kernel_size, self.stride, self.padding,
                                     self.dilation, bias=True)
        nn.init.zeros_(self.conv_offset.weight)
        nn.init.zeros_(self.conv_offset.bias)

    def forward(self, x):
        o1, o2, mask = torch.chunk(self.conv_offset(x), 3, dim=1)
        return _mmcv_reference(x, torch.cat((o1, o2), dim=1), self.weight, self.bias, self.stride, self.padding,
                               self.dilation, torch.sigmoid(mask))


class _NewEmptyTensorOp(torch.autograd.Function):
    """detectron2's: an empty tensor of a given shape whose gradient flows back as an empty one."""

    @staticmethod
    def forward(ctx, x, new_shape):
        ctx.shape = x.shape
        return x.new_empty(new_shape)

    @staticmethod
    def backward(ctx, grad):
        return _NewEmptyTensorOp.apply(grad, ctx.shape), None


def _detectron2_empty(layer, x):
    size = [(i + 2 * p - (di * (k - 1) + 1)) // s + 1 for i, p, di, k, s in
            zip(x.shape[-2:], _pair(layer.padding), _pair(layer.dilation), layer.kernel_size, _pair(layer.stride))]
    return _NewEmptyTensorOp.apply(x, [x.shape[0], layer.weight.shape[0], *size])


@_as_if_from("detectron2.layers.deform_conv", "DeformConv")
class Detectron2DeformConvStandIn(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 deformable_groups=1, bias=False, norm=None, activation=None):
        super().__init__()
        if bias:
            raise ValueError("detectron2's DeformConv has no bias")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride = _pair(kernel_size), _pair(stride)
        self.padding, self.dilation = _pair(padding), _pair(dilation)
        self.groups, self.deformable_groups = groups, deformable_groups
        self.norm, self.activation = norm, activation
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        self.bias = None
        nn.init.kaiming_uniform_(self.weight, nonlinearity="relu")

    def forward(self, x, offset):
        if x.numel() == 0:
            return _detectron2_empty(self, x)
        x = _mmcv_reference(x, offset, self.weight, None, self.stride, self.padding, self.dilation)
        if self.norm is not None:
            x = self.norm(x)
        if self.activation is not None:
            x = self.activation(x)
        return x


@_as_if_from("detectron2.layers.deform_conv", "ModulatedDeformConv")
class Detectron2ModulatedDeformConvStandIn(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 deformable_groups=1, bias=True, norm=None, activation=None):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = _pair(kernel_size)
        self.stride, self.padding, self.dilation = stride, padding, dilation  # plain ints, as detectron2 keeps them
        self.groups, self.deformable_groups, self.with_bias = groups, deformable_groups, bias
        self.norm, self.activation = norm, activation
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        nn.init.kaiming_uniform_(self.weight, nonlinearity="relu")

    def forward(self, x, offset, mask):
        if x.numel() == 0:
            return _detectron2_empty(self, x)
        x = _mmcv_reference(x, offset, self.weight, self.bias, self.stride, self.padding, self.dilation, mask)
        if self.norm is not None:
            x = self.norm(x)
        if self.activation is not None:
            x = self.activation(x)
        return x


# --- the cases: (layer, the tensors its forward takes, what it becomes, border gradient) ----------------------


def _randomise(layer: nn.Module, scale: float = 0.5) -> nn.Module:
    """Non-zero values everywhere (zero-initialised biases and conv_offsets would hide a wrong mapping)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(scale * torch.randn(p.shape, dtype=p.dtype, generator=g))
        for name, b in layer.named_buffers():
            if b.is_floating_point():
                b.copy_(torch.rand(b.shape, dtype=b.dtype, generator=g) + (0.5 if "var" in name else -0.5))
    return layer


# The awkward geometry: kernel 3x2, stride (2, 1), padding (1, 0), dilation (2, 1), 2 weight groups; the
# offsets come in 3 groups (not nested in the weight groups).
GEOMETRY = dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1), groups=2)
OFFSET_GROUPS = 3


def _inputs(with_mask: bool, zero_offsets: bool = False, batch: int = 2) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch, 6, 13, 8, dtype=DTYPE, generator=g)
    offset = 2 * torch.randn(batch, 2 * OFFSET_GROUPS * 6, 6, 7, dtype=DTYPE, generator=g)
    if zero_offsets:
        offset = torch.zeros_like(offset)
    mask = torch.rand(batch, OFFSET_GROUPS * 6, 6, 7, dtype=DTYPE, generator=g)
    return [x, offset, mask] if with_mask else [x, offset]


def _cases() -> Dict[str, Callable]:
    def tv(bias: bool, with_mask: bool):
        return lambda: (torchvision.ops.DeformConv2d(6, 4, **GEOMETRY, bias=bias), _inputs(with_mask),
                        DeformConv2d, "torchvision")

    def pack(cls, ours, **kw):
        # Offsets of scale ~2 from conv_offset, so that sampling points cross the border and leave the image.
        def make():
            layer = _randomise(cls(6, 4, **GEOMETRY, deform_groups=OFFSET_GROUPS, **kw))
            with torch.no_grad():
                layer.conv_offset.weight.mul_(0.7)
            return layer, _inputs(False)[:1], ours, "mmcv"
        return make

    return {
        "torchvision": tv(True, True),
        "torchvision-no-bias-no-mask": tv(False, False),
        "mmcv-DeformConv2d": lambda: (MmcvDeformConv2d(6, 4, **GEOMETRY, deform_groups=OFFSET_GROUPS),
                                      _inputs(False), DeformConv2d, "mmcv"),
        "mmcv-ModulatedDeformConv2d": lambda: (MmcvModulatedDeformConv2d(6, 4, **GEOMETRY, deform_groups=3),
                                               _inputs(True), DeformConv2d, "mmcv"),
        "mmcv-ModulatedDeformConv2d-no-bias": lambda: (
            MmcvModulatedDeformConv2d(6, 4, **GEOMETRY, deform_groups=3, bias=False), _inputs(True),
            DeformConv2d, "mmcv"),
        "mmcv-DeformConv2dPack": pack(MmcvDeformConv2dPack, DeformConv2dPack, im2col_step=16),
        "mmcv-ModulatedDeformConv2dPack": pack(MmcvModulatedDeformConv2dPack, ModulatedDeformConv2dPack),
        "detectron2-DeformConv": lambda: (
            Detectron2DeformConvStandIn(6, 4, **GEOMETRY, deformable_groups=3, norm=nn.GroupNorm(2, 4),
                                        activation=F.relu), _inputs(False), Detectron2DeformConv, "mmcv"),
        "detectron2-ModulatedDeformConv": lambda: (
            Detectron2ModulatedDeformConvStandIn(6, 4, kernel_size=3, stride=2, padding=1, dilation=2, groups=2,
                                                 deformable_groups=3, norm=nn.BatchNorm2d(4).eval(),
                                                 activation=nn.LeakyReLU(0.1)),
            _inputs_square(), Detectron2DeformConv, "mmcv"),
    }


def _inputs_square() -> List[torch.Tensor]:
    """For kernel 3, stride 2, padding 1, dilation 2 on 13x8: output 6x3; 3 offset groups."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 13, 8, dtype=DTYPE, generator=g)
    offset = 2 * torch.randn(2, 2 * 3 * 9, 6, 3, dtype=DTYPE, generator=g)
    mask = torch.rand(2, 3 * 9, 6, 3, dtype=DTYPE, generator=g)
    return [x, offset, mask]


CASES = _cases()


def _outputs_and_grads(layer: nn.Module, inputs: List[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The output and the gradient of a fixed random projection of it with respect to every input and every
    trainable parameter (by name)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = layer(*leaves)
    params = {name: p for name, p in layer.named_parameters() if p.requires_grad}
    grad_output = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1)).to(out.device)
    grads = torch.autograd.grad(out, [*leaves, *params.values()], grad_output)
    names = ["input", "offset", "mask"][: len(leaves)] + [f"param {n}" for n in params]
    return {"output": out.detach(), **dict(zip(names, grads))}


def _assert_same(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _converted(layer: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known layer converts without a word
        return deform_conv.convert_modules(layer)


@pytest.mark.parametrize("name", CASES)
def test_same_numbers_parameters_and_state_dict_after_conversion(name):
    torch.manual_seed(0)
    layer, inputs, ours, border = CASES[name]()
    layer = _randomise(layer.to(DTYPE))
    before = _outputs_and_grads(layer, inputs)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    parameters = dict(layer.named_parameters())

    new = _converted(layer)
    assert type(new) is ours and new.border_gradient == border
    _assert_same(_outputs_and_grads(new, inputs), before)
    # The very same parameters (so an optimizer built before keeps working), under the same names.
    assert dict(new.named_parameters()).keys() == parameters.keys()
    assert all(p is parameters[n] for n, p in new.named_parameters())
    assert not any(t.is_meta for t in [*new.parameters(), *new.buffers()])
    assert new.state_dict().keys() == state.keys()
    new.load_state_dict(state)  # strict


@pytest.mark.parametrize("name", CASES)
def test_border_convention_follows_the_source(name):
    """Zero offsets with padding 1: the border taps sit exactly on y = -1 and x = -1, where torchvision's and
    mmcv's derivatives differ. Each converted layer must keep its source's, and flipping it must show."""
    layer, inputs, _, border = CASES[name]()
    layer = _randomise(layer.to(DTYPE))
    _set_padding(layer, 1)
    if len(inputs) > 1:
        inputs[1] = torch.zeros_like(inputs[1])
    if hasattr(layer, "conv_offset"):
        with torch.no_grad():
            layer.conv_offset.weight.zero_()
            layer.conv_offset.bias[: 2 * OFFSET_GROUPS * 6].zero_()  # offsets 0; the mask part may stay
    inputs = _resized_for_padding_1(layer, inputs)
    before = _outputs_and_grads(layer, inputs)

    new = _converted(layer)
    assert new.border_gradient == border
    _assert_same(_outputs_and_grads(new, inputs), before)

    new.border_gradient = "mmcv" if border == "torchvision" else "torchvision"
    flipped = _outputs_and_grads(new, inputs)
    torch.testing.assert_close(flipped["output"], before["output"], rtol=RTOL, atol=ATOL)
    wrt_offsets = "param conv_offset.weight" if hasattr(new, "conv_offset") else "offset"
    assert not torch.allclose(flipped[wrt_offsets], before[wrt_offsets], rtol=1e-3, atol=1e-3)


def _set_padding(layer: nn.Module, padding: int) -> None:
    layer.padding = padding if isinstance(layer.padding, int) else (padding, padding)
    if hasattr(layer, "conv_offset"):
        layer.conv_offset.padding = (padding, padding)


def _resized_for_padding_1(layer: nn.Module, inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    """Offset and mask of the output size that padding 1 gives."""
    x = inputs[0]
    kh, kw = layer.kernel_size
    (sh, sw), (dh, dw) = _pair(layer.stride), _pair(layer.dilation)
    out_h = (x.shape[2] + 2 - dh * (kh - 1) - 1) // sh + 1
    out_w = (x.shape[3] + 2 - dw * (kw - 1) - 1) // sw + 1
    resized = [x]
    g = torch.Generator().manual_seed(5)
    for t in inputs[1:]:
        shape = (t.shape[0], t.shape[1], out_h, out_w)
        is_offset = len(resized) == 1
        resized.append(torch.zeros(shape, dtype=DTYPE) if is_offset else torch.rand(shape, dtype=DTYPE, generator=g))
    return resized


def test_mmcv_offset_gradient_at_the_border_is_mmcvs_not_torchvisions():
    """The same case spelled out against torchvision's own op."""
    torch.manual_seed(0)
    layer = _randomise(MmcvModulatedDeformConv2d(4, 3, 3, padding=1).to(DTYPE))
    x = torch.randn(2, 4, 5, 6, dtype=DTYPE)
    offset, mask = torch.zeros(2, 18, 5, 6, dtype=DTYPE), torch.rand(2, 9, 5, 6, dtype=DTYPE)
    mmcv = _outputs_and_grads(layer, [x, offset, mask])
    ours = _outputs_and_grads(_converted(layer), [x, offset, mask])

    class Torchvision(nn.Module):
        def forward(self, x, offset, mask):
            return torchvision.ops.deform_conv2d(x, offset, layer.weight, layer.bias, padding=1, mask=mask)

    tv = _outputs_and_grads(Torchvision(), [x, offset, mask])
    torch.testing.assert_close(ours["offset"], mmcv["offset"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(tv["output"], mmcv["output"], rtol=RTOL, atol=ATOL)
    assert not torch.allclose(tv["offset"], mmcv["offset"], rtol=1e-3, atol=1e-3)


# --- models: nesting, sharing, modes, the top level ------------------------------------------------------------


class TorchvisionNet(nn.Module):
    """A DCNv2 block as torchvision users write it: a conv predicts offsets and mask for DeformConv2d."""

    def __init__(self):
        super().__init__()
        self.offset_mask = nn.Conv2d(6, 3 * OFFSET_GROUPS * 6, **{**GEOMETRY, "groups": 1})
        self.dcn = torchvision.ops.DeformConv2d(6, 4, **GEOMETRY)

    def forward(self, x):
        out = self.offset_mask(x)
        offset, mask = out[:, : 2 * OFFSET_GROUPS * 6], torch.sigmoid(out[:, 2 * OFFSET_GROUPS * 6:])
        return self.dcn(x, 4 * offset, mask)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(TorchvisionNet(), nn.ReLU())
        shared = MmcvModulatedDeformConv2dPack(4, 4, 3, padding=1, deform_groups=2)
        self.blocks = nn.ModuleList([shared, MmcvDeformConv2dPack(4, 4, 3, padding=1), shared])
        self.heads = nn.ModuleDict({"d2": Detectron2DeformConvStandIn(4, 5, 3, padding=1, norm=nn.GroupNorm(1, 5))})
        self.head_offset = nn.Conv2d(4, 18, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.heads["d2"](x, self.head_offset(x))


def test_nested_model_converted_in_place():
    torch.manual_seed(0)
    model = _randomise(Net().to(DTYPE), scale=0.3)
    model.stem[0].dcn.bias.requires_grad_(False)
    model.blocks[1].eval()
    x = torch.randn(2, 6, 13, 8, dtype=DTYPE)
    before = _outputs_and_grads(model, [x])
    state = copy.deepcopy(model.state_dict())

    assert _converted(model) is model
    assert type(model.stem[0].dcn) is DeformConv2d and model.stem[0].dcn.border_gradient == "torchvision"
    assert type(model.blocks[0]) is ModulatedDeformConv2dPack and model.blocks[0] is model.blocks[2]
    assert type(model.blocks[1]) is DeformConv2dPack and model.blocks[1].border_gradient == "mmcv"
    assert type(model.heads["d2"]) is Detectron2DeformConv
    assert isinstance(model.heads["d2"].norm, nn.GroupNorm)
    assert model.training and not model.blocks[1].training and model.blocks[0].training
    assert not model.stem[0].dcn.bias.requires_grad and model.stem[0].dcn.weight.requires_grad
    assert all(p.dtype == DTYPE for p in model.parameters())
    _assert_same(_outputs_and_grads(model, [x]), before)
    model.load_state_dict(state)  # strict: the same keys, norm.* included


def test_top_level_layer_returns_its_replacement():
    layer = torchvision.ops.DeformConv2d(4, 4, 3, padding=1)
    new = _converted(layer)
    assert type(new) is DeformConv2d and new.weight is layer.weight and new.bias is layer.bias
    assert _converted(new) is new  # ours already: nothing to do


def test_device_is_kept_without_allocating():
    with torch.device("meta"):  # no storage: the conversion neither copies nor moves a tensor
        model = nn.Sequential(MmcvModulatedDeformConv2dPack(4, 4, 3, padding=1), torchvision.ops.DeformConv2d(4, 4, 3))
    _converted(model)
    assert [type(m) for m in model] == [ModulatedDeformConv2dPack, DeformConv2d]
    assert all(t.is_meta for t in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_converted_on_the_gpu():
    torch.manual_seed(0)
    model = _randomise(TorchvisionNet(), scale=0.3).to("cuda", DTYPE)
    x = torch.randn(2, 6, 13, 8, dtype=DTYPE, device="cuda")
    before = _outputs_and_grads(model, [x])
    _converted(model)
    assert type(model.dcn) is DeformConv2d and model.dcn.weight.is_cuda
    _assert_same(_outputs_and_grads(model, [x]), before)


def test_model_without_deformable_layers_is_untouched():
    model = nn.Sequential(nn.Conv2d(3, 3, 3), nn.ReLU())
    assert _converted(model) is model
    assert [type(m) for m in model] == [nn.Conv2d, nn.ReLU]


def test_rejects_what_is_not_a_module():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got collections.OrderedDict"):
        deform_conv.convert_modules(nn.Conv2d(1, 1, 1).state_dict())


# --- detectron2: empty input, norm, activation -----------------------------------------------------------------


def test_detectron2_empty_input_skips_norm_and_keeps_the_graph():
    norm = nn.BatchNorm2d(4)
    layer = Detectron2ModulatedDeformConvStandIn(2, 4, 3, stride=2, padding=1, norm=norm, activation=F.relu)
    layer.to(DTYPE)
    x = torch.randn(0, 2, 9, 7, dtype=DTYPE, requires_grad=True)
    offset, mask = torch.zeros(0, 18, 5, 4, dtype=DTYPE), torch.zeros(0, 9, 5, 4, dtype=DTYPE)
    expected = layer(x, offset, mask)
    new = _converted(layer)
    assert new.norm is norm
    out = new(x, offset, mask)
    assert out.shape == expected.shape == (0, 4, 5, 4) and out.requires_grad
    assert norm.num_batches_tracked == 0
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert grad.shape == x.shape


def test_detectron2_layer_of_ours_mirrors_detectron2s_constructor():
    layer = Detectron2DeformConv(4, 6, 3, 1, 1, 1, 2, 2, True, nn.GroupNorm(2, 6), F.relu)
    assert layer.deformable_groups == 2 and layer.bias is not None and torch.count_nonzero(layer.bias) == 0
    assert set(layer.state_dict()) == {"weight", "bias", "norm.weight", "norm.bias"}
    assert "activation=relu" in repr(layer)
    with pytest.raises(ValueError, match=r"deformable_groups must be >= 1 and divide in_channels \(4\), got 3"):
        Detectron2DeformConv(4, 6, 3, deformable_groups=3)


# --- what is left alone ----------------------------------------------------------------------------------------


class MyDeformConv(torchvision.ops.DeformConv2d):
    """A subclass of a known layer defined elsewhere: its forward may differ, so it stays."""

    def forward(self, input, offset, mask=None):
        return 2 * super().forward(input, offset, mask)


class Renamed(torchvision.ops.DeformConv2d):
    pass


class ModulatedDCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4, 3, 3))


class DCNBlock(nn.Module):
    """Only a container: its layer is converted, and the block itself is no look-alike to warn about."""

    def __init__(self):
        super().__init__()
        self.conv = torchvision.ops.DeformConv2d(4, 4, 3, padding=1)


@_as_if_from("mmcv.ops.modulated_deform_conv", "ModulatedDeformConv2dPack_MLU")
class MmcvUnknownVariant(MmcvModulatedDeformConv2dPack):
    pass


def test_lookalikes_are_left_alone_with_one_warning_each():
    mine = MyDeformConv(4, 4, 3)
    model = nn.Sequential(mine, nn.Sequential(ModulatedDCN(), Renamed(4, 4, 3)), DCNBlock(),
                          MmcvUnknownVariant(4, 4, 3), mine)
    with pytest.warns(UserWarning) as record:
        assert deform_conv.convert_modules(model) is model
    unknown = ("not a layer convert_modules knows (torchvision's, mmcv's or detectron2's own classes, not "
               "subclasses defined elsewhere)")
    assert [str(w.message) for w in record] == [
        f"convert_modules: left '0' ({__name__}.MyDeformConv) unchanged: {unknown}",
        f"convert_modules: left '1.0' ({__name__}.ModulatedDCN) unchanged: {unknown}",
        f"convert_modules: left '1.1' ({__name__}.Renamed) unchanged: {unknown}",
        "convert_modules: left '3' (mmcv.ops.modulated_deform_conv.ModulatedDeformConv2dPack_MLU) unchanged: "
        + unknown,
    ]
    assert all(w.filename == __file__ for w in record)  # points at the caller
    assert model[0] is mine and model[4] is mine and type(model[1][1]) is Renamed
    assert type(model[3]) is MmcvUnknownVariant
    assert type(model[2]) is DCNBlock and type(model[2].conv) is DeformConv2d


def test_top_level_lookalike_is_named_as_the_model():
    layer = MyDeformConv(4, 4, 3)
    with pytest.warns(UserWarning, match=rf"left the model itself \({__name__}.MyDeformConv\) unchanged"):
        assert deform_conv.convert_modules(layer) is layer


def test_reparametrised_weight_is_left_alone():
    layer = torchvision.ops.DeformConv2d(4, 4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm's own deprecation notice
        nn.utils.weight_norm(layer)
    with pytest.warns(UserWarning, match=r"left the model itself \(torchvision.ops.deform_conv.DeformConv2d\) "
                                         r"unchanged: its parameters and buffers \{bias: \(4,\), weight_g: "):
        assert deform_conv.convert_modules(layer) is layer


def test_parametrized_layer_is_left_alone_with_a_warning():
    model = nn.Sequential(torchvision.ops.DeformConv2d(4, 4, 3, bias=False))
    nn.utils.parametrizations.weight_norm(model[0])
    with pytest.warns(UserWarning, match=r"left '0' \(.*ParametrizedDeformConv2d\) unchanged"):
        deform_conv.convert_modules(model)
    assert type(model[0]).__name__ == "ParametrizedDeformConv2d"


def test_configuration_without_an_equivalent_is_left_alone():
    layer = MmcvModulatedDeformConv2dPack(4, 4, 3)
    layer.deform_groups = 3  # mmcv does not check that it divides in_channels; our layers do
    with pytest.warns(UserWarning, match=r"left the model itself \(mmcv.ops.modulated_deform_conv."
                                         r"ModulatedDeformConv2dPack\) unchanged: its configuration has no "
                                         r"equivalent here \(in_channels \(4\) must be divisible by deform_groups"):
        assert deform_conv.convert_modules(layer) is layer
