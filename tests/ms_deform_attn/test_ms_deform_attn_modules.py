"""Deformable DETR's MSDeformAttn module (deform_conv.MSDeformAttn) and its compiled extension's Python face
(deform_conv.compat.install_multiscale_deformable_attention), against Deformable DETR's definitions
(fundamentalvision/Deformable-DETR, models/ops/modules/ms_deform_attn.py and models/ops/functions/
ms_deform_attn_func.py) computed with the pure-PyTorch reference op."""

from __future__ import annotations

import importlib.util
import math
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch.autograd.function import once_differentiable

import deform_conv
from deform_conv import MSDeformAttn, ms_deform_attn_reference
from deform_conv.compat import MSDA_MODULE_NAME, install_multiscale_deformable_attention

from helpers.common import TOLERANCES

# Levels that are not square (so that swapping H and W shows) and of different sizes: S = 35 + 6 + 8 = 49.
SHAPES = [(5, 7), (3, 2), (2, 4)]
D_MODEL, N_HEADS, N_LEVELS, N_POINTS = 16, 2, 3, 3


def level_tensors():
    shapes = torch.tensor(SHAPES, dtype=torch.long)  # [L, 2] (H, W)
    starts = torch.cat((shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]))  # [L]
    return shapes, starts


def make_module(seed: int = 0) -> MSDeformAttn:
    """A float64 module whose offsets and attention logits depend on the query (at initialisation their weights are
    zero), so that every parameter matters."""
    torch.manual_seed(seed)
    module = MSDeformAttn(D_MODEL, N_LEVELS, N_HEADS, N_POINTS).double()
    with torch.no_grad():
        module.sampling_offsets.weight.normal_(std=0.5)
        module.attention_weights.weight.normal_(std=0.5)
        module.attention_weights.bias.normal_()
        module.value_proj.bias.normal_()
        module.output_proj.bias.normal_()
    return module


