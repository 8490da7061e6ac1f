"""Shared by the deform_conv2d tests: the awkward geometry (Case, make_case), helpers that run an op and collect
every gradient, the assertions with their tolerances, and the inputs and checks more than one test file uses
(non-finite offsets, the case past 2^31 elements, the half types' contract)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, List, Optional, Tuple

import torch

import deform_conv
from deform_conv import deform_conv2d_reference as reference

from .common import TOLERANCES, hypothesis_profile


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


# -------------------------------------------------------------------- inputs and checks of more than one test file


# The property tests' profile (test_properties.py); test_half_precision.py draws a fraction of its examples.
PROFILE = hypothesis_profile(400)


def reference_in_float32(input, offset, weight, bias, stride, padding, dilation, mask):
    """The reference on half inputs widened to float32, its result (and, through the casts, each gradient)
    rounded once to the half type: what our CPU kernels compute for half types, by the reference."""
    widen = [None if t is None else t.float() for t in (input, offset, weight, bias, mask)]
    return reference(*widen[:4], stride, padding, dilation, widen[4]).to(input.dtype)


def assert_half_close(actual, expected, dtype: torch.dtype, same_nan: bool) -> None:
    """Ours and the reference, each a float32 result rounded once to ``dtype`` (unit roundoff u). If the float32
    results A and E agree to float32's |A - E| <= atol + rtol |E|, the rounded a and e differ by at most that plus
    u |A| + u |E|; with |A| <= (1 + rtol) |E| + atol and |E| <= |e| / (1 - u) (a normal e; float16's subnormals
    round to within 2**-25, far below atol) that is the tolerance below: one unit in the last place of the half
    type plus float32's, nothing more."""
    rtol32, atol32 = TOLERANCES[torch.float32]
    u = torch.finfo(dtype).eps / 2
    rtol = (rtol32 * (1 + u) + 2 * u) / (1 - u)
    atol = atol32 * (1 + u) + 2**-24
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype == dtype, i
        a, e = a.float(), e.float()
        finite = torch.isfinite(e)
        assert torch.equal(torch.isfinite(a), finite), f"result {i}: non-finite in different places"
        if same_nan:
            assert torch.equal(torch.isnan(a), torch.isnan(e)), f"result {i}: NaN in different places"
        torch.testing.assert_close(a[finite], e[finite], rtol=rtol, atol=atol, msg=lambda m: f"result {i}: {m}")




def huge(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def with_special_offsets(case, dtype):
    """A NaN (in y, or in x, at two points), +inf, -inf, 1e30 and the dtype's max at other points; returns the
    (n, channel, oy, ox) of each."""
    offset = case.offset.clone()
    nan_points = [(0, 0, 1, 1), (1, 3, 0, 0)]            # channel 0: a y-offset, channel 3: an x-offset
    far_points = [(1, 4, 2, 3), (2, 5, 2, 3), (0, 6, 3, 2), (2, 9, 0, 4)]
    for point in nan_points:
        offset[point] = float("nan")
    for point, value in zip(far_points, [float("inf"), -float("inf"), 1e30, -huge(dtype)]):
        offset[point] = value
    case.offset = offset
    return nan_points, far_points


SIDE = 46341  # SIDE * SIDE = 2_147_488_281 > 2^31


def far_corner_case(device: str = "cpu"):
    """A single output pixel (1x1 kernel, stride = the image size) that samples halfway between the last two
    rows and columns, where the flat index is past 2^31: the bilinear mean of 1, 2, 3, 4. The rest of the image is
    left unwritten (torch.empty), as the op reads nothing else: writing its 8 GiB of zeros page by page took 37-79 s
    on the CI's 2-core VMs, the suite's longest test."""
    x = torch.empty(1, 1, SIDE, SIDE, device=device)
    x[0, 0, -2:, -2:] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    weight = torch.ones(1, 1, 1, 1, device=device)
    offset = torch.tensor([SIDE - 1.5, SIDE - 1.75], device=device).reshape(1, 2, 1, 1)
    return x, offset, weight
