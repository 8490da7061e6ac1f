"""Property tests: our kernels against the pure-PyTorch reference on random geometry, dtypes, memory layouts and
offsets/masks with special values (NaN, +-inf, huge, exact integers and the kink at -1), forward and all five
gradients.

Profiles (selected by $HYPOTHESIS_PROFILE, default "ci"):
  ci        400 examples of the main property (agreement with the reference) and 80 of the layout one,
            derandomized (the same examples every run): 4-30 s on 2 cores, depending on the load;
  thorough  10,000 and 2,000, random (a new draw every run; failures are kept in .hypothesis/ and replayed):
            HYPOTHESIS_PROFILE=thorough pytest tests/deform_conv2d/test_properties.py
A failure prints the drawn Spec (every size, flag and seed that rebuilds the tensors) and a reproduce_failure blob.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from helpers.deform_conv2d import (PROFILE, Case, assert_all_close, assert_all_close_nonfinite, assert_half_close,
                                   half_gemm_path, output_and_grads, reference_in_float32)

import deform_conv

ours = deform_conv.deform_conv2d
reference = deform_conv.deform_conv2d_reference

HALF_TYPES = (torch.float16, torch.bfloat16)
# Drawn uniformly from this list: mostly float64, some float32, a few half types (shrinks towards float64).
DTYPES = (torch.float64,) * 5 + (torch.float32,) * 3 + HALF_TYPES
# Offsets: values that replace a drawn one. "integer" puts the point on a pixel centre (base positions are
# integers); "minus_one", "last" and "size" put the coordinate exactly on -1, size - 1 or size (the kinks and
# edges of the outside rule).
OFFSET_SPECIALS = ("nan", "inf", "-inf", "1e30", "-1e30", "max", "-max", "integer", "minus_one", "last", "size")
MASK_SPECIALS = ("nan", "inf", "-inf", "zero")
# How each 4-D tensor reaches our op: values identical, strides not.
LAYOUTS = ("contiguous", "channels_last", "transposed", "strided")


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything one example draws; build() turns it into tensors."""

    dtype: torch.dtype
    batch: int
    in_channels: int
    out_channels: int
    groups: int
    offset_groups: int
    size: Tuple[int, int]
    kernel: Tuple[int, int]
    stride: Tuple[int, int]
    padding: Tuple[int, int]
    dilation: Tuple[int, int]
    with_mask: bool
    with_bias: bool
    offset_scale: float
    round_offsets: bool
    offset_specials: Tuple[Tuple[int, str, int], ...]   # (position, kind, integer for "integer")
    mask_specials: Tuple[Tuple[int, str], ...]
    layouts: Tuple[str, str, str, str]                   # input, offset, weight, mask
    seed: int

    @property
    def out_size(self) -> Tuple[int, int]:
        return tuple(
            (n + 2 * p - d * (k - 1) - 1) // s + 1
            for n, p, d, k, s in zip(self.size, self.padding, self.dilation, self.kernel, self.stride)
        )

    def build(self) -> Case:
        g = torch.Generator().manual_seed(self.seed)
        (height, width), (kh, kw), (out_h, out_w) = self.size, self.kernel, self.out_size
        taps = kh * kw

        def randn(*shape):  # drawn in float64: the same values for every dtype, then rounded once
            return torch.randn(*shape, dtype=torch.float64, generator=g)

        input = randn(self.batch, self.in_channels, height, width)
        weight = randn(self.out_channels, self.in_channels // self.groups, kh, kw)
        bias = randn(self.out_channels) if self.with_bias else None
        offset = self.offset_scale * randn(self.batch, 2 * self.offset_groups * taps, out_h, out_w)
        if self.round_offsets:
            offset = offset.round()
        mask = torch.rand(self.batch, self.offset_groups * taps, out_h, out_w, dtype=torch.float64, generator=g)
        offset, mask = self._specials(offset, mask)
        return Case(
            input=input.to(self.dtype),
            offset=offset.to(self.dtype),
            weight=weight.to(self.dtype),
            bias=None if bias is None else bias.to(self.dtype),
            mask=mask.to(self.dtype) if self.with_mask else None,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
        )

    def _specials(self, offset: torch.Tensor, mask: torch.Tensor):
        huge = torch.finfo(self.dtype).max
        values = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "1e30": 1e30, "-1e30": -1e30,
                  "max": huge, "-max": -huge, "zero": 0.0}
        if offset.numel():
            channels = offset.shape[1]
            for position, kind, integer in self.offset_specials:
                index = position % offset.numel()
                n, c, oy, ox = torch.unravel_index(torch.tensor(index), offset.shape)
                tap, axis = divmod(int(c) % (channels // self.offset_groups), 2)
                # The point's base coordinate along this axis: out * stride - pad + kernel index * dilation.
                k = tap // self.kernel[1] if axis == 0 else tap % self.kernel[1]
                out_index = int(oy) if axis == 0 else int(ox)
                base = out_index * self.stride[axis] - self.padding[axis] + k * self.dilation[axis]
                targets = {"minus_one": -1, "last": self.size[axis] - 1, "size": self.size[axis]}
                if kind == "integer":
                    value = float(integer)
                elif kind in targets:
                    value = float(targets[kind] - base)   # small integers: exact in every dtype
                else:
                    value = values[kind]
                offset[n, c, oy, ox] = value
        if mask.numel():
            for position, kind in self.mask_specials:
                mask.view(-1)[position % mask.numel()] = values[kind]
        return offset, mask

    @property
    def nonfinite_offsets(self) -> bool:
        # Huge finite offsets are not among them: outside the image, they must give finite results.
        return any(kind in ("nan", "inf", "-inf") for _, kind, _ in self.offset_specials)

    @property
    def nonfinite_masks(self) -> bool:
        return self.with_mask and any(kind != "zero" for _, kind in self.mask_specials)


def _divisors(n: int):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def specs(draw, strided: bool = False) -> Spec:
    """``strided``: at least one of input, offset, weight and mask reaches our op as a non-contiguous view."""
    dtype = draw(st.sampled_from(DTYPES))
    if draw(st.integers(0, 3)) == 0:
        # Depthwise (groups == in_channels == out_channels): a path of its own in the CPU kernels.
        in_channels = out_channels = groups = draw(st.integers(1, 6))
        offset_groups = draw(st.sampled_from(_divisors(in_channels)))
    else:
        # Weight groups and offset groups both divide in_channels; they need not nest in each other.
        groups = draw(st.integers(1, 3))
        offset_groups = draw(st.integers(1, 3))
        in_channels = math.lcm(groups, offset_groups) * draw(st.integers(1, 2))
        out_channels = groups * draw(st.integers(1, 3))
    kernel = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    dilation = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    # From the smallest input that leaves one output pixel (1x1 images where padding allows) up.
    size = tuple(
        draw(st.integers(lo, lo + 7))
        for lo in (max(1, d * (k - 1) + 1 - 2 * p) for k, p, d in zip(kernel, padding, dilation))
    )
    with_mask = draw(st.booleans())
    layouts = tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(4))
    if strided and set(layouts[:3] + (layouts[3] if with_mask else "contiguous",)) == {"contiguous"}:
        layouts = ("strided",) + layouts[1:]
    offset_specials = draw(st.lists(
        st.tuples(st.integers(0, 2**20), st.sampled_from(OFFSET_SPECIALS), st.integers(-3, 3)), max_size=6))
    mask_specials = draw(st.lists(st.tuples(st.integers(0, 2**20), st.sampled_from(MASK_SPECIALS)), max_size=3))
    return Spec(
        dtype=dtype,
        batch=draw(st.sampled_from((1, 2, 3, 0))),
        in_channels=in_channels,
        out_channels=out_channels,
        groups=groups,
        offset_groups=offset_groups,
        size=size,
        kernel=kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        with_mask=with_mask,
        with_bias=draw(st.booleans()),
        offset_scale=draw(st.floats(0.0, 4.0)),
        round_offsets=draw(st.integers(0, 4)) == 0,
        offset_specials=tuple(offset_specials),
        mask_specials=tuple(mask_specials) if with_mask else (),
        layouts=layouts,
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def relayout(t: Optional[torch.Tensor], layout: str) -> Optional[torch.Tensor]:
    """``t``'s values with other strides; differentiable, and its backward only copies (exact)."""
    if t is None or layout == "contiguous":
        return t
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "transposed":       # height and width strides swapped
        return t.transpose(2, 3).contiguous().transpose(2, 3)
    if layout == "strided":          # every other element of a larger buffer, at a storage offset of 1
        return torch.stack((t, t), dim=-1)[..., 1]
    raise ValueError(layout)


def ours_with_layouts(layouts):
    def fn(input, offset, weight, bias, stride, padding, dilation, mask):
        input, offset, weight, mask = (relayout(t, l) for t, l in zip((input, offset, weight, mask), layouts))
        return ours(input, offset, weight, bias, stride, padding, dilation, mask)
    return fn


def assert_identical(actual, expected) -> None:
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"result {i}: {m}")


@settings(PROFILE)
@given(spec=specs())
def test_ours_matches_the_reference(spec: Spec):
    """Forward and every gradient of ours (its tensors in the drawn memory layouts) equal the reference's."""
    note(f"out_size={spec.out_size}")
    # Shown by --hypothesis-show-statistics: what the examples covered.
    event(f"dtype {spec.dtype}")
    event("offsets: NaN/inf" if spec.nonfinite_offsets else "offsets: finite")
    event("mask: NaN/inf" if spec.nonfinite_masks else ("mask" if spec.with_mask else "no mask"))
    event("depthwise" if spec.groups == spec.in_channels == spec.out_channels else "GEMM path")
    event("batch 0" if spec.batch == 0 else "batch > 0")
    case = spec.build()
    # Half types on their float32 path, whose contract this is (the native forward's: test_half_precision.py).
    with half_gemm_path("float32"):
        got = output_and_grads(ours_with_layouts(spec.layouts), case)
    # An infinite mask times a sum, or a sum of infinite products: inf or NaN by the order (conftest).
    same_nan = not spec.nonfinite_masks
    if spec.dtype in HALF_TYPES:
        assert_half_close(got, output_and_grads(reference_in_float32, case), spec.dtype, same_nan)
        return
    expected = output_and_grads(reference, case)
    if spec.nonfinite_offsets or spec.nonfinite_masks:
        assert_all_close_nonfinite(got, expected, spec.dtype, same_nan=same_nan)
    else:
        # Everything finite: must stay finite (assert_close rejects a NaN against a number).
        assert_all_close(got, expected, spec.dtype)


@settings(PROFILE, max_examples=max(1, PROFILE.max_examples // 5))
@given(spec=specs(strided=True))
def test_memory_layout_does_not_change_the_result(spec: Spec):
    """Strides never change a value: ours on channels-last, transposed or strided views gives bit for bit what
    it gives on contiguous tensors (the kernels copy to their own layouts; the arithmetic is the same)."""
    note(f"out_size={spec.out_size}")
    case = spec.build()
    assert_identical(output_and_grads(ours_with_layouts(spec.layouts), case), output_and_grads(ours, case))
