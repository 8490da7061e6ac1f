"""Multi-scale deformable attention: the forward and the gradients of value, sampling_locations and
attention_weights against the reference written from the definition (deform_conv.ms_deform_attn_reference) and
against Deformable DETR's grid_sample composition, in every dtype, on awkward level shapes, at pixel centres and on
the borders, for empty batches and query sets, non-contiguous arguments and non-finite locations and weights;
gradcheck, opcheck, double backward, im2col_step and the deterministic backward.

Every comparison goes through a Backend (helpers/ms_deform_attn.py: a forward and a backward with the ops'
schemas), so the same checks run on the CPU kernels (through the public function and its autograd) and on the CUDA
kernels in the CUDA simulation (torch.ops.deform_conv_sim.*, skipped where it has none). Run under AddressSanitizer
+ UBSan by scripts/sanitize-tests."""

from __future__ import annotations

import math
from typing import List, Tuple

import pytest
import torch

from helpers.common import TOLERANCES
from helpers.ms_deform_attn import (BACKEND_NAMES, GRID_SAMPLE, HALF_TYPES, NAMES, OPS, PUBLIC, REFERENCE, Backend,
                                    Case, assert_close, assert_close_nonfinite, assert_half_close, assert_identical,
                                    autograd_backend, get_backend, grad_output_for, make_case, pixel_coordinates,
                                    results, summed_magnitudes)

import deform_conv
from deform_conv._ops.ms_deform_attn.reference import ms_deform_attn_reference


@pytest.fixture(params=BACKEND_NAMES)
def backend(request) -> Backend:
    return get_backend(request.param)


# ------------------------------------------------------------------------------------------------ comparisons


def test_matches_the_reference(backend, dtype):
    case = make_case(dtype)
    assert_close(results(backend, case), results(REFERENCE, case), dtype)


def test_matches_the_grid_sample_composition(backend, dtype):
    """Deformable DETR's own pure-PyTorch version (grid_sample, align_corners=False, zero padding)."""
    case = make_case(dtype)
    assert_close(results(backend, case), results(GRID_SAMPLE, case), dtype)


def test_reference_agrees_with_grid_sample(dtype):
    """The ground truth itself, against an independent implementation."""
    case = make_case(dtype, low=-1.0, high=2.0, seed=3)
    assert_close(results(REFERENCE, case), results(GRID_SAMPLE, case), dtype)


def test_ops_are_what_the_public_function_runs():
    """Bit for bit: the public function and its autograd formula are the two ops."""
    case = make_case(torch.float32)
    assert_identical(results(PUBLIC, case), results(OPS, case))


HALF_CASES = {
    "awkward": dict(low=-0.2, high=1.2, seed=5),
    # 4 levels x 8 points a head and 16 channels: where the rounding of a half-type accumulator adds up.
    "many_terms": dict(levels=((4, 4), (3, 5), (2, 2), (1, 1)), queries=20, points=8, channels=16, low=-0.1,
                       high=1.1, seed=6),
}


