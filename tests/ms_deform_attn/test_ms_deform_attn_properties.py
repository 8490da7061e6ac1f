"""Property tests of multi-scale deformable attention: the forward and the gradients of value, sampling_locations
and attention_weights against the float64 reference (deform_conv.ms_deform_attn_reference) on random level sets,
sizes, dtypes and memory layouts, with locations in and out of range and special locations and weights (pixel
centres, the borders, the kink at pixel coordinate -1, NaN, +-inf, huge; NaN, +-inf and zero weights).

Profiles (selected by $HYPOTHESIS_PROFILE, default "ci"):
  ci        300 examples of the main property (agreement with the reference) and 60 of the layout one,
            derandomized (the same examples every run): 15-20 s on 2 cores, depending on the load;
  thorough  10,000 and 2,000, random (a new draw every run; failures are kept in .hypothesis/ and replayed):
            HYPOTHESIS_PROFILE=thorough pytest tests/ms_deform_attn/test_ms_deform_attn_properties.py
The CUDA kernels in the CUDA simulation (where it has them) get a third of the examples: it is slower.
A failure prints the drawn Spec (every size, flag and seed that rebuilds the tensors) and a reproduce_failure blob.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Tuple

import pytest
import torch
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from helpers.common import hypothesis_profile
from helpers.ms_deform_attn import (BACKEND_NAMES, HALF_UNITS, NAMES, REFERENCE, Case, assert_close,
                                    assert_close_nonfinite, assert_identical, get_backend, grad_output_for,
                                    level_tensors, results, summed_magnitudes)

PROFILE = hypothesis_profile(300)

HALF_TYPES = (torch.float16, torch.bfloat16)
# Drawn uniformly from this list: mostly float64, some float32, a few half types (shrinks towards float64).
DTYPES = (torch.float64,) * 5 + (torch.float32,) * 3 + HALF_TYPES
# Values that replace one drawn coordinate. With c = u * size - 0.5 the pixel coordinate: "centre" c = an integer
# in the image, "zero" and "one" the image's edges u = 0 and 1, "minus_one" c = -1 (the kink of the outside
# rule: value 0, derivative not), "size" c = size (the first point outside past the far side).
LOCATION_SPECIALS = ("centre", "zero", "one", "minus_one", "size", "nan", "inf", "-inf", "1e30", "-max")
WEIGHT_SPECIALS = ("nan", "inf", "-inf", "zero")
NON_FINITE = ("nan", "inf", "-inf")


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything one example draws; build() turns it into tensors."""

    dtype: torch.dtype
    levels: Tuple[Tuple[int, int], ...]
    batch: int
    queries: int
    heads: int
    channels: int
    points: int
    low: float                                            # locations uniform in [low, low + spread]
    spread: float
    location_specials: Tuple[Tuple[int, str, int], ...]  # (position, kind, pixel index for "centre")
    weight_specials: Tuple[Tuple[int, str], ...]
    strided: Tuple[bool, bool, bool, bool, bool]          # which arguments reach the op as strided views
    seed: int

    def build(self) -> Case:
        g = torch.Generator().manual_seed(self.seed)
        spatial_shapes, level_start_index = level_tensors(self.levels)
        pixels = sum(h * w for h, w in self.levels)
        L = len(self.levels)
        value = torch.randn(self.batch, pixels, self.heads, self.channels, dtype=torch.float64, generator=g)
        locations = self.low + self.spread * torch.rand(self.batch, self.queries, self.heads, L, self.points, 2,
                                                        dtype=torch.float64, generator=g)
        weights = torch.randn(self.batch, self.queries, self.heads, L, self.points, dtype=torch.float64, generator=g)
        huge = torch.finfo(self.dtype).max
        values = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "1e30": 1e30, "-max": -huge, "zero": 0.0}
        if locations.numel():
            for position, kind, index in self.location_specials:
                where = torch.unravel_index(torch.tensor(position % locations.numel()), locations.shape)
                level, axis = int(where[3]), int(where[5])
                size = self.levels[level][1 - axis]  # x (axis 0) scales with the width, y with the height
                # u with u * size - 0.5 = c; exact where size is a power of two, else rounded alike by both sides
                # (the kernels and the reference compute c = u * size - 0.5 with the same two operations).
                targets = {"centre": index % size, "zero": -0.5, "one": size - 0.5, "minus_one": -1.0, "size": size}
                locations[where] = (targets[kind] + 0.5) / size if kind in targets else values[kind]
        if self.dtype == torch.float32:
            # Onto a grid of 2**-16 (|u| <= 4: 18 bits, times a size below 16): u * size - 0.5 is then exact in
            # float32 as in float64, so the kernels and the float64 reference sample at the very same points.
            # Rounded apart, a coordinate within an ulp of a kink (a pixel centre, or -1) would take the derivative
            # of the kink's other side in one of them. (Float64 is compared with float64, which computes u * size
            # - 0.5 as the kernels do; the half types' 11 or 8 bits times the size are exact in float32.)
            grid = torch.round(locations * 2**16) / 2**16
            locations = torch.where(locations.abs() <= 4, grid, locations)
        if weights.numel():
            for position, kind in self.weight_specials:
                weights.view(-1)[position % weights.numel()] = values[kind]
        return Case(value, spatial_shapes, level_start_index, locations, weights).to(self.dtype)

    @property
    def nonfinite_locations(self) -> bool:
        return any(kind in NON_FINITE for _, kind, _ in self.location_specials)

    @property
    def nonfinite_weights(self) -> bool:
        return any(kind in NON_FINITE for _, kind in self.weight_specials)


