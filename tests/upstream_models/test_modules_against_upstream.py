"""deform_conv.nn.DCNv3 / DCNv4 / FlashDeformAttn against unchanged copies of the upstream modules they replace
(upstream_models/, imported on our shims by conftest.py): the same state_dict keys (strict loads), the same
initialisation, and the same forward and gradients, in float64.

Tolerances:

- upstream modules running on our shims (InternImage's ``DCNv3`` on the ``DCNv3`` extension shim, DCNv4's modules
  on our ``DCNv4.functions``) compute the same op as ours, so they agree to float64 roundoff: 1e-12 of the largest
  entry.
- InternImage's ``DCNv3_pytorch`` (``dcnv3_core_pytorch``, grid_sample) builds its reference points and kernel grid
  in float32 whatever the input's dtype (``torch.linspace(..., dtype=torch.float32)``, then ``/ W_in``): its
  sampling points are off by up to ``pure_position_error`` pixels (measured there with upstream's own grid
  functions: about U32 * padded size, ~5e-7 px here), which moves its output by at most ``4 * error *
  max|value|`` (bilinear interpolation is Lipschitz with constant ``2 * max|value|`` along each axis, and the
  mask weights of a group sum to 1). That, through output_proj (``||W_out||_inf``), is the forward tolerance,
  a worst case: about 1e-5 of the output, the observed differences being ~5e-7. The gradients get twice the same
  relative bound (see test_dcnv3_matches_upstream_pure_pytorch).
- DCNv4's ``FlashDeformAttn`` rounds its sampling locations to float16 (``.half()``): the bound from that rounding
  is computed from the locations themselves; with ours given the same rounded locations the two agree to 1e-12.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import deform_conv
from deform_conv.nn import DCNv3, DCNv4, FlashDeformAttn, MSDeformAttn

pytestmark = [
    # Upstream's code as it is: torch.cuda.amp.custom_fwd/custom_bwd (deprecated), meshgrid without indexing=,
    # timm.models.layers (deprecated path), the power-of-2 advice of its constructors.
    pytest.mark.filterwarnings("ignore:`torch.cuda.amp.custom_:FutureWarning"),
    pytest.mark.filterwarnings("ignore:torch.meshgrid:UserWarning"),
    pytest.mark.filterwarnings("ignore:Importing from timm.models.layers:FutureWarning"),
    pytest.mark.filterwarnings("ignore:You'd better set:UserWarning"),
    pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning"),  # its docstring's \sum
    pytest.mark.filterwarnings("ignore:invalid escape sequence:SyntaxWarning"),  # the same, Python >= 3.12
]

F64 = torch.float64
U32 = 2.0 ** -24  # float32's unit roundoff
FLOAT64_FLOOR = 1e-10  # absolute floor: float64 roundoff of a gradient that is 0 by construction (BN's conv bias)


def _max_abs(tensor: torch.Tensor) -> float:
    return tensor.detach().abs().max().item() if tensor.numel() else 0.0


def assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = _max_abs(actual - expected)
    assert error <= tol, f"{what}: max |difference| {error:.3e} > tolerance {tol:.3e} (max |expected| " \
                         f"{_max_abs(expected):.3e})"


def forward_and_grads(module, inputs, parameters_of=None, grad_seed: int = 1):
    """module(*inputs) and the gradients of <output, R> (R fixed random) w.r.t. every input that requires grad
    (``input0``, ...), then every parameter of ``parameters_of`` (default: ``module``), by name."""
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    output = module(*inputs)
    weights = torch.randn(output.shape, dtype=output.dtype, generator=torch.Generator().manual_seed(grad_seed))
    leaves = {f"input{i}": x for i, x in enumerate(inputs) if x.requires_grad}
    leaves.update(dict((parameters_of if parameters_of is not None else module).named_parameters()))
    grads = torch.autograd.grad(output, list(leaves.values()), weights, allow_unused=True)
    grads = {name: (g if g is not None else torch.zeros_like(leaf))
             for (name, leaf), g in zip(leaves.items(), grads)}
    return output.detach(), grads


def randomize(module: nn.Module, prefixes, std: float, seed: int) -> None:
    """Small random values into the parameters whose names start with ``prefixes`` (upstream initialises the
    offset and mask projections to 0: every point on its grid place, which would hide errors)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.startswith(prefixes):
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * std)


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