@pytest.mark.parametrize("half", HALF_TYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", HALF_CASES)
def test_half_types_match_the_float64_reference(backend, half, shape):
    case = make_case(half, **HALF_CASES[shape])
    got = results(backend, case)
    # The reference in float64 on the very same (rounded) inputs and grad_output: what is left is the kernels'.
    case64 = case.to(torch.float64)
    grad_output64 = grad_output_for(got[0]).double()
    out = REFERENCE.forward(*case64.args())
    expected = [out, *REFERENCE.backward(grad_output64, *case64.args())]
    assert_half_close(got, expected, summed_magnitudes(case64, grad_output64), half)


def test_summed_magnitudes_bound_the_results():
    """The tolerance's scale is right: no result exceeds its magnitude, and for one location the x-derivative's
    magnitude is the hand-computed W * |w| * sum_k |d b_k / d x| * |g . v_k|."""
    case = make_case(torch.float64, seed=5)
    grad_output = grad_output_for(REFERENCE.forward(*case.args()))
    expected = [REFERENCE.forward(*case.args()), *REFERENCE.backward(grad_output, *case.args())]
    magnitudes = summed_magnitudes(case, grad_output)
    for name, e, mag in zip(NAMES, expected, magnitudes):
        assert torch.all(e.abs() <= mag * (1 + 1e-12)), name
    # Level 0 (5 x 7), point (n, q, m, p) = (1, 2, 0, 1) at pixel (2.25, 1.5) in (x, y).
    locations = case.sampling_locations.clone()
    locations[1, 2, 0, 0, 1] = torch.tensor([(2.25 + 0.5) / 7, (1.5 + 0.5) / 5], dtype=torch.float64)
    case = case.replace(sampling_locations=locations)
    magnitudes = summed_magnitudes(case, grad_output)
    image = case.value[1, :35, 0].reshape(5, 7, -1)   # [H, W, D]
    g = grad_output[1, 2, :case.value.shape[-1]].abs()
    dot = lambda y, x: (g * image[y, x].abs()).sum()  # noqa: E731
    # x in cell [2, 3], y in [1, 2] with ly = 0.5: |d b / d x| = 1 - ly = 0.5 for row 1, ly = 0.5 for row 2.
    hand = 7 * case.attention_weights[1, 2, 0, 0, 1].abs() * 0.5 * (dot(1, 2) + dot(1, 3) + dot(2, 2) + dot(2, 3))
    torch.testing.assert_close(magnitudes[2][1, 2, 0, 0, 1, 0], hand, rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------------------------- awkward shapes


SHAPES = {
    "one_level": dict(levels=((4, 6),)),
    "one_head": dict(heads=1),
    "one_point": dict(points=1),
    "channels_1": dict(channels=1),
    "channels_3": dict(channels=3),
    "channels_13": dict(channels=13),
    "one_query": dict(queries=1),
    "1x1_levels_only": dict(levels=((1, 1), (1, 1), (1, 1)), low=-1.0, high=2.0),
    "1xW_and_Hx1": dict(levels=((1, 9), (9, 1), (1, 2)), low=-0.5, high=1.5),
    "everything_small": dict(levels=((1, 1),), batch=1, queries=1, heads=1, channels=1, points=1, low=-1.0, high=2.0),
    "many_heads_and_points": dict(heads=8, points=8, channels=4, queries=5),
    "far_outside": dict(low=-3.0, high=4.0),
    "batch_5": dict(batch=5, queries=4),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_awkward_shapes(backend, shape):
    case = make_case(torch.float64, **SHAPES[shape])
    assert_close(results(backend, case), results(REFERENCE, case), torch.float64)


@pytest.mark.repeats_under_sanitizers
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_many_queries(backend, dtype):
    """1001 queries a batch: more rows than any split between threads, and not a multiple of any block size."""
    case = make_case(dtype, queries=1001, heads=2, channels=3, points=2, levels=((6, 5), (1, 3), (2, 2)))
    assert_close(results(backend, case), results(REFERENCE, case), dtype)


def test_empty_batch_no_queries_and_no_channels(backend, dtype):
    for changes in (dict(batch=0), dict(queries=0), dict(batch=0, queries=0), dict(channels=0), dict(points=0)):
        case = make_case(dtype, **changes)
        got = results(backend, case)
        heads, channels = case.value.shape[2:]
        assert got[0].shape == (case.value.shape[0], case.sampling_locations.shape[1], heads * channels), changes
        for tensor, grad in zip((case.value, case.sampling_locations, case.attention_weights), got[1:]):
            assert grad.shape == tensor.shape and grad.dtype == dtype, changes
        # With no queries, no point reads value; with no channels, a sample has nothing to move: the gradients
        # are sums over nothing.
        zero_grads = got[1:] if changes == dict(channels=0) else got[1:2]
        for grad in zero_grads:
            assert torch.equal(grad, torch.zeros_like(grad)), changes
        if changes == dict(points=0):  # no point a level: every output is an empty sum
            assert got[0].numel() > 0 and torch.equal(got[0], torch.zeros_like(got[0]))


# ------------------------------------------------------------------------------------- centres and borders


# Sizes that are powers of two, so (i + 0.5) / W and the coordinates below are exact in every dtype: x * W - 0.5
# lands exactly on the integer, and the kinks of the interpolant are hit, not approached.
EXACT_LEVELS = ((4, 8), (1, 1), (2, 1), (1, 4))


def special_coordinates(size: int) -> List[float]:
    """Normalised coordinates whose pixel coordinate c = u * size - 0.5 is exactly: every pixel centre (c = i),
    the image's edges u = 0 (c = -0.5) and u = 1 (c = size - 0.5), the last point that still reads pixel 0
    (c = -1, the kink of the outside rule) and the first outside point past the far side (c = size)."""
    centres = [(i + 0.5) / size for i in range(size)]
    return centres + [0.0, 1.0, -0.5 / size, (size + 0.5) / size]


def case_on_special_coordinates(dtype: torch.dtype, seed: int = 0) -> Case:
    case = make_case(torch.float64, levels=EXACT_LEVELS, batch=2, queries=24, heads=2, channels=3, points=4,
                     seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    locations = case.sampling_locations.clone()
    for level, (height, width) in enumerate(EXACT_LEVELS):
        for axis, size in ((0, width), (1, height)):
            choices = torch.tensor(special_coordinates(size), dtype=torch.float64)
            pick = torch.randint(len(choices), locations[..., level, :, axis].shape, generator=g)
            locations[..., level, :, axis] = choices[pick]
    return case.replace(sampling_locations=locations).to(dtype)


def test_special_coordinates_are_exact(dtype):
    """The premise of the tests below: in float32 and float64 these pixel coordinates are exact integers or
    halves."""
    x, y = pixel_coordinates(case_on_special_coordinates(dtype))
    for c in (x, y):
        assert torch.equal(torch.remainder(2 * c, 1), torch.zeros_like(c))


@pytest.mark.parametrize("peer", ["reference", "grid_sample"])
def test_centres_and_borders_match(backend, dtype, peer):
    """On the kinks (integer pixel coordinates, including c = -1) the derivatives are the one-sided ones from
    above, as grid_sample's; at c = size the point is outside (0, derivative 0)."""
    case = case_on_special_coordinates(dtype)
    assert_close(results(backend, case), results(REFERENCE if peer == "reference" else GRID_SAMPLE, case), dtype)


def one_point_case(dtype: torch.dtype, x: float, y: float, levels=((4, 8),)) -> Case:
    """One image, one query, one head, one point in level 0 (others, if any, get weight 0), weight 1."""
    case = make_case(dtype, levels=levels, batch=1, queries=1, heads=1, channels=3, points=1, seed=11)
    locations = torch.zeros_like(case.sampling_locations)
    locations[0, 0, 0, 0, 0] = torch.tensor([x, y], dtype=dtype)
    weights = torch.zeros_like(case.attention_weights)
    weights[0, 0, 0, 0, 0] = 1
    return case.replace(sampling_locations=locations, attention_weights=weights)


def test_pixel_centres_read_the_pixel_exactly(backend, dtype):
    """Every pixel centre of a 4 x 8 level, one query each with weight 1: the output is the pixel's value, bit
    for bit (the neighbours' weights are exactly 1, 0, 0, 0). A half-pixel shift, swapped x and y or a wrong
    level offset all fail this."""
    height, width = 4, 8
    case = make_case(dtype, levels=((2, 2), (height, width)), batch=2, queries=height * width, heads=2,
                     channels=3, points=1)
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    x, y = ((cols.flatten() + 0.5) / width).to(dtype), ((rows.flatten() + 0.5) / height).to(dtype)
    locations = torch.zeros_like(case.sampling_locations)
    locations[:, :, :, 1, 0] = torch.stack([x, y], dim=-1)[None, :, None]
    weights = torch.zeros_like(case.attention_weights)
    weights[:, :, :, 1] = 1
    case = case.replace(sampling_locations=locations, attention_weights=weights)
    out = backend.forward(*case.args())
    assert torch.equal(out, case.value[:, 4:].flatten(2))  # level 1 starts after the 2 x 2 level's 4 pixels


def test_values_and_gradients_on_the_borders(backend, dtype):
    """Hand-computed, for one point on row 1 (y a pixel centre) of a 4 x 8 level, weight 1, grad_output g:

    x = 0 (c = -0.5): half of pixel (1, 0); d/dx = W g . v(1, 0) (c in [-1, 0): the sample is (c + 1) v(1, 0)).
    c = -1: 0, but d/dx the same W g . v(1, 0) (one-sided from above: moving right brings column 0 in).
    x = 1 (c = W - 0.5): half of pixel (1, W - 1); d/dx = -W g . v(1, W - 1).
    c = W: outside, 0 and derivative exactly 0."""
    width, y = 8, 1.5 / 4
    value = make_case(dtype, levels=((4, 8),), batch=1, queries=1, heads=1, channels=3, points=1, seed=11).value
    first, last = value[0, 1 * width, 0], value[0, 1 * width + width - 1, 0]
    rtol, atol = TOLERANCES[dtype]
    for x, sample, d_dx in ((0.0, first / 2, first), (-0.5 / width, 0 * first, first), (1.0, last / 2, -last),
                            ((width + 0.5) / width, 0 * first, 0 * first)):
        case = one_point_case(dtype, x, y)
        out, grad_value, grad_locations, grad_weights = results(backend, case)
        g = grad_output_for(out)[0, 0]
        torch.testing.assert_close(out[0, 0], sample, rtol=0, atol=0, msg=f"x = {x}: output")
        torch.testing.assert_close(grad_weights[0, 0, 0, 0, 0], (g * sample).sum(), rtol=rtol, atol=atol)
        torch.testing.assert_close(grad_locations[0, 0, 0, 0, 0, 0], width * (g * d_dx).sum(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"x = {x}: d/dx: {m}")
        if x > 1:
            assert grad_locations[0, 0, 0, 0, 0, 0] == 0 and grad_locations[0, 0, 0, 0, 0, 1] == 0
            assert torch.equal(grad_value, torch.zeros_like(grad_value))


# --------------------------------------------------------------------------------------------------- layouts


def strided_views(case: Case) -> Case:
    """The same values, every argument a non-contiguous view: value stored [N, M, S, D], spatial_shapes stored
    transposed, level_start_index every other element, sampling_locations stored with (x, y) outermost of the
    last two dimensions, attention_weights a slice of a wider tensor."""
    views = case.replace(
        value=case.value.transpose(1, 2).contiguous().transpose(1, 2),
        spatial_shapes=case.spatial_shapes.t().contiguous().t(),
        level_start_index=torch.stack([case.level_start_index, case.level_start_index], dim=1)[:, 0],
        sampling_locations=case.sampling_locations.transpose(-1, -2).contiguous().transpose(-1, -2),
        attention_weights=torch.cat([case.attention_weights, case.attention_weights], dim=-1)[
            ..., : case.attention_weights.shape[-1]],
    )
    for t, e in zip(views.args(), case.args()):
        assert not t.is_contiguous() and torch.equal(t, e)
    return views


def test_non_contiguous_arguments(backend, dtype):
    """Strides never change a value: bit for bit the results on contiguous tensors (a strided grad_output too),
    and so the reference's."""
    case = make_case(dtype)
    contiguous = results(backend, case)
    strided = results(backend, strided_views(case), grad_output_strided=True)
    assert_identical(strided, contiguous)
    assert_close(strided, results(REFERENCE, case), dtype)


# ------------------------------------------------------------------------------------------- non-finite inputs


def with_non_finite_locations(case: Case) -> Tuple[Case, list, list]:
    """A NaN x and a NaN y (two points), +inf, -inf, 1e30 and the dtype's -max elsewhere; returns the
    (n, q, m, l, p) of the NaN points and of the far ones."""
    locations = case.sampling_locations.clone()
    nan_points = [((0, 1, 0, 0, 1), 0), ((1, 3, 2, 2, 0), 1)]
    far_points = [((0, 2, 1, 0, 2), 0, math.inf), ((1, 0, 0, 1, 1), 1, -math.inf), ((0, 4, 2, 4, 0), 0, 1e30),
                  ((1, 5, 1, 3, 2), 1, -torch.finfo(case.value.dtype).max)]
    for point, axis in nan_points:
        locations[point + (axis,)] = math.nan
    for point, axis, far in far_points:
        locations[point + (axis,)] = far
    return case.replace(sampling_locations=locations), [p for p, _ in nan_points], [p for p, _, _ in far_points]


def test_non_finite_locations_match_the_reference(backend, dtype):
    case, _, _ = with_non_finite_locations(make_case(dtype))
    assert_close_nonfinite(results(backend, case), results(REFERENCE, case), dtype)


def test_non_finite_locations_follow_the_documented_rules(backend):
    case, nan_points, far_points = with_non_finite_locations(make_case(torch.float64))
    out, grad_value, grad_locations, grad_weights = results(backend, case)
    channels = case.value.shape[-1]
    nan_heads = {(n, q, m) for n, q, m, _, _ in nan_points}
    for n, q, m, l, p in nan_points:
        # A NaN location samples NaN: its query's output in that head is NaN, and so are both of its coordinates'
        # gradients and its weight's.
        assert torch.isnan(out[n, q, m * channels:(m + 1) * channels]).all()
        assert torch.isnan(grad_locations[n, q, m, l, p]).all()
        assert torch.isnan(grad_weights[n, q, m, l, p])
    # Only there: every other output is a number, and the NaN reads no pixel, so value's gradient is finite.
    finite_out = torch.ones_like(out, dtype=torch.bool)
    for n, q, m in nan_heads:
        finite_out[n, q, m * channels:(m + 1) * channels] = False
    assert torch.isfinite(out[finite_out]).all()
    assert torch.isfinite(grad_value).all()
    for point in far_points:
        # +-inf and huge locations are outside: exactly 0 for both coordinates and for the weight.
        assert torch.equal(grad_locations[point], torch.zeros(2, dtype=torch.float64))
        assert grad_weights[point] == 0
    # Without the NaN points, everything is finite.
    clean = case.replace(sampling_locations=case.sampling_locations.nan_to_num(nan=0.5, posinf=7.0, neginf=-7.0))
    far_only = case.replace(sampling_locations=case.sampling_locations.nan_to_num(nan=0.5))
    for c in (clean, far_only):
        assert all(torch.isfinite(r).all() for r in results(backend, c))


def test_far_locations_match_grid_sample(backend, dtype):
    """Huge finite locations are outside for grid_sample too (0, derivative 0). (It differs from ours for NaN and
    +-inf locations: it makes the sample NaN at +-inf, and a NaN coordinate's own derivative 0.)"""
    case = make_case(dtype, seed=2)
    locations = case.sampling_locations.clone()
    locations[0, 1, 0, 0, 1, 0] = 1e30
    locations[1, 3, 2, 2, 0, 1] = -1e30
    locations[1, 0, 1, 3, 2] = 1e10
    case = case.replace(sampling_locations=locations)
    assert_close(results(backend, case), results(GRID_SAMPLE, case), dtype)


def with_non_finite_weights(case: Case) -> Tuple[Case, dict]:
    """NaN, +inf and -inf weights at points inside their level, and +inf at a point far outside (-inf x) and at
    one exactly on a border where the sample is 0 (c = -1)."""
    locations, weights = case.sampling_locations.clone(), case.attention_weights.clone()
    points = dict(nan=(0, 1, 0, 0, 1), inf=(1, 2, 1, 2, 0), minus_inf=(0, 3, 2, 4, 2), inf_outside=(1, 4, 0, 1, 1),
                  inf_on_border=(0, 5, 1, 1, 0))
    for name, p in points.items():
        if name != "inf_outside" and name != "inf_on_border":
            locations[p] = 0.5  # inside, away from the border: the sample is a number, not 0
    locations[points["inf_outside"] + (0,)] = -math.inf
    # Level 1 is 1x1: x = -0.5 is exactly c = -1 (the border), y = 0.5 the pixel's centre row.
    locations[points["inf_on_border"]] = torch.tensor([-0.5, 0.5], dtype=locations.dtype)
    for name, w in dict(nan=math.nan, inf=math.inf, minus_inf=-math.inf, inf_outside=math.inf,
                        inf_on_border=math.inf).items():
        weights[points[name]] = w
    return case.replace(sampling_locations=locations, attention_weights=weights), points


def test_non_finite_weights_match_the_reference(backend, dtype):
    case, _ = with_non_finite_weights(make_case(dtype))
    # inf * (a sum) and (a sum of inf * terms) may be inf or NaN depending on the order: compare finiteness.
    assert_close_nonfinite(results(backend, case), results(REFERENCE, case), dtype, same_nan=False)


def test_non_finite_weights_propagate_as_a_multiplication(backend):
    case, points = with_non_finite_weights(make_case(torch.float64))
    out, grad_value, grad_locations, grad_weights = results(backend, case)
    channels = case.value.shape[-1]

    def head(p):
        n, q, m, _, _ = p
        return out[n, q, m * channels:(m + 1) * channels]

    assert torch.isnan(head(points["nan"])).all()
    assert torch.isinf(head(points["inf"])).all() and torch.isinf(head(points["minus_inf"])).all()
    # inf * a sample of 0 is NaN, wherever the sample is 0 ...
    assert torch.isnan(head(points["inf_outside"])).all()
    assert torch.isnan(head(points["inf_on_border"])).all()
    # ... but a location outside does not move the result, whatever its weight: derivative exactly 0.
    assert torch.equal(grad_locations[points["inf_outside"]], torch.zeros(2, dtype=torch.float64))
    # On the border it does (one-sided from above), times an infinite weight.
    assert torch.isinf(grad_locations[points["inf_on_border"]][0])
    # A weight's own gradient is its sample . grad_output: finite, whatever the weight (0 outside).
    assert torch.isfinite(grad_weights).all() and grad_weights[points["inf_outside"]] == 0
    # The weight multiplies value's gradient at the four neighbours of its point.
    assert torch.isnan(grad_value).any() and torch.isinf(grad_value).any()


# ------------------------------------------------------------------------------------ autograd and the ops


def away_from_kinks(case: Case, margin: float = 0.05) -> Case:
    """Pixel coordinates moved at least ``margin`` pixels away from integers (the kinks of the interpolant),
    where finite differences would straddle two cells."""
    locations = case.sampling_locations.clone()
    hw = case.spatial_shapes.to(locations.dtype)
    for axis, size in ((0, hw[:, None, 1]), (1, hw[:, None, 0])):
        c = locations[..., axis] * size - 0.5
        distance = c - torch.round(c)
        c = torch.where(distance.abs() < margin, torch.round(c) + torch.where(distance < 0, -margin, margin) * 2, c)
        locations[..., axis] = (c + 0.5) / size
    return case.replace(sampling_locations=locations)


def test_away_from_kinks_does_what_it_says():
    x, y = pixel_coordinates(away_from_kinks(make_case(torch.float64, levels=EXACT_LEVELS)))
    for c in (x, y):
        assert ((c - torch.round(c)).abs() >= 0.05 - 1e-12).all()


def test_gradcheck():
    case = away_from_kinks(make_case(torch.float64, levels=((3, 4), (1, 1), (2, 1)), batch=2, queries=3, heads=2,
                                     channels=3, points=2, low=-0.5, high=1.5))
    leaves = [t.detach().clone().requires_grad_() for t in (case.value, case.sampling_locations,
                                                            case.attention_weights)]

    def fn(value, locations, weights):
        return deform_conv.ms_deform_attn(value, case.spatial_shapes, case.level_start_index, locations, weights)

    # Along one coordinate the interpolant is linear within a cell, and the op is linear in value and in the
    # weights: central differences are exact but for rounding (~1e-16 / eps = 1e-10 relative).
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8, rtol=1e-7)


@pytest.mark.parametrize("batch", [2, 0])
def test_opcheck_forward(batch):
    case = make_case(torch.float32, batch=batch)
    args = list(case.args())
    for i in (0, 3, 4):
        args[i] = args[i].clone().requires_grad_()
    torch.library.opcheck(torch.ops.deform_conv.ms_deform_attn.default, tuple(args))


@pytest.mark.parametrize("batch", [2, 0])
def test_opcheck_backward(batch):
    case = make_case(torch.float32, batch=batch)
    grad_output = grad_output_for(torch.ops.deform_conv.ms_deform_attn(*case.args()))
    torch.library.opcheck(torch.ops.deform_conv.ms_deform_attn_backward.default, (grad_output, *case.args()))


def test_double_backward_raises():
    case = make_case(torch.float64)
    value = case.value.clone().requires_grad_()
    locations = case.sampling_locations.clone().requires_grad_()
    out = deform_conv.ms_deform_attn(value, case.spatial_shapes, case.level_start_index, locations,
                                     case.attention_weights)
    (grad_locations,) = torch.autograd.grad(out.square().sum(), locations, create_graph=True)
    with pytest.raises(RuntimeError, match="^ms_deform_attn does not support double backward"):
        grad_locations.sum().backward()


def test_gradients_when_only_some_arguments_require_them():
    """Value a constant (a frozen encoder), locations and weights learned; and the other way round."""
    case = make_case(torch.float64)
    for wanted in ((3, 4), (0,)):
        args = list(case.args())
        leaves = []
        for i in wanted:
            args[i] = args[i].clone().requires_grad_()
            leaves.append(args[i])
        got = torch.autograd.grad(deform_conv.ms_deform_attn(*args).sum(), leaves)
        expected = torch.autograd.grad(ms_deform_attn_reference(*args).sum(), leaves)
        for a, e in zip(got, expected):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("im2col_step", [64, 1, 7])
def test_im2col_step_is_accepted_and_ignored(im2col_step):
    """Deformable DETR passes im2col_step (64 by default) to chunk its CUDA kernel's batch; here it changes
    nothing, bit for bit."""
    case = make_case(torch.float32, batch=3)
    with_step = autograd_backend("im2col_step", lambda *args: deform_conv.ms_deform_attn(*args, im2col_step))
    assert_identical(results(with_step, case), results(PUBLIC, case))
    assert_identical(results(with_step, case), results(autograd_backend(
        "keyword", lambda *args: deform_conv.ms_deform_attn(*args, im2col_step=im2col_step)), case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_backward_is_bitwise_reproducible(dtype):
    """The CPU kernels sum every gradient in one fixed order (csrc/ms_deform_attn/cpu): the same bits for 1 and
    2 threads and from call to call, with many points reading each pixel (so a different order of the sums would
    show in float32's last bits)."""
    case = make_case(dtype, batch=2, queries=300, heads=2, channels=5, points=4, low=0.0, high=1.0, seed=7)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (2, 2, 1, 2):
            torch.set_num_threads(n)
            runs.append(results(PUBLIC, case))
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:]:
        assert_identical(run, runs[0])