def make_inputs(coordinates: int, batch: int = 2, queries: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    pixels = sum(h * w for h, w in SHAPES)
    query = torch.randn(batch, queries, D_MODEL, dtype=torch.float64, generator=g)
    input_flatten = torch.randn(batch, pixels, D_MODEL, dtype=torch.float64, generator=g)
    centres = torch.rand(batch, queries, N_LEVELS, 2, dtype=torch.float64, generator=g)
    if coordinates == 2:
        reference_points = centres
    else:
        sizes = 0.1 + 0.5 * torch.rand(batch, queries, N_LEVELS, 2, dtype=torch.float64, generator=g)
        reference_points = torch.cat((centres, sizes), -1)  # (cx, cy, w, h)
    return query, reference_points, input_flatten


def deformable_detr_forward(module, query, reference_points, input_flatten, shapes, starts, padding_mask=None):
    """Deformable DETR's MSDeformAttn.forward, step by step as in its source, with the reference op in place of its
    CUDA function and the module's parameters."""
    batch, queries, _ = query.shape
    pixels = input_flatten.shape[1]
    heads, levels, points = module.n_heads, module.n_levels, module.n_points
    value = F.linear(input_flatten, module.value_proj.weight, module.value_proj.bias)
    if padding_mask is not None:
        value = value.masked_fill(padding_mask[..., None], float(0))
    value = value.view(batch, pixels, heads, module.d_model // heads)
    offsets = F.linear(query, module.sampling_offsets.weight, module.sampling_offsets.bias)
    offsets = offsets.view(batch, queries, heads, levels, points, 2)
    weights = F.linear(query, module.attention_weights.weight, module.attention_weights.bias)
    weights = F.softmax(weights.view(batch, queries, heads, levels * points), -1)
    weights = weights.view(batch, queries, heads, levels, points)
    if reference_points.shape[-1] == 2:
        normalizer = torch.stack([shapes[..., 1], shapes[..., 0]], -1)
        locations = reference_points[:, :, None, :, None, :] + offsets / normalizer[None, None, None, :, None, :]
    else:
        locations = (reference_points[:, :, None, :, None, :2]
                     + offsets / points * reference_points[:, :, None, :, None, 2:] * 0.5)
    output = ms_deform_attn_reference(value, shapes, starts, locations, weights)
    return F.linear(output, module.output_proj.weight, module.output_proj.bias)


def outputs_and_grads(fn, module, tensors):
    """fn(*tensors) and its gradients w.r.t. the tensors and every parameter of the module, for a fixed random
    grad_output."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    grad_output = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
    params = list(module.parameters())
    grads = torch.autograd.grad(out, leaves + params, grad_output)
    return [out.detach(), *grads]


def assert_same(actual, expected, names):
    rtol, atol = TOLERANCES[torch.float64]
    assert len(actual) == len(expected) == len(names)
    for name, a, e in zip(names, actual, expected):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# --- the module's parameters and initialisation ------------------------------------------------------------------


def test_parameters_and_state_dict_are_deformable_detrs():
    d_model, levels, heads, points = 64, 3, 4, 5
    module = MSDeformAttn(d_model, levels, heads, points)
    # Deformable DETR's __init__: four nn.Linear(d_model, ...) with bias, in this order.
    expected = {
        "sampling_offsets.weight": (heads * levels * points * 2, d_model),
        "sampling_offsets.bias": (heads * levels * points * 2,),
        "attention_weights.weight": (heads * levels * points, d_model),
        "attention_weights.bias": (heads * levels * points,),
        "value_proj.weight": (d_model, d_model),
        "value_proj.bias": (d_model,),
        "output_proj.weight": (d_model, d_model),
        "output_proj.bias": (d_model,),
    }
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == expected
    assert list(module.state_dict()) == list(expected)
    assert (module.d_model, module.n_levels, module.n_heads, module.n_points) == (d_model, levels, heads, points)
    assert module.im2col_step == 64
    defaults = MSDeformAttn()
    assert (defaults.d_model, defaults.n_levels, defaults.n_heads, defaults.n_points) == (256, 4, 8, 4)


def test_a_deformable_detr_checkpoint_loads():
    source = MSDeformAttn(32, 2, 4, 2)
    target = MSDeformAttn(32, 2, 4, 2)
    state = {k: torch.randn_like(v) for k, v in source.state_dict().items()}
    target.load_state_dict(state)  # strict: the same keys and shapes
    for k, v in target.state_dict().items():
        assert torch.equal(v, state[k])


def deformable_detr_grid_init(heads: int, levels: int, points: int) -> torch.Tensor:
    """Deformable DETR's _reset_parameters for sampling_offsets.bias, as written there."""
    thetas = torch.arange(heads, dtype=torch.float32) * (2.0 * math.pi / heads)
    grid_init = torch.stack([thetas.cos(), thetas.sin()], -1)
    grid_init = (grid_init / grid_init.abs().max(-1, keepdim=True)[0]).view(heads, 1, 1, 2).repeat(1, levels, points, 1)
    for i in range(points):
        grid_init[:, :, i, :] *= i + 1
    return grid_init.view(-1)


@pytest.mark.parametrize("heads, levels, points", [(8, 4, 4), (3, 2, 5), (1, 1, 1)])
def test_initialisation_is_deformable_detrs(heads, levels, points):
    d_model = 8 * heads
    module = MSDeformAttn(d_model, levels, heads, points)
    assert torch.count_nonzero(module.sampling_offsets.weight) == 0
    assert torch.equal(module.sampling_offsets.bias.detach(), deformable_detr_grid_init(heads, levels, points))
    # What that recipe means: head m's points lie along the direction at angle 2*pi*m/M, point p at distance p + 1
    # in the max norm, the same in every level.
    bias = module.sampling_offsets.bias.detach().view(heads, levels, points, 2)
    distance = bias.abs().amax(-1)  # [M, L, P]
    torch.testing.assert_close(distance, torch.arange(1.0, points + 1).expand(heads, levels, points))
    angles = torch.atan2(bias[..., 1], bias[..., 0]).remainder(2 * math.pi)
    expected_angles = (torch.arange(heads) * 2 * math.pi / heads).view(heads, 1, 1).expand_as(angles).float()
    torch.testing.assert_close(torch.cos(angles - expected_angles), torch.ones_like(angles))
    # Uniform attention at the start, projections Xavier-uniform with zero biases.
    assert torch.count_nonzero(module.attention_weights.weight) == 0
    assert torch.count_nonzero(module.attention_weights.bias) == 0
    xavier_bound = math.sqrt(6.0 / (d_model + d_model))
    for linear in (module.value_proj, module.output_proj):
        assert torch.count_nonzero(linear.bias) == 0
        assert linear.weight.abs().max() <= xavier_bound
        assert linear.weight.std() > 0.5 * xavier_bound / math.sqrt(3)  # U(-b, b) has std b / sqrt(3): not zeros


def test_initialisation_keeps_the_parameter_objects():
    """Re-initialising copies into the parameters (Deformable DETR replaces sampling_offsets.bias by a new one):
    an optimizer built before, and the module's device and dtype, stay valid."""
    module = MSDeformAttn(16, 2, 2, 2).double()
    bias = module.sampling_offsets.bias
    module._reset_parameters()
    assert module.sampling_offsets.bias is bias and bias.dtype == torch.float64
    assert torch.equal(bias.detach(), deformable_detr_grid_init(2, 2, 2).double())


# --- forward and backward ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("coordinates", [2, 4], ids=["points", "boxes"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "padding_mask"])
def test_forward_and_gradients_match_deformable_detrs_definition(coordinates, with_mask):
    module = make_module()
    shapes, starts = level_tensors()
    query, reference_points, input_flatten = make_inputs(coordinates)
    mask = None
    if with_mask:
        mask = torch.zeros(input_flatten.shape[:2], dtype=torch.bool)
        mask[1, 20:35] = True  # part of image 1's first level
        mask[1, 41:] = True  # image 1's last level
        mask[0, 3] = True

    def ours(q, r, x):
        return module(q, r, x, shapes, starts, mask)

    def theirs(q, r, x):
        return deformable_detr_forward(module, q, r, x, shapes, starts, mask)

    tensors = (query, reference_points, input_flatten)
    actual, expected = outputs_and_grads(ours, module, tensors), outputs_and_grads(theirs, module, tensors)
    assert actual[0].shape == (2, 6, D_MODEL)
    names = ["output", "grad_query", "grad_reference_points", "grad_input_flatten",
             *[f"grad_{n}" for n, _ in module.named_parameters()]]
    assert_same(actual, expected, names)


def test_padding_mask_hides_the_padded_pixels():
    module = make_module()
    shapes, starts = level_tensors()
    query, reference_points, input_flatten = make_inputs(2)
    mask = torch.zeros(input_flatten.shape[:2], dtype=torch.bool)
    mask[:, 10:30] = True
    changed = input_flatten.clone()
    changed[:, 10:30] = 1e3 * torch.randn(2, 20, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        masked = module(query, reference_points, input_flatten, shapes, starts, mask)
        # What lies under the mask does not matter...
        torch.testing.assert_close(module(query, reference_points, changed, shapes, starts, mask), masked,
                                   rtol=1e-10, atol=1e-10)
        # ...and the mask does: without it the same input gives another output.
        unmasked = module(query, reference_points, input_flatten, shapes, starts)
    assert (masked - unmasked).abs().max() > 1e-3


def test_the_projection_biases_reach_masked_values_as_deformable_detr():
    """The mask is applied after value_proj, so a masked pixel samples 0, not value_proj's bias."""
    module = make_module()
    shapes, starts = level_tensors()
    query, reference_points, input_flatten = make_inputs(2)
    everything = torch.ones(input_flatten.shape[:2], dtype=torch.bool)
    with torch.no_grad():
        out = module(query, reference_points, input_flatten, shapes, starts, everything)
    torch.testing.assert_close(out, module.output_proj.bias.expand_as(out), rtol=0, atol=0)


def test_reference_points_of_size_one_broadcast_as_in_deformable_detr():
    module = make_module()
    shapes, starts = level_tensors()
    query, reference_points, input_flatten = make_inputs(4)
    one = reference_points[:1, :, :1]  # [1, Lq, 1, 4]
    with torch.no_grad():
        out = module(query, one, input_flatten, shapes, starts)
        expected = module(query, one.expand(2, -1, N_LEVELS, -1).contiguous(), input_flatten, shapes, starts)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_fresh_module_trains():
    """At initialisation the offsets' and attention's weights are zero; their gradients are not, so they learn."""
    torch.manual_seed(0)
    module = MSDeformAttn(D_MODEL, N_LEVELS, N_HEADS, N_POINTS)
    shapes, starts = level_tensors()
    query, reference_points, input_flatten = (t.float() for t in make_inputs(2))
    module(query, reference_points, input_flatten, shapes, starts).square().mean().backward()
    assert module.sampling_offsets.weight.grad.abs().sum() > 0
    assert module.attention_weights.weight.grad.abs().sum() > 0


# --- errors ----------------------------------------------------------------------------------------------------------


def test_constructor_errors_and_warning():
    with pytest.raises(ValueError, match=r"d_model must be divisible by n_heads, but got 30 and 4"):
        MSDeformAttn(30, 4, 4, 4)
    for kwargs, name in (({"n_heads": 0}, "n_heads"), ({"n_points": -1}, "n_points"), ({"n_levels": 2.0}, "n_levels"),
                         ({"d_model": 0}, "d_model")):
        with pytest.raises(ValueError, match=rf"{name} must be an int >= 1, got"):
            MSDeformAttn(**kwargs)
    with pytest.warns(UserWarning, match=r"d_model // n_heads = 12 channels per head is not a power of 2"):
        MSDeformAttn(96, 4, 8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MSDeformAttn(64, 4, 8, 4)  # 8 channels a head: no warning


def test_forward_errors_name_the_argument_the_expected_and_the_got():
    module = make_module()
    shapes, starts = level_tensors()
    query, reference_points, input_flatten = make_inputs(2)
    good = dict(query=query, reference_points=reference_points, input_flatten=input_flatten,
                input_spatial_shapes=shapes, input_level_start_index=starts)
    cases = [
        ("query", query[..., :8], r"query must have shape \[N, Lq, d_model=16\], got \(2, 6, 8\)"),
        ("query", query[0], r"query must have shape \[N, Lq, d_model=16\], got \(6, 16\)"),
        ("input_flatten", input_flatten[:1],
         r"input_flatten must have shape \[N=2, S, d_model=16\] .*got \(1, 49, 16\)"),
        ("input_flatten", input_flatten[..., :4], r"input_flatten must have shape .*got \(2, 49, 4\)"),
        ("input_flatten", input_flatten[:, :40],
         r"input_flatten must have sum\(H_l \* W_l\) = 49 pixels .*got shape \(2, 40, 16\)"),
        ("reference_points", torch.rand(2, 6, N_LEVELS, 3, dtype=torch.float64),
         r"reference_points must have shape .* the last dim 2 or 4, got \(2, 6, 3, 3\)"),
        ("reference_points", torch.rand(2, 6, 2, 2, dtype=torch.float64),
         r"reference_points must have shape \[N=2, Lq=6, n_levels=3, 2 or 4\] .*got \(2, 6, 2, 2\)"),
        ("reference_points", torch.rand(2, 6, 2, dtype=torch.float64),
         r"reference_points must have shape .*got \(2, 6, 2\)"),
        ("input_spatial_shapes", shapes[:2], r"input_spatial_shapes must have shape \(n_levels=3, 2\) .*got \(2, 2\)"),
    ]
    for name, bad, message in cases:
        with pytest.raises(ValueError, match=message):
            module(**{**good, name: bad})
    for mask, message in ((torch.zeros(2, 48, dtype=torch.bool), r"got torch.bool of shape \(2, 48\)"),
                          (torch.zeros(2, 49), r"got torch.float32 of shape \(2, 49\)")):
        with pytest.raises(ValueError, match=r"input_padding_mask must be a bool tensor of shape \(2, 49\) \[N, S\] "
                                             r".*" + message):
            module(**good, input_padding_mask=mask)


# --- Deformable DETR's compiled extension: `import MultiScaleDeformableAttention as MSDA` ---------------------------


@pytest.fixture
def clean_msda():
    """sys.modules without the extension's name for the test, and as it was afterwards."""
    saved = sys.modules.pop(MSDA_MODULE_NAME, None)
    yield
    sys.modules.pop(MSDA_MODULE_NAME, None)
    if saved is not None:
        sys.modules[MSDA_MODULE_NAME] = saved


def deformable_detr_function():
    """User code, unchanged: Deformable DETR's MSDeformAttnFunction (models/ops/functions/ms_deform_attn_func.py),
    which imports the extension by name; its lines as they are there, long ones included."""
    import MultiScaleDeformableAttention as MSDA

    class MSDeformAttnFunction(Function):
        @staticmethod
        def forward(ctx, value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights, im2col_step):
            ctx.im2col_step = im2col_step
            output = MSDA.ms_deform_attn_forward(
                value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights, ctx.im2col_step)
            ctx.save_for_backward(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights)
            return output

        @staticmethod
        @once_differentiable
        def backward(ctx, grad_output):
            value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights = ctx.saved_tensors
            grad_value, grad_sampling_loc, grad_attn_weight = \
                MSDA.ms_deform_attn_backward(
                    value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights, grad_output, ctx.im2col_step)

            return grad_value, None, None, grad_sampling_loc, grad_attn_weight, None

    return MSDeformAttnFunction


def op_inputs(batch: int = 3, queries: int = 7, heads: int = 2, channels: int = 5, points: int = 3, seed: int = 0):
    """value, spatial_shapes, level_start_index, sampling_locations, attention_weights, float64, with locations
    that reach past every border (x, y in [-0.2, 1.2])."""
    g = torch.Generator().manual_seed(seed)
    shapes, starts = level_tensors()
    pixels = sum(h * w for h, w in SHAPES)
    value = torch.randn(batch, pixels, heads, channels, dtype=torch.float64, generator=g)
    locations = 1.4 * torch.rand(batch, queries, heads, len(SHAPES), points, 2, dtype=torch.float64, generator=g) - 0.2
    weights = torch.rand(batch, queries, heads, len(SHAPES), points, dtype=torch.float64, generator=g)
    return value, shapes, starts, locations, weights


def test_msda_module_is_installed_and_importable(clean_msda):
    module = install_multiscale_deformable_attention()
    import MultiScaleDeformableAttention as MSDA

    assert MSDA is module and isinstance(module, types.ModuleType)
    assert install_multiscale_deformable_attention() is module  # idempotent
    assert importlib.util.find_spec(MSDA_MODULE_NAME) is module.__spec__  # "is the extension there?" checks work
    assert callable(MSDA.ms_deform_attn_forward) and callable(MSDA.ms_deform_attn_backward)


def test_deformable_detrs_function_runs_on_it(clean_msda):
    install_multiscale_deformable_attention()
    function = deformable_detr_function()
    value, shapes, starts, locations, weights = op_inputs()
    leaves = [t.clone().requires_grad_() for t in (value, locations, weights)]

    def run(fn, v, loc, w):
        out = fn(v, loc, w)
        grad_output = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(5))
        return [out.detach(), *torch.autograd.grad(out, (v, loc, w), grad_output)]

    actual = run(lambda v, loc, w: function.apply(v, shapes, starts, loc, w, 64), *leaves)
    expected = run(lambda v, loc, w: ms_deform_attn_reference(v, shapes, starts, loc, w), *leaves)
    assert_same(actual, expected, ["output", "grad_value", "grad_sampling_locations", "grad_attention_weights"])


def test_msda_functions_record_no_graph_and_return_the_extensions_types(clean_msda):
    MSDA = install_multiscale_deformable_attention()
    value, shapes, starts, locations, weights = (t.requires_grad_() if t.is_floating_point() else t
                                                 for t in op_inputs(batch=2))
    out = MSDA.ms_deform_attn_forward(value, shapes, starts, locations, weights, 64)
    assert out.shape == (2, 7, 2 * 5) and not out.requires_grad and out.grad_fn is None
    grads = MSDA.ms_deform_attn_backward(value, shapes, starts, locations, weights, torch.ones_like(out), 64)
    assert isinstance(grads, list) and len(grads) == 3  # the extension returns std::vector<at::Tensor>
    for grad, like in zip(grads, (value, locations, weights)):
        assert grad.shape == like.shape and not grad.requires_grad
    torch.testing.assert_close(out, ms_deform_attn_reference(value, shapes, starts, locations, weights).detach(),
                               rtol=1e-10, atol=1e-10)


def test_msda_errors(clean_msda):
    MSDA = install_multiscale_deformable_attention()
    value, shapes, starts, locations, weights = op_inputs(batch=2)
    with pytest.raises(TypeError, match=r"im2col_step must be an int, got NoneType"):
        MSDA.ms_deform_attn_forward(value, shapes, starts, locations, weights, None)
    with pytest.raises(ValueError, match=r"im2col_step must be >= 1, got 0"):
        MSDA.ms_deform_attn_forward(value, shapes, starts, locations, weights, 0)
    with pytest.raises(ValueError, match=r"sampling_locations must have shape"):
        MSDA.ms_deform_attn_forward(value, shapes, starts, locations[:, :, :1], weights, 64)
    bad_grad = torch.zeros(2, 7, 9, dtype=value.dtype)
    with pytest.raises(ValueError, match=r"^grad_output must have shape \(2, 7, 10\), got \(2, 7, 9\)$"):
        MSDA.ms_deform_attn_backward(value, shapes, starts, locations, weights, bad_grad, 64)
    # A grad_output of another dtype: the forward's kind of error (TypeError naming it), not the C++ RuntimeError.
    other = torch.float32 if value.dtype == torch.float64 else torch.float64
    with pytest.raises(TypeError, match=rf"^grad_output must have value's dtype {value.dtype}, got {other}$"):
        MSDA.ms_deform_attn_backward(value, shapes, starts, locations, weights,
                                     torch.zeros(2, 7, 10, dtype=other), 64)
    # All on the meta device: the shapes, as the op's fake kernel infers them (not a copy out of a meta tensor).
    meta = [t.to("meta") for t in (value, shapes, starts, locations, weights)]
    assert MSDA.ms_deform_attn_forward(*meta, 64).shape == (2, 7, 10)


def test_msda_does_not_replace_another_module_unless_asked(clean_msda):
    theirs = types.ModuleType(MSDA_MODULE_NAME)
    theirs.__file__ = "/somewhere/MultiScaleDeformableAttention.cpython-311-x86_64-linux-gnu.so"
    sys.modules[MSDA_MODULE_NAME] = theirs
    with pytest.raises(RuntimeError, match=r"already another module \(/somewhere/MultiScaleDeformableAttention\."
                                           r".*replace=True"):
        install_multiscale_deformable_attention()
    assert sys.modules[MSDA_MODULE_NAME] is theirs
    ours = install_multiscale_deformable_attention(replace=True)
    assert sys.modules[MSDA_MODULE_NAME] is ours and ours is not theirs
    assert ours is deform_conv.compat.install_multiscale_deformable_attention()


def test_module_names_an_overflowing_pixel_count():
    """Levels whose pixel count overflows int64: named as an overflow (an int64 sum would wrap around to a count
    that might even match input_flatten)."""
    module = deform_conv.MSDeformAttn(d_model=8, n_levels=2, n_heads=2, n_points=1)
    shapes = torch.tensor([[2**32, 2**32], [2**32, 2**32]])  # 2 * 2**64 pixels: 0 in wrapped int64 arithmetic
    with pytest.raises(ValueError, match=r"^input_spatial_shapes: the levels' pixel count sum\(H_l \* W_l\) = "
                                         r"36893488147419103232 overflows int64$"):
        module(torch.randn(1, 2, 8), torch.rand(1, 2, 2, 2), torch.randn(1, 0, 8), shapes, torch.tensor([0, 1]))