# ------------------------------------------------------------------------------------------------------ DCNv3

DCNV3_CONFIGS = {
    "k3": dict(),
    "k5": dict(kernel_size=5, pad=2),
    "remove_center": dict(remove_center=True),
    "k5_remove_center": dict(kernel_size=5, pad=2, remove_center=True),
    "center_feature_scale": dict(center_feature_scale=True),
    "offset_scale2": dict(offset_scale=2.0),
    "bn_relu": dict(norm_layer="BN", act_layer="ReLU"),
    "ln_gelu_dw5": dict(norm_layer="LN", act_layer="GELU", dw_kernel_size=5),
    "dilation2": dict(dilation=2, pad=2),
}
DCNV3_RANDOM = ("offset.", "mask.", "center_feature_scale_proj")


def dcnv3_kwargs(config):
    kwargs = dict(channels=16, group=4, kernel_size=3, pad=1)
    kwargs.update(config)
    return kwargs


def pure_position_error(functions, height: int, width: int, kernel: int, dilation: int, pad: int,
                        offset_scale: float, stride: int = 1) -> float:
    """How far, at most, dcnv3_core_pytorch's sampling points lie from the exact ones, in input pixels.

    Upstream computes ``ref + grid * offset_scale`` in float32 (its ``_get_reference_points`` and
    ``_generate_dilation_grids`` use ``torch.linspace(..., dtype=torch.float32)`` and divide by the padded size),
    adds the float64 ``offset * offset_scale / spatial_norm`` and grid_sample (align_corners=False) samples pixel
    ``location * size - 0.5``. Measured here with upstream's own two functions: the exact points (before the
    offsets) lie on the half-pixel lattice (c + 0.5 - 0.5 + grid * offset_scale, offset_scale a multiple of 0.5),
    so the distance to it is the float32 error (about U32 * padded size: ~5e-7 px for 10 px). 1e-12 more for the
    float64 steps."""
    shape = (1, height + 2 * pad, width + 2 * pad, 1)
    ref = functions._get_reference_points(shape, "cpu", kernel, kernel, dilation, dilation, pad, pad, stride, stride)
    grid = functions._generate_dilation_grids(shape, kernel, kernel, dilation, dilation, 1, "cpu")
    assert ref.dtype == grid.dtype == torch.float32
    points = (ref + grid * offset_scale).to(F64)  # as upstream, in float32
    pixels = points * torch.tensor([shape[2], shape[1]], dtype=F64) - 0.5
    error = (pixels - (2 * pixels).round() / 2).abs().max().item()
    assert error < 1e-3 and 2 * offset_scale == round(2 * offset_scale)
    return error + 1e-12


def _dcnv3_pair(upstream_dcnv3, config, upstream_class="DCNv3_pytorch", seed=0):
    kwargs = dcnv3_kwargs(config)
    torch.manual_seed(seed)
    upstream = getattr(upstream_dcnv3, upstream_class)(**kwargs).to(F64)
    randomize(upstream, DCNV3_RANDOM, std=0.3, seed=seed + 1)
    ours = DCNv3(**kwargs).to(F64)
    ours.load_state_dict(upstream.state_dict(), strict=True)
    return upstream, ours, kwargs


