"""Shared test inputs: the awkward geometry, and helpers that run an op and collect every gradient."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, List, Optional, Tuple

import pytest
import torch
from hypothesis import HealthCheck, settings

import deform_conv

def pytest_configure(config):
    config.addinivalue_line(
        "markers", "repeats_under_sanitizers: a variation whose addressing other tests already cover; "
        "scripts/sanitize-tests leaves it out (-m 'not repeats_under_sanitizers') to keep the instrumented run short")


# Tolerances per dtype, (rtol, atol): what the arithmetic allows, never widened to make a test pass.
TOLERANCES = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5)}


@dataclasses.dataclass
class Case:
    input: torch.Tensor     # [B, C_in, H, W]
    offset: torch.Tensor    # [B, 2 * offset_groups * kh * kw, H_out, W_out]
    weight: torch.Tensor    # [C_out, C_in / groups, kh, kw]
    bias: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    stride: Tuple[int, int]
    padding: Tuple[int, int]
    dilation: Tuple[int, int]

    def tensors(self) -> List[torch.Tensor]:
        return [t for t in (self.input, self.offset, self.weight, self.bias, self.mask) if t is not None]

    def call(self, fn: Callable, tensors: List[torch.Tensor]) -> torch.Tensor:
        it = iter(tensors)
        input, offset, weight = next(it), next(it), next(it)
        bias = next(it) if self.bias is not None else None
        mask = next(it) if self.mask is not None else None
        return fn(input, offset, weight, bias, self.stride, self.padding, self.dilation, mask)


def make_case(
    dtype: torch.dtype = torch.float64,
    batch: int = 3,
    in_channels: int = 6,
    out_channels: int = 4,
    size: Tuple[int, int] = (13, 8),
    kernel: Tuple[int, int] = (3, 2),
    stride: Tuple[int, int] = (2, 1),
    padding: Tuple[int, int] = (1, 0),
    dilation: Tuple[int, int] = (2, 1),
    groups: int = 2,
    offset_groups: int = 3,
    with_mask: bool = True,
    with_bias: bool = True,
    offset_scale: float = 2.0,
    seed: int = 0,
) -> Case:
    """Defaults are the awkward geometry: kernel 3x2, stride (2, 1), padding (1, 0), dilation (2, 1),
    2 weight groups, 3 offset groups (which do not nest in the weight groups). Offsets of scale 2 send
    many sampling points across the border and outside the image."""
    g = torch.Generator().manual_seed(seed)
    height, width = size
    kh, kw = kernel
    out_h = (height + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    out_w = (width + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    taps = kh * kw
    return Case(
        input=torch.randn(batch, in_channels, height, width, dtype=dtype, generator=g),
        offset=offset_scale * torch.randn(batch, 2 * offset_groups * taps, out_h, out_w, dtype=dtype, generator=g),
        weight=torch.randn(out_channels, in_channels // groups, kh, kw, dtype=dtype, generator=g),
        bias=torch.randn(out_channels, dtype=dtype, generator=g) if with_bias else None,
        mask=torch.rand(batch, offset_groups * taps, out_h, out_w, dtype=dtype, generator=g) if with_mask else None,
        stride=stride,
        padding=padding,
        dilation=dilation,
    )


def output_and_grads(fn: Callable, case: Case, tensors: Optional[List[torch.Tensor]] = None, seed: int = 1):
    """Runs ``fn`` on the case and returns [output, d/d each tensor of the case] for a fixed random grad_output."""
    leaves = [t.detach().clone().requires_grad_() for t in (tensors or case.tensors())]
    out = case.call(fn, leaves)
    # Drawn in float64 on the CPU, then cast: the same values for every dtype and device.
    grad_output = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    grad_output = grad_output.to(device=out.device, dtype=out.dtype)
    grads = torch.autograd.grad(out, leaves, grad_output)
    return [out.detach(), *grads]


def assert_all_close(actual, expected, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCES[dtype]
    names = ["output", "grad_input", "grad_offset", "grad_weight", "grad_bias / grad_mask", "grad_mask"]
    assert len(actual) == len(expected)
    for name, a, e in zip(names, actual, expected):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(params=[torch.float64, torch.float32], ids=["fp64", "fp32"])
def dtype(request) -> torch.dtype:
    return request.param


OPS = {"ours": deform_conv.deform_conv2d, "reference": deform_conv.deform_conv2d_reference}


def assert_all_close_nonfinite(actual, expected, dtype: torch.dtype, same_nan: bool = True) -> None:
    """Like assert_all_close where inputs may be non-finite: the same entries are non-finite (NaN, if
    ``same_nan``, in the same places too) and the finite ones agree to the dtype's tolerance. (With an infinite
    mask, inf and NaN may trade places between two correct orders of the same multiplications, hence
    ``same_nan=False`` there.)"""
    rtol, atol = TOLERANCES[dtype]
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        finite = torch.isfinite(e)
        assert torch.equal(torch.isfinite(a), finite), f"result {i}: non-finite in different places"
        if same_nan:
            assert torch.equal(torch.isnan(a), torch.isnan(e)), f"result {i}: NaN in different places"
        torch.testing.assert_close(a[finite], e[finite], rtol=rtol, atol=atol, msg=lambda m: f"result {i}: {m}")


@contextlib.contextmanager
def half_gemm_path(mode: str):
    """DEFORM_CONV_CPU_HALF_GEMM for the calls inside ("auto", "float32" or "portable"; cpu/half_gemm.h): the
    library reads it on every call."""
    before = os.environ.get("DEFORM_CONV_CPU_HALF_GEMM")
    os.environ["DEFORM_CONV_CPU_HALF_GEMM"] = mode
    try:
        yield
    finally:
        if before is None:
            del os.environ["DEFORM_CONV_CPU_HALF_GEMM"]
        else:
            os.environ["DEFORM_CONV_CPU_HALF_GEMM"] = before


def hypothesis_profile(ci_examples: int) -> settings:
    """A property test module's settings, chosen by $HYPOTHESIS_PROFILE: "ci" (the default) runs ci_examples
    derandomized examples (the same every run, no database); "thorough" 10,000 random ones, failures kept in
    .hypothesis/ and replayed."""
    common = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
    if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "thorough":
        return settings(max_examples=10_000, **common)
    return settings(max_examples=ci_examples, derandomize=True, database=None, **common)