@st.composite
def specs(draw, strided: bool = False) -> Spec:
    """``strided``: at least one argument reaches the op as a non-contiguous view."""
    levels = tuple((draw(st.integers(1, 9)), draw(st.integers(1, 9))) for _ in range(draw(st.integers(1, 4))))
    low = draw(st.floats(-1.0, 0.5))
    layouts = tuple(draw(st.booleans()) for _ in range(5))
    if strided and not any(layouts):
        layouts = (True,) + layouts[1:]
    return Spec(
        dtype=draw(st.sampled_from(DTYPES)),
        levels=levels,
        batch=draw(st.sampled_from((1, 2, 3, 0))),
        queries=draw(st.sampled_from((1, 2, 3, 5, 8, 13, 0))),
        heads=draw(st.integers(1, 4)),
        channels=draw(st.integers(1, 16)),
        points=draw(st.integers(1, 4)),
        low=low,
        spread=draw(st.floats(0.0, 2.5)),
        location_specials=tuple(draw(st.lists(
            st.tuples(st.integers(0, 2**20), st.sampled_from(LOCATION_SPECIALS), st.integers(0, 8)), max_size=6))),
        weight_specials=tuple(draw(st.lists(
            st.tuples(st.integers(0, 2**20), st.sampled_from(WEIGHT_SPECIALS)), max_size=3))),
        strided=layouts,
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def relayout(case: Case, strided: Tuple[bool, ...]) -> Case:
    """The same values; each argument flagged in ``strided`` as every other element of a buffer twice as large
    (at a storage offset of 1), so non-contiguous whatever its shape."""
    def view(t, flag):
        return torch.stack((t, t), dim=-1)[..., 1] if flag else t
    return Case(*(view(t, flag) for t, flag in zip(case.args(), strided)))


def float64_reference(case: Case, grad_output: torch.Tensor) -> List[torch.Tensor]:
    """The reference's [output, gradients] in float64 on ``case``'s very values and ``grad_output`` (whatever their
    dtype): the exact results of the inputs the kernels were given, but for float64's own rounding."""
    case64 = case.to(torch.float64)
    grad_output64 = grad_output.double()
    return [REFERENCE.forward(*case64.args()), *REFERENCE.backward(grad_output64, *case64.args())]


def assert_half_close_nonfinite(actual, expected64, case: Case, grad_output: torch.Tensor, same_nan: bool) -> None:
    """``actual`` (a half type) against the float64 reference on the same rounded inputs: the same entries
    non-finite, the finite ones within HALF_UNITS eps of their summed terms' magnitude (helpers/ms_deform_attn.py).
    The magnitudes come from the inputs with NaN and infinite locations moved far outside and non-finite weights
    made 0: a finite result has no non-finite term, so this changes no finite entry's magnitude."""
    dtype = actual[0].dtype
    case64 = case.to(torch.float64)
    tame = case64.replace(
        sampling_locations=case64.sampling_locations.nan_to_num(nan=1e30, posinf=1e30, neginf=-1e30),
        attention_weights=torch.where(case64.attention_weights.isfinite(), case64.attention_weights, 0.0))
    magnitudes = summed_magnitudes(tame, grad_output.double())
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).smallest_normal
    for name, a, e, mag in zip(NAMES, actual, expected64, magnitudes):
        assert a.dtype == dtype and a.shape == e.shape, name
        finite = torch.isfinite(e)
        assert torch.equal(torch.isfinite(a), finite), f"{name}: non-finite in different places"
        if same_nan:
            assert torch.equal(torch.isnan(a), torch.isnan(e)), f"{name}: NaN in different places"
        error = (a.double() - e)[finite].abs()
        bound = (HALF_UNITS * eps * mag + tiny * eps)[finite]
        assert torch.all(error <= bound), f"{name}: error up to {(error / bound).max().item():.3g}x the tolerance"