@pytest.mark.parametrize("config", DCNV3_CONFIGS.values(), ids=DCNV3_CONFIGS.keys())
def test_dcnv3_same_keys_and_init(upstream_dcnv3, config):
    """Same state_dict keys, shapes and dtypes, and the same values after the same seed (the constructors draw
    from the RNG in the same order); _reset_parameters gives both the same values again."""
    kwargs = dcnv3_kwargs(config)
    for upstream_class in ("DCNv3_pytorch", "DCNv3"):
        torch.manual_seed(123)
        upstream = getattr(upstream_dcnv3, upstream_class)(**kwargs)
        torch.manual_seed(123)
        ours = DCNv3(**kwargs)
        assert_same_state(upstream, ours)
        randomize(upstream, ("",), std=1.0, seed=5)
        randomize(ours, ("",), std=1.0, seed=6)
        torch.manual_seed(7)
        upstream._reset_parameters()
        torch.manual_seed(7)
        ours._reset_parameters()
        # _reset_parameters covers offset, mask and both projections; the rest keeps the values randomize put.
        reset = ("offset.", "mask.", "input_proj.", "output_proj.")
        for (name, a), (_, b) in zip(upstream.state_dict().items(), ours.state_dict().items()):
            if name.startswith(reset):
                assert torch.equal(a, b), name


