"""Shared by the multi-scale deformable attention tests: the inputs (Case, make_case), the implementations compared
(Backend: a forward and a backward with the schemas of torch.ops.deform_conv.ms_deform_attn and
ms_deform_attn_backward; the CPU kernels through the public function, the reference, Deformable DETR's grid_sample
composition, the CUDA kernels in the CUDA simulation), results() that runs one, and the assertions with their
tolerances."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, List, Sequence, Tuple

import pytest
import torch

import deform_conv
from deform_conv import BuildError
from deform_conv._ops.ms_deform_attn.reference import ms_deform_attn_grid_sample, ms_deform_attn_reference

from .common import TOLERANCES

NAMES = ("output", "grad_value", "grad_sampling_locations", "grad_attention_weights")
HALF_TYPES = (torch.float16, torch.bfloat16)

# Levels of different sizes, among them 1x1, 1xW and Hx1: S = 35 + 1 + 6 + 4 + 6 = 52 pixels.
AWKWARD_LEVELS = ((5, 7), (1, 1), (1, 6), (4, 1), (3, 2))


# ------------------------------------------------------------------------------------------------------ inputs


@dataclasses.dataclass
class Case:
    value: torch.Tensor               # [N, S, M, D]
    spatial_shapes: torch.Tensor      # [L, 2] int64, (H_l, W_l)
    level_start_index: torch.Tensor   # [L] int64
    sampling_locations: torch.Tensor  # [N, Lq, M, L, P, 2], (x, y) normalised to [0, 1]
    attention_weights: torch.Tensor   # [N, Lq, M, L, P]

    def args(self) -> Tuple[torch.Tensor, ...]:
        return (self.value, self.spatial_shapes, self.level_start_index, self.sampling_locations,
                self.attention_weights)

    def replace(self, **changes) -> "Case":
        return dataclasses.replace(self, **changes)

    def to(self, dtype: torch.dtype) -> "Case":
        return self.replace(value=self.value.to(dtype), sampling_locations=self.sampling_locations.to(dtype),
                            attention_weights=self.attention_weights.to(dtype))


def level_tensors(levels: Sequence[Tuple[int, int]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """spatial_shapes [L, 2] and level_start_index [L] of levels one after another."""
    spatial_shapes = torch.tensor(levels, dtype=torch.int64).reshape(-1, 2)
    sizes = spatial_shapes.prod(1)
    return spatial_shapes, torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])


def make_case(dtype: torch.dtype = torch.float64, levels: Sequence[Tuple[int, int]] = AWKWARD_LEVELS,
              batch: int = 2, queries: int = 9, heads: int = 3, channels: int = 5, points: int = 3,
              low: float = -0.3, high: float = 1.3, seed: int = 0) -> Case:
    """Random values and weights (any sign), locations uniform in [low, high]: the default range sends points out
    of every level (a 1x1 level's only pixel covers x in (-0.5, 1.5), so there only the far-outside tests do).
    Drawn in float64, then rounded once: the same values in every dtype."""
    g = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index = level_tensors(levels)
    pixels = int(spatial_shapes.prod(1).sum())
    L = len(levels)
    value = torch.randn(batch, pixels, heads, channels, dtype=torch.float64, generator=g)
    locations = low + (high - low) * torch.rand(batch, queries, heads, L, points, 2, dtype=torch.float64, generator=g)
    weights = torch.randn(batch, queries, heads, L, points, dtype=torch.float64, generator=g)
    return Case(value, spatial_shapes, level_start_index, locations, weights).to(dtype)


def pixel_coordinates(case: Case) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x * W_l - 0.5, y * H_l - 0.5) of every location: the pixel coordinates the kernels sample at."""
    hw = case.spatial_shapes.to(case.sampling_locations.dtype)  # [L, 2] (H, W)
    loc = case.sampling_locations
    return loc[..., 0] * hw[:, None, 1] - 0.5, loc[..., 1] * hw[:, None, 0] - 0.5


# ---------------------------------------------------------------------------------------------------- backends


@dataclasses.dataclass(frozen=True)
class Backend:
    """An implementation with the ops' schemas: forward(value, spatial_shapes, level_start_index,
    sampling_locations, attention_weights) -> output [N, Lq, M * D]; backward(grad_output, the same five) ->
    (grad_value, grad_sampling_locations, grad_attention_weights)."""

    name: str
    forward: Callable
    backward: Callable


def autograd_backend(name: str, fn: Callable) -> Backend:
    """A differentiable function as a Backend: its backward is autograd's (on the very tensors given, so a
    non-contiguous argument stays non-contiguous)."""

    def backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        leaves = [t.detach().requires_grad_() for t in (value, sampling_locations, attention_weights)]
        out = fn(leaves[0], spatial_shapes, level_start_index, leaves[1], leaves[2])
        return torch.autograd.grad(out, leaves, grad_output, materialize_grads=True)

    return Backend(name, fn, backward)


def _grid_sample(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    levels = [tuple(hw) for hw in spatial_shapes.tolist()]
    return ms_deform_attn_grid_sample(value, levels, sampling_locations, attention_weights)


PUBLIC = autograd_backend("cpu", deform_conv.ms_deform_attn)
REFERENCE = autograd_backend("reference", ms_deform_attn_reference)
GRID_SAMPLE = autograd_backend("grid_sample", _grid_sample)
OPS = Backend("ops", torch.ops.deform_conv.ms_deform_attn, torch.ops.deform_conv.ms_deform_attn_backward)


@functools.lru_cache(maxsize=None)
def _load_simulation():
    """The CUDA kernels in the CUDA simulation as a Backend, or why there are none to run (tried once)."""
    from deform_conv import testing

    try:
        testing.load_cuda_simulation()
    except BuildError as error:
        # tests/deform_conv2d/test_cuda_simulation.py fails on this; here it only means there is nothing to compare.
        return ("the CUDA simulation does not build (tests/deform_conv2d/test_cuda_simulation.py reports it): "
                f"{str(error).splitlines()[0]}")
    if not hasattr(torch.ops.deform_conv_sim, "ms_deform_attn"):
        return ("torch.ops.deform_conv_sim has no ms_deform_attn yet: the CUDA simulation does not include the "
                "multi-scale deformable attention kernels")
    return Backend("cuda_simulation", torch.ops.deform_conv_sim.ms_deform_attn,
                   torch.ops.deform_conv_sim.ms_deform_attn_backward)


def simulation_backend() -> Backend:
    loaded = _load_simulation()
    if isinstance(loaded, str):
        pytest.skip(loaded)
    return loaded


BACKEND_NAMES = ("cpu", "cuda_simulation")


def get_backend(name: str) -> Backend:
    return PUBLIC if name == "cpu" else simulation_backend()



def grad_output_for(out: torch.Tensor, seed: int = 1) -> torch.Tensor:
    # Drawn in float64, then cast: the same values for every dtype and backend.
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return g.to(out.dtype)


def results(backend: Backend, case: Case, seed: int = 1, grad_output_strided: bool = False) -> List[torch.Tensor]:
    """[output, grad_value, grad_sampling_locations, grad_attention_weights] from ``backend`` for a fixed random
    grad_output (the same for every backend, so results compare directly)."""
    out = backend.forward(*case.args())
    grad_output = grad_output_for(out, seed)
    if grad_output_strided:  # every other element of a buffer twice as large
        grad_output = torch.stack([grad_output, grad_output], dim=-1)[..., 1]
    return [out, *backend.backward(grad_output, *case.args())]


# -------------------------------------------------------------------------------------------------- assertions


def assert_close(actual, expected, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCES[dtype]
    assert len(actual) == len(expected) == 4
    for name, a, e in zip(NAMES, actual, expected):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_close_nonfinite(actual, expected, dtype: torch.dtype, same_nan: bool = True) -> None:
    """The same entries non-finite (NaN in the same places too, if ``same_nan``), the finite ones within the
    dtype's tolerance."""
    rtol, atol = TOLERANCES[dtype]
    assert len(actual) == len(expected) == 4
    for name, a, e in zip(NAMES, actual, expected):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        finite = torch.isfinite(e)
        assert torch.equal(torch.isfinite(a), finite), f"{name}: non-finite in different places"
        if same_nan:
            assert torch.equal(torch.isnan(a), torch.isnan(e)), f"{name}: NaN in different places"
        torch.testing.assert_close(a[finite], e[finite], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_identical(actual, expected) -> None:
    for name, a, e in zip(NAMES, actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        assert torch.equal(a.nan_to_num(), e.nan_to_num()) and torch.equal(a.isnan(), e.isnan()), name


def summed_magnitudes(case: Case, grad_output: torch.Tensor) -> List[torch.Tensor]:
    """For each element of [output, grad_value, grad_sampling_locations, grad_attention_weights], the sum of the
    absolute values of the terms that make it, in float64 (``case`` and ``grad_output`` float64, finite):

      output[n, q, m*D + d]        = sum_{l, p, k} w * b_k * v_k[d]            (b_k: the bilinear weights >= 0)
      grad_value[n, s, m, d]       = sum over the points reading pixel s of w * b_k * g[d]
      grad_attention_weights[...]  = sum_{k, d} b_k * g[d] * v_k[d]
      grad_sampling_locations x    = W_l * w * sum_{k, d} (d b_k / d x) * g[d] * v_k[d]   (y alike, with H_l)

    The first three are the reference on |value|, |attention_weights|, |grad_output|. For the last, |d b_k / d x|
    over the four neighbours is (1 - ly, 1 - ly, ly, ly): twice the bilinear weights at the same y with x moved
    to the middle of its cell (same neighbours), so the reference's attention-weight gradient there gives it."""
    value, spatial_shapes, level_start_index, locations, weights = case.args()
    abs_value, abs_weights, abs_grad = value.abs().requires_grad_(), weights.abs().requires_grad_(), grad_output.abs()
    output = ms_deform_attn_reference(abs_value, spatial_shapes, level_start_index, locations, abs_weights)
    grad_value, grad_weights = torch.autograd.grad(output, (abs_value, abs_weights), abs_grad)
    hw = spatial_shapes.to(torch.float64)  # [L, 2] (H, W)
    per_axis = []
    for axis, size in ((0, hw[:, None, 1]), (1, hw[:, None, 0])):  # x scales with W_l, y with H_l
        cell_middle = locations.clone()
        # pixel coordinate c = u * size - 0.5; the middle of its cell, floor(c) + 0.5, is u' = (floor(c) + 1) / size
        cell_middle[..., axis] = (torch.floor(locations[..., axis] * size - 0.5) + 1) / size
        probe = weights.clone().requires_grad_()
        out = ms_deform_attn_reference(abs_value, spatial_shapes, level_start_index, cell_middle, probe)
        (dot,) = torch.autograd.grad(out, probe, abs_grad)
        per_axis.append(2 * size * weights.abs() * dot)
    return [output.detach(), grad_value, torch.stack(per_axis, dim=-1), grad_weights]


# The half types' tolerance: 2 units of roundoff (u = eps / 2) of the summed terms' magnitude. The CPU kernels
# read the half inputs exactly into float32, compute there and round each result once: that rounding costs at
# most u |result| <= u magnitude, and float32's own error (about (4 L P + D) 2**-24 of the magnitude) is a few
# hundredths of u at these sizes; the second unit covers one rounding to the half type of an intermediate (each
# sample, or a partial sum, is bounded by the magnitude), as a backend may have. Errors that grow with the number
# of terms fail: a half-type accumulator reaches 1.0-1.4 eps of the magnitude on these cases (the CPU kernels
# 0.3-0.5). Plus the spacing of the type's subnormals, where a tiny result rounds absolutely.
HALF_UNITS = 1  # eps = 2 u


def assert_half_close(actual, expected64, magnitudes, dtype: torch.dtype) -> None:
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).smallest_normal
    for name, a, e, mag in zip(NAMES, actual, expected64, magnitudes):
        assert a.dtype == dtype and a.shape == e.shape, name
        bound = HALF_UNITS * eps * mag + tiny * eps
        error = (a.double() - e).abs()
        worst = (error / bound).nan_to_num(nan=math.inf).max() if error.numel() else error.new_tensor(0)
        assert torch.all(error <= bound), (
            f"{name}: |{dtype} - float64 reference| exceeds {HALF_UNITS} eps of the summed terms' magnitude, up "
            f"to {worst.item():.3g}x (largest error {error.max().item():.3g})")