def examples_for(backend_name: str, examples: int) -> int:
    return examples if backend_name == "cpu" else max(1, examples // 3)


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_ours_matches_the_reference(backend_name):
    """Forward and every gradient (its arguments in the drawn memory layouts) equal the reference's."""
    backend = get_backend(backend_name)  # skips where the backend has nothing to run

    @settings(PROFILE, max_examples=examples_for(backend_name, PROFILE.max_examples))
    @given(spec=specs())
    def check(spec: Spec):
        # Shown by --hypothesis-show-statistics: what the examples covered.
        event(f"dtype {spec.dtype}")
        event(f"{len(spec.levels)} levels")
        event("locations: NaN/inf" if spec.nonfinite_locations else "locations: finite")
        event("weights: NaN/inf" if spec.nonfinite_weights else "weights: finite")
        event("empty" if spec.batch * spec.queries == 0 else "not empty")
        case = spec.build()
        got = results(backend, relayout(case, spec.strided))
        # Against the exact results of the very inputs (the float64 reference on them), not against the reference
        # computed in the same dtype, whose own rounding would add to the kernels'.
        expected = float64_reference(case, grad_output_for(got[0]))
        # An infinite weight times a sum, or a sum of infinite products: inf or NaN by the order.
        same_nan = not spec.nonfinite_weights
        if spec.dtype in HALF_TYPES:
            assert_half_close_nonfinite(got, expected, case, grad_output_for(got[0]), same_nan)
            return
        expected = [e.to(spec.dtype) for e in expected]  # rounded once: at most u |e|, far below the tolerance
        if spec.nonfinite_locations or spec.nonfinite_weights:
            assert_close_nonfinite(got, expected, spec.dtype, same_nan=same_nan)
        else:
            # Everything finite (huge locations included): must stay finite, as assert_close demands.
            assert_close(got, expected, spec.dtype)

    check()


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_memory_layout_does_not_change_the_result(backend_name):
    """Strides never change a value: strided views give bit for bit what contiguous tensors give."""
    backend = get_backend(backend_name)

    @settings(PROFILE, max_examples=examples_for(backend_name, max(1, PROFILE.max_examples // 5)))
    @given(spec=specs(strided=True))
    def check(spec: Spec):
        note(f"strided={spec.strided}")
        case = spec.build()
        assert_identical(results(backend, relayout(case, spec.strided)), results(backend, case))

    check()