@pytest.mark.parametrize("config", DCNV3_CONFIGS.values(), ids=DCNV3_CONFIGS.keys())
def test_dcnv3_matches_upstream_pure_pytorch(upstream_dcnv3, upstream_dcnv3_functions, config):
    """InternImage's DCNv3_pytorch (dcnv3_core_pytorch, grid_sample) vs ours: forward and every gradient within
    the pure path's own float32-grid accuracy."""
    upstream, ours, kwargs = _dcnv3_pair(upstream_dcnv3, config)
    height, width = 8, 7
    delta = pure_position_error(upstream_dcnv3_functions, height, width, kwargs["kernel_size"],
                                kwargs.get("dilation", 1), kwargs["pad"], kwargs.get("offset_scale", 1.0))
    # The gradients w.r.t. the offsets use the bilinear weights' derivatives, which jump where a point crosses a
    # pixel line: the bound holds where no point lies within delta of one. The points are p0 + (grid + offset) *
    # offset_scale with p0 and grid integers, so their distance to the lines is that of offset * offset_scale: the
    # input is the first of a fixed sequence of random ones for which every point is further than delta.
    assert float(kwargs.get("offset_scale", 1.0)).is_integer()  # grid * offset_scale on integers
    for seed in range(3, 23):
        x = torch.randn(2, height, width, 16, dtype=F64, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            offsets = copy.deepcopy(ours).offset(copy.deepcopy(ours.dw_conv)(x.permute(0, 3, 1, 2)))
            offsets = offsets * ours.offset_scale
        if (offsets - offsets.round()).abs().min().item() > delta:
            break
    else:
        raise AssertionError("no input of the sequence keeps every point away from the pixel lines")
    x.requires_grad_()

    y_up, g_up = forward_and_grads(upstream, [x])
    y_ours, g_ours = forward_and_grads(ours, [x])
    with torch.no_grad():
        value = ours.input_proj(x)
    w_out = ours.output_proj.weight.abs().sum(1).max().item()  # ||W_out||_inf
    # 4 * delta * max|value|: the op's output; (1 - scale) <= 1 for the centre feature scale; then output_proj.
    tol = 4 * delta * _max_abs(value) * w_out
    assert_within(y_ours, y_up, tol, "output")
    # The backward applies the transposes of the same bilinear weights and their derivatives w.r.t. the point,
    # each moved by at most 2 * delta per unit by the same position error: twice the forward's relative bound,
    # norm-wise (relative to the largest entry of each gradient).
    relative = 2 * 4 * delta * w_out
    assert set(g_up) == set(g_ours)
    for name in g_up:
        assert_within(g_ours[name], g_up[name], relative * _max_abs(g_up[name]) + FLOAT64_FLOOR, f"grad {name}")


@pytest.mark.parametrize("config", DCNV3_CONFIGS.values(), ids=DCNV3_CONFIGS.keys())
def test_dcnv3_matches_upstream_on_extension_shim(upstream_dcnv3, config):
    """InternImage's DCNv3 module (DCNv3Function -> our DCNv3.dcnv3_forward/backward) vs ours: float64 roundoff."""
    upstream, ours, _ = _dcnv3_pair(upstream_dcnv3, config, upstream_class="DCNv3")
    x = torch.randn(2, 6, 9, 16, dtype=F64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    y_up, g_up = forward_and_grads(upstream, [x])
    y_ours, g_ours = forward_and_grads(ours, [x])
    assert_within(y_ours, y_up, 1e-12 * _max_abs(y_up), "output")
    for name in g_up:
        assert_within(g_ours[name], g_up[name], 1e-12 * _max_abs(g_up[name]) + 1e-14, f"grad {name}")


def test_dcnv3_core_pytorch_against_ours_op(upstream_dcnv3_functions):
    """The op alone: upstream's dcnv3_core_pytorch vs deform_conv.dcnv3 on random offsets (stride 2 too, which
    the module cannot use), within the position-error bound (4 * delta * max|input|, the mask summing to 1)."""
    generator = torch.Generator().manual_seed(11)
    for kernel, stride, pad, dilation, scale, remove_center in [(3, 1, 1, 1, 1.0, False), (3, 2, 1, 1, 1.0, True),
                                                                (5, 1, 2, 1, 0.5, False), (3, 1, 2, 2, 1.0, False)]:
        group, group_channels, height, width = 2, 4, 9, 7
        points = kernel * kernel - int(remove_center)
        out_h = (height + 2 * pad - (dilation * (kernel - 1) + 1)) // stride + 1
        out_w = (width + 2 * pad - (dilation * (kernel - 1) + 1)) // stride + 1
        x = torch.randn(2, height, width, group * group_channels, dtype=F64, generator=generator)
        offset = torch.randn(2, out_h, out_w, group * points * 2, dtype=F64, generator=generator) * 0.7
        mask = torch.randn(2, out_h, out_w, group, points, dtype=F64, generator=generator).softmax(-1).flatten(-2)
        expected = upstream_dcnv3_functions.dcnv3_core_pytorch(
            x, offset, mask, kernel, kernel, stride, stride, pad, pad, dilation, dilation, group, group_channels,
            scale, int(remove_center))
        actual = deform_conv.dcnv3(x, offset, mask, kernel, stride, pad, dilation, group, scale, remove_center)
        delta = pure_position_error(upstream_dcnv3_functions, height, width, kernel, dilation, pad, scale, stride)
        assert_within(actual, expected, 4 * delta * _max_abs(x), f"dcnv3 k{kernel} s{stride} p{pad} d{dilation}")


# ------------------------------------------------------------------------------------------------------ DCNv4

DCNV4_CONFIGS = {
    "default": dict(),
    "without_pointwise": dict(without_pointwise=True),
    "dw3": dict(dw_kernel_size=3),
    "dw3_without_pointwise": dict(dw_kernel_size=3, without_pointwise=True),
    "center_feature_scale": dict(center_feature_scale=True),
    "no_output_bias": dict(output_bias=False),
    "remove_center_offset_scale": dict(remove_center=True, offset_scale=1.5),
    "k5": dict(kernel_size=5, pad=2, dw_kernel_size=3, center_feature_scale=True),
}
DCNV4_RANDOM = ("offset_mask.", "center_feature_scale_proj")


def dcnv4_kwargs(config, channels=32, group=2):
    kwargs = dict(channels=channels, group=group)
    kwargs.update(config)
    return kwargs


@pytest.mark.parametrize("config", DCNV4_CONFIGS.values(), ids=DCNV4_CONFIGS.keys())
def test_dcnv4_matches_upstream(upstream_dcnv4, config):
    """The DCNv4 repository's DCNv4 module (on our DCNv4Function) vs ours: same keys (strict load), same init
    after the same seed, forward and gradients to float64 roundoff; a square input (shape=None) and H != W
    (shape given)."""
    kwargs = dcnv4_kwargs(config)
    torch.manual_seed(0)
    upstream = upstream_dcnv4.DCNv4(**kwargs)
    torch.manual_seed(0)
    ours = DCNv4(**kwargs)
    assert_same_state(upstream, ours)
    upstream, ours = upstream.to(F64), ours.to(F64)
    randomize(upstream, DCNV4_RANDOM, std=0.3, seed=2)
    ours.load_state_dict(upstream.state_dict(), strict=True)
    generator = torch.Generator().manual_seed(5)
    for shape in (None, (5, 9)):
        length = 36 if shape is None else shape[0] * shape[1]
        x = torch.randn(2, length, 32, dtype=F64, generator=generator).requires_grad_()
        y_up, g_up = forward_and_grads(lambda t: upstream(t, shape), [x], upstream)
        y_ours, g_ours = forward_and_grads(lambda t: ours(t, shape), [x], ours)
        assert_within(y_ours, y_up, 1e-12 * _max_abs(y_up), f"output (shape {shape})")
        assert set(g_up) == set(g_ours)
        for name in g_up:
            assert_within(g_ours[name], g_up[name], 1e-12 * _max_abs(g_up[name]) + 1e-14,
                          f"grad {name} (shape {shape})")


@pytest.mark.parametrize("config", [dict(), dict(dw_kernel_size=3, center_feature_scale=True),
                                    dict(without_pointwise=True, remove_center=True)],
                         ids=["default", "dw3_cfs", "without_pointwise_remove_center"])
def test_dcnv4_group_channels_not_multiple_of_16(upstream_dcnv4, config):
    """8 channels a group: upstream's constructor asserts `_d_per_group % 16 == 0`, so upstream's module cannot be
    built. Ours is checked against upstream's math two other ways: (1) upstream's unchanged forward, run on a
    module object that skips its __init__ and holds our module's submodules and attributes; (2) deform_conv.dcnv3
    through the functional API -- DCNv4 is DCNv3 without the softmax, each group's offset_mask block (3K
    channels, as the DCNv4 CUDA kernel reads it) holding its 2K offsets then its K mask values."""
    kwargs = dcnv4_kwargs(config, channels=24, group=3)
    with pytest.raises(AssertionError):
        upstream_dcnv4.DCNv4(**kwargs)
    ours = DCNv4(**kwargs).to(F64)
    randomize(ours, DCNV4_RANDOM, std=0.3, seed=3)
    x = torch.randn(2, 49, 24, dtype=F64, generator=torch.Generator().manual_seed(8)).requires_grad_()
    y_ours, g_ours = forward_and_grads(ours, [x])

    # (1) Upstream's forward on our module's state.
    upstream_class = upstream_dcnv4.DCNv4
    upstream = upstream_class.__new__(upstream_class)
    upstream.__dict__.update(copy.deepcopy(ours).__dict__)
    if ours.center_feature_scale:
        upstream.center_feature_scale_module = upstream_dcnv4.dcnv4.CenterFeatureScaleModule()
    y_up, g_up = forward_and_grads(upstream, [x])
    assert_within(y_ours, y_up, 1e-12 * _max_abs(y_up), "output vs upstream forward")
    for name in g_up:
        assert_within(g_ours[name], g_up[name], 1e-12 * _max_abs(g_up[name]) + 1e-14, f"grad {name}")

    # (2) The same through deform_conv.dcnv3.
    def through_dcnv3(t):
        batch, length, channels = t.shape
        side = int(math.isqrt(length))
        value = t if ours.without_pointwise else ours.value_proj(t)
        value = value.reshape(batch, side, side, channels)
        source = t
        if ours.dw_kernel_size is not None:
            source = ours.offset_mask_dw(t.view(batch, side, side, channels).permute(0, 3, 1, 2))
            source = source.permute(0, 2, 3, 1).reshape(batch, length, channels)
        points = ours.kernel_size ** 2 - ours.remove_center
        blocks = ours.offset_mask(source).reshape(batch, side, side, -1)[..., : ours.group * 3 * points]
        blocks = blocks.unflatten(-1, (ours.group, 3 * points))
        offset = blocks[..., : 2 * points].flatten(-2)
        mask = blocks[..., 2 * points:].flatten(-2)
        out = deform_conv.dcnv3(value, offset, mask, ours.kernel_size, ours.stride, ours.pad, ours.dilation,
                                ours.group, ours.offset_scale, bool(ours.remove_center))
        if ours.center_feature_scale:
            scale = nn.functional.linear(out, ours.center_feature_scale_proj_weight,
                                         ours.center_feature_scale_proj_bias).sigmoid()
            scale = scale[..., None].repeat(1, 1, 1, 1, channels // ours.group).flatten(-2)
            out = out * (1 - scale) + value * scale
        out = out.reshape(batch, length, -1)
        return out if ours.without_pointwise else ours.output_proj(out)

    y_ref = through_dcnv3(x)
    assert_within(y_ours, y_ref, 1e-12 * _max_abs(y_ref), "output vs dcnv3")


# --------------------------------------------------------------------------------------------- FlashDeformAttn

def _msda_inputs(d_model=32, levels=2, queries=7, batch=2, boxes=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = torch.tensor([[6, 5], [3, 4]][:levels], dtype=torch.long)
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
    pixels = int((shapes[:, 0] * shapes[:, 1]).sum())
    query = torch.randn(batch, queries, d_model, dtype=F64, generator=generator)
    if boxes:
        reference = torch.cat([torch.rand(batch, queries, levels, 2, dtype=F64, generator=generator),
                               0.2 + 0.5 * torch.rand(batch, queries, levels, 2, dtype=F64, generator=generator)], -1)
    else:
        reference = torch.rand(batch, queries, levels, 2, dtype=F64, generator=generator)
    flatten = torch.randn(batch, pixels, d_model, dtype=F64, generator=generator)
    return query, reference, flatten, shapes, starts


FLASH_RANDOM = ("sampling_offsets.", "attention_weights.")


def _flash_pair(upstream_dcnv4, seed=0, **kwargs):
    torch.manual_seed(seed)
    upstream = upstream_dcnv4.FlashDeformAttn(**kwargs)
    torch.manual_seed(seed)
    ours = FlashDeformAttn(**kwargs)
    assert_same_state(upstream, ours)
    upstream, ours = upstream.to(F64), ours.to(F64)
    randomize(upstream, FLASH_RANDOM, std=0.4, seed=seed + 1)
    ours.load_state_dict(upstream.state_dict(), strict=True)
    return upstream, ours


class _HalfLocations:
    """Our FlashDeformAttn with its sampling locations rounded to float16 and back, as upstream's `.half()`
    (forward, and its gradient through the same two casts)."""

    def __init__(self, module):
        self.module = module
        self.original = module._locations

    def __enter__(self):
        original = self.original
        self.module._locations = lambda *args: (lambda loc: loc.half().to(loc.dtype))(original(*args))
        return self.module

    def __exit__(self, *exc):
        del self.module._locations


@pytest.mark.parametrize("boxes", [False, True], ids=["points", "boxes"])
def test_flash_deform_attn_matches_upstream(upstream_dcnv4, boxes):
    """The DCNv4 repository's FlashDeformAttn (on our FlashDeformAttnFunction) vs ours: same keys and init (checked
    in _flash_pair); ours given the locations rounded to float16 as upstream equals it to float64 roundoff (forward
    and gradients); ours as it is (float32/64 locations) within the bound of that rounding."""
    upstream, ours = _flash_pair(upstream_dcnv4, d_model=32, n_levels=2, n_heads=4, n_points=3)
    inputs = list(_msda_inputs(boxes=boxes, seed=1))
    for i in (0, 1, 2):
        inputs[i].requires_grad_()
    y_up, g_up = forward_and_grads(upstream, inputs)
    with _HalfLocations(ours):
        y_half, g_half = forward_and_grads(ours, inputs)
    assert_within(y_half, y_up, 1e-12 * _max_abs(y_up), "output (half locations)")
    assert set(g_up) == set(g_half)
    for name in g_up:
        assert_within(g_half[name], g_up[name], 1e-12 * _max_abs(g_up[name]) + 1e-14, f"grad {name}")

    # Without the rounding: bilinear sampling is Lipschitz with constant 2 max|value| along each axis (in pixels),
    # the attention weights of a head sum to 1, so |difference| <= 2 max|value| max(W_l |du_x| + H_l |du_y|),
    # du the rounding of each location, then output_proj (||W_out||_inf).
    y_ours, _ = forward_and_grads(ours, inputs)
    query, reference, flatten, shapes, _ = inputs
    with torch.no_grad():
        offsets = ours.sampling_offsets(query).view(2, 7, 4, 2, 3, 2)
        locations = ours._locations(reference, offsets, shapes)  # [N, Lq, M, L, P, 2]
        rounding = (locations.half().to(F64) - locations).abs()
        size = torch.stack([shapes[:, 1], shapes[:, 0]], -1).to(F64)  # (W_l, H_l)
        pixels = (rounding * size[None, None, None, :, None, :]).sum(-1).max().item()
        value = ours.value_proj(flatten)
    w_out = ours.output_proj.weight.abs().sum(1).max().item()
    tol = 2 * _max_abs(value) * pixels * w_out
    assert pixels > 0
    assert_within(y_ours, y_up, tol, "output (ours unrounded vs upstream's float16 locations)")


def test_flash_deform_attn_is_ms_deform_attn_with_fused_softmax():
    """Ours equals deform_conv.nn.MSDeformAttn with the same weights (FlashDeformAttn is MSDeformAttn whose
    softmax runs in the op), forward and gradients to float64 roundoff; padding mask too."""
    torch.manual_seed(0)
    flash = FlashDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=3).to(F64)
    randomize(flash, FLASH_RANDOM, std=0.4, seed=9)
    msda = MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=3).to(F64)
    msda.load_state_dict(flash.state_dict(), strict=True)
    for boxes in (False, True):
        inputs = list(_msda_inputs(boxes=boxes, seed=4))
        for i in (0, 1, 2):
            inputs[i].requires_grad_()
        mask = torch.zeros(2, inputs[2].shape[1], dtype=torch.bool)
        mask[1, -5:] = True
        y_msda, g_msda = forward_and_grads(lambda *a: msda(*a, mask), inputs, msda)
        y_flash, g_flash = forward_and_grads(lambda *a: flash(*a, mask), inputs, flash)
        assert_within(y_flash, y_msda, 1e-12 * _max_abs(y_msda), "output")
        assert set(g_flash) == set(g_msda)
        for name in g_msda:
            assert_within(g_flash[name], g_msda[name], 1e-12 * _max_abs(g_msda[name]) + 1e-14, f"grad {name}")


# ------------------------------------------------------------------------------------------ InternImage model

def _tiny_intern_image(module, core_op, seed=0):
    torch.manual_seed(seed)
    return module.InternImage(core_op=core_op, channels=16, depths=[1, 1, 1, 1], groups=[1, 2, 2, 4],
                              num_classes=10, drop_path_rate=0.0, center_feature_scale=False)


def _model_pure_bound(model, functions) -> float:
    """The sum over the model's DCNv3 layers of their relative position-error bounds, 4 delta ||W_out||_inf."""
    total, size = 0.0, 8  # the stem divides 32 x 32 by 4; each level after halves it
    for level in model.levels:
        for block in level.blocks:
            dcn = block.dcn
            delta = pure_position_error(functions, size, size, dcn.kernel_size, dcn.dilation, dcn.pad,
                                        dcn.offset_scale)
            total += 4 * delta * dcn.output_proj.weight.abs().sum(1).max().item()
        size = max(size // 2, 1)
    return total


def test_intern_image_model_on_shim_vs_upstream(intern_image_models, upstream_dcnv3_functions, capsys):
    """InternImage's unchanged classification model, tiny (channels 16, depths [1, 1, 1, 1], 32 x 32), float64:
    built with core_op='DCNv3' on our shim (deform_conv.nn.DCNv3) it has the same state_dict as the same file
    built on upstream's ops_dcnv3 (same seed: its _init_weights and _init_deform_weights call our
    _reset_parameters); with the offsets and masks randomised, forward and backward equal upstream's DCNv3
    (on our extension shim) to roundoff, in training mode, and upstream's DCNv3_pytorch within the pure path's
    accuracy, in eval mode."""
    ours = _tiny_intern_image(intern_image_models.ours, "DCNv3")
    upstream_ext = _tiny_intern_image(intern_image_models.upstream, "DCNv3")
    upstream_pure = _tiny_intern_image(intern_image_models.upstream, "DCNv3_pytorch")
    capsys.readouterr()  # the constructor's prints
    assert all(type(block.dcn) is DCNv3 for level in ours.levels for block in level.blocks)
    assert all(type(block.dcn).__name__ == "DCNv3_pytorch" for level in upstream_pure.levels
               for block in level.blocks)
    assert_same_state(upstream_ext, ours)
    assert_same_state(upstream_pure, ours)

    ours, upstream_ext, upstream_pure = ours.to(F64), upstream_ext.to(F64), upstream_pure.to(F64)
    randomize(upstream_pure, tuple(f"levels.{i}.blocks.0.dcn.{p}" for i in range(4) for p in ("offset.", "mask.")),
              std=0.3, seed=1)
    ours.load_state_dict(upstream_pure.state_dict(), strict=True)
    upstream_ext.load_state_dict(upstream_pure.state_dict(), strict=True)
    image = torch.randn(2, 3, 32, 32, dtype=F64, generator=torch.Generator().manual_seed(2)).requires_grad_()

    # Against the pure path in eval mode: in training mode conv_head's BatchNorm normalises 2 samples (1 x 1 after
    # the last level), which leaves the logits nearly independent of the features, and some gradients 0 by
    # construction, so relative comparisons there measure roundoff. Each DCNv3 layer's output moves by at most its
    # bound (4 delta max|value| ||W_out||_inf, relative to its value); the layers' relative errors add, through
    # layers of gain about 1 in eval mode (LayerNorms of O(1) activations, trunc_normal(0.02) weights, residuals,
    # BatchNorm with unit running statistics): their sum is the tolerance (the per-layer bounds are worst-case:
    # the observed errors are ~100 times smaller).
    # (First: the training-mode forward below updates the BatchNorms' running statistics.)
    ours.eval()
    upstream_pure.eval()
    y_ours, g_ours = forward_and_grads(ours, [image])
    y_pure, g_pure = forward_and_grads(upstream_pure, [image])
    relative = _model_pure_bound(ours, upstream_dcnv3_functions)
    assert_within(y_ours, y_pure, relative * _max_abs(y_pure), "logits vs upstream DCNv3_pytorch")
    for name in g_pure:
        assert_within(g_ours[name], g_pure[name], 2 * relative * _max_abs(g_pure[name]) + FLOAT64_FLOOR,
                      f"grad {name} vs DCNv3_pytorch")

    # Training mode, against upstream's DCNv3 on the extension shim: the same op, so float64 roundoff.
    ours.train()
    y_ours, g_ours = forward_and_grads(ours, [image])
    y_ext, g_ext = forward_and_grads(upstream_ext, [image])
    assert_within(y_ours, y_ext, 1e-12 * _max_abs(y_ext), "logits vs upstream DCNv3 on the shim")
    for name in g_ext:
        assert_within(g_ours[name], g_ext[name], 1e-12 * _max_abs(g_ext[name]) + 1e-14, f"grad {name}")
