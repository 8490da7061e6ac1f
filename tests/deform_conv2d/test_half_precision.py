"""bfloat16 and float16 on the CPU: the native forward (half columns, half GEMMs summing in float32, each stored
value rounded once) where the CPU multiplies half types natively, and the float32 path everywhere else. The native
path runs here on any CPU with DEFORM_CONV_CPU_HALF_GEMM=portable (its GEMMs on ATen's portable half GEMM, the
same factors and layout but for oneDNN's packing); ONEDNN_MAX_CPU_ISA=AVX2 or AVX512_CORE in a child process forces
the fallback, as on a CPU without AMX or AVX512-BF16, and AVX512_CORE_BF16 leaves bfloat16 native on AMD's cores
only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.deform_conv2d import PROFILE, assert_half_close, half_gemm_path, make_case, reference_in_float32

import deform_conv
from deform_conv._bench.environment import first_processor

ours = deform_conv.deform_conv2d
reference = deform_conv.deform_conv2d_reference
HALF_TYPES = pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
PATH_VARIABLE = "DEFORM_CONV_CPU_HALF_GEMM"


def path(dtype: torch.dtype) -> str:
    return torch.ops.deform_conv.cpu_half_path(dtype)


def native_here(dtype: torch.dtype) -> bool:
    """Whether this CPU takes the native half path (cpu_half_path says "<dtype>: native, ..." there)."""
    return path(dtype).startswith(f"{str(dtype).removeprefix('torch.')}: native,")


def native_gemm_path(half, gemm: str) -> str:
    """DEFORM_CONV_CPU_HALF_GEMM for a test of the native path on `gemm`: "portable" (ATen's portable GEMM, any
    CPU), or "own" (this CPU's microkernels, AMX or AVX512-BF16: the layout the probe chose, and the weight's and
    the columns' packing for it; skipped where the CPU has none)."""
    if gemm == "own" and not native_here(half):
        pytest.skip(f"no native GEMM here: {path(half)}")
    return "portable" if gemm == "portable" else "auto"


def halves(case, half):
    return [t.to(half) for t in case.tensors()]


def native_forward_tolerance(case, tensors, half) -> torch.Tensor:
    """How far the native forward may lie from the exact result on the same (rounded) inputs, per element.
    Each column value is the float32 sampling (relative error at most a few float32 units of A_i =
    m * sum_q w_q |x_q|, the sampling of |x|) rounded to the half type (unit roundoff u): off by at most
    (u + eps) A_i. The GEMM sums K products and the bias in float32 (at most gamma = (K + 2) 2**-24 of
    S + |b|, S = sum_i A_i |w_i|: the reference on |x|, |w|, |m|), and the output is rounded once (u |y|).
    float16's subnormals add at most 2**-25 per rounding. Hence
    |y - exact| <= u |exact| + (u + (K + 20) 2**-24)(S + |b|)(1 + 2u) + (K + 1) 2**-25 max|w| + 2**-24."""
    wide = [t.double() for t in tensors]
    k = case.weight.shape[1] * case.weight.shape[2] * case.weight.shape[3]
    u = torch.finfo(half).eps / 2
    it = iter(wide)
    x, offset, w = next(it), next(it), next(it)
    b = next(it) if case.bias is not None else None
    m = next(it) if case.mask is not None else None
    exact = reference(x, offset, w, b, case.stride, case.padding, case.dilation, m)
    s = reference(x.abs(), offset, w.abs(), None, case.stride, case.padding, case.dilation,
                  None if m is None else m.abs())
    if b is not None:
        s = s + b.abs().view(1, -1, 1, 1)
    subnormal = (k + 1) * 2**-25 * w.abs().max().item() + 2**-24 if half == torch.float16 else 0.0
    return exact, u * exact.abs() + (u + (k + 20) * 2**-24) * s * (1 + 2 * u) + subnormal


def assert_native_forward_close(case, half, tensors=None):
    tensors = tensors if tensors is not None else halves(case, half)
    got = case.call(ours, tensors)
    assert got.dtype == half
    exact, tolerance = native_forward_tolerance(case, halves(case, half), half)
    error = (got.double() - exact).abs()
    assert torch.isfinite(got).all()
    assert (error <= tolerance).all(), f"worst excess {(error - tolerance).max().item():.3g}"
    return got


def float32_rounded(case, tensors, half):
    return case.call(ours, [t.float() for t in tensors]).to(half)


# Shapes that reach every part of the native path: one image per thread and fewer images than threads (the input
# turned per thread, or up front), panels of 64 output channels and a narrower last one (packed to a width of
# 16), depth blocks of 512 rows (taps * C_in/G = 576; in the backward 400 pixels and more), two tiles an image,
# odd depths, weight and offset groups that do not nest, stride, dilation, no mask, no bias.
NATIVE_SHAPES = {
    "awkward": dict(),
    "one_image": dict(batch=1, in_channels=8, out_channels=6, groups=2, offset_groups=2, size=(12, 9)),
    "panels_depth_blocks": dict(batch=3, in_channels=64, out_channels=90, groups=1, offset_groups=4, size=(9, 10),
                                kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1)),
    "many_tiles": dict(batch=2, in_channels=32, out_channels=20, groups=1, offset_groups=1, size=(24, 25),
                       kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1)),
    # 1,936 pixels of 1.2 KiB (576 half columns, 16 float32 outputs): two tiles an image within the half types'
    # 2 MiB.
    "two_tiles_an_image": dict(batch=2, in_channels=64, out_channels=16, groups=1, offset_groups=1, size=(44, 44),
                               kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1)),
    # 5x7 output pixels and 3 output channels per group: odd depths in both backward GEMMs, padded to pairs.
    "odd_depths": dict(in_channels=6, out_channels=6, size=(11, 8)),
    "no_mask_no_bias": dict(batch=2, in_channels=12, out_channels=10, groups=2, offset_groups=4, with_mask=False,
                            with_bias=False),
}


@HALF_TYPES
def test_path_names_the_choice(half, monkeypatch):
    name = "bfloat16" if half == torch.bfloat16 else "float16"
    auto = path(half)
    assert auto.startswith(name) and (native_here(half) or "computed in float32 (no native" in auto), auto
    monkeypatch.setenv(PATH_VARIABLE, "float32")
    assert path(half) == f"{name}: computed in float32 ({PATH_VARIABLE}=float32)"
    monkeypatch.setenv(PATH_VARIABLE, "portable")
    assert "portable GEMM" in path(half)
    monkeypatch.setenv(PATH_VARIABLE, "fast")
    with pytest.raises(RuntimeError, match=f"{PATH_VARIABLE} must be auto, float32 or portable, got 'fast'"):
        path(half)
    with pytest.raises(RuntimeError, match=f"{PATH_VARIABLE} must be auto, float32 or portable, got 'fast'"):
        case = make_case(torch.float32)
        case.call(ours, halves(case, half))


def test_path_refuses_other_dtypes():
    with pytest.raises(RuntimeError, match="dtype must be torch.bfloat16 or torch.float16, got Float"):
        path(torch.float32)


@HALF_TYPES
@pytest.mark.parametrize("shape", list(NATIVE_SHAPES))
@pytest.mark.parametrize("gemm", ["portable", "own"])
def test_native_forward_within_the_half_rounding(half, shape, gemm):
    mode = native_gemm_path(half, gemm)
    case = make_case(torch.float32, **NATIVE_SHAPES[shape])
    tensors = halves(case, half)
    with half_gemm_path(mode):
        got = assert_native_forward_close(case, half, tensors)
    # The native path ran: its columns are rounded to the half type, so its sums differ from the float32 path's.
    assert not torch.equal(got, float32_rounded(case, tensors, half))


@HALF_TYPES
@pytest.mark.parametrize("layout", ["channels_last", "strided"])
def test_native_forward_takes_any_layout(half, layout):
    case = make_case(torch.float32, **NATIVE_SHAPES["panels_depth_blocks"])
    tensors = halves(case, half)
    x = tensors[0]
    tensors[0] = (x.contiguous(memory_format=torch.channels_last) if layout == "channels_last"
                  else torch.stack((x, x), dim=-1)[..., 1])
    with half_gemm_path("portable"):
        got = case.call(ours, tensors)
        assert torch.equal(got, case.call(ours, halves(case, half)))


@HALF_TYPES
def test_native_forward_is_the_same_on_any_thread_count(half):
    case = make_case(torch.float32, **NATIVE_SHAPES["many_tiles"])
    threads = torch.get_num_threads()
    try:
        with half_gemm_path("portable"):
            torch.set_num_threads(1)
            one = case.call(ours, halves(case, half))
            torch.set_num_threads(2)
            two = case.call(ours, halves(case, half))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def output_and_grads_bits(case, tensors, grad_output, half):
    """The output and every gradient of `case` on `tensors`, rounded to `half` and seen as int16 (bit patterns: -0
    and NaNs compared too), and the shapes the call widened through ATen (widened_shapes; None for float32
    tensors)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    results = []

    def run():
        out = case.call(ours, leaves)
        results.append(out)
        results.extend(torch.autograd.grad(out, leaves, grad_output.to(out.dtype)))

    if tensors[0].dtype == torch.float32:
        run()
        widened = None
    else:
        widened = widened_shapes(run, tensors[0].dtype)
    assert len(results) == 1 + len(tensors)
    return [r.to(half).view(torch.int16) for r in results], widened


@HALF_TYPES
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_depthwise_layers_run_in_float32(half, layout):
    """Depthwise layers have no GEMM: the float32 path, bit for bit, on the native path too, forward and backward.
    Their input and grad_output are widened as they are turned channels-last, their output and the input's
    gradient rounded as they are turned back: no widened copy of either through ATen."""
    case = make_case(torch.float32, batch=3, in_channels=20, out_channels=20, groups=20, offset_groups=4,
                     size=(13, 11))
    tensors = halves(case, half)
    if layout == "channels_last":
        tensors[0] = tensors[0].contiguous(memory_format=torch.channels_last)
    grad_output = torch.randn(case.call(ours, tensors).shape, generator=torch.Generator().manual_seed(3))
    grad_output = grad_output.to(half)
    expected, _ = output_and_grads_bits(case, [t.float() for t in tensors], grad_output.float(), half)
    with half_gemm_path("portable"):
        got, widened = output_and_grads_bits(case, tensors, grad_output, half)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(g, e), i
    for name, t in (("input", tensors[0]), ("grad_output", grad_output)):
        assert list(t.shape) not in widened, f"the depthwise path widened the {name}: {widened}"


@HALF_TYPES
@pytest.mark.parametrize("shape", ["awkward", "one_image", "panels_depth_blocks"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_float32_backward_reads_the_input_as_it_is(half, shape, layout):
    """Without a half GEMM, the backward runs in float32 as a float32 layer's: bit for bit its output and
    gradients rounded, the input widened as it is turned channels-last for the passes (no widened copy of it
    through ATen), grad_output a chunk at a time for the GEMMs."""
    case = make_case(torch.float32, **NATIVE_SHAPES[shape])
    tensors = halves(case, half)
    if layout == "channels_last":
        tensors[0] = tensors[0].contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        tensors[0] = torch.stack((tensors[0], tensors[0]), dim=-1)[..., 1]
    grad_output = torch.randn(case.call(ours, tensors).shape, generator=torch.Generator().manual_seed(3))
    grad_output = grad_output.to(half)
    with half_gemm_path("float32"):
        expected, _ = output_and_grads_bits(case, [t.float() for t in tensors], grad_output.float(), half)
        got, widened = output_and_grads_bits(case, tensors, grad_output, half)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(g, e), i
    assert list(tensors[0].shape) not in widened, f"the backward widened the input: {widened}"


@HALF_TYPES
@pytest.mark.parametrize("kwargs", [dict(in_channels=3, out_channels=4, groups=1, offset_groups=3, kernel=(3, 3)),
                                    dict(batch=1, in_channels=512, out_channels=8, groups=1, offset_groups=2,
                                         kernel=(3, 3), size=(5, 6), padding=(1, 1), stride=(1, 1), dilation=(1, 1))],
                         ids=["odd_depth", "weight_large_against_rows"])
def test_native_forward_on_the_driver(half, kwargs):
    """Layers the tiled path does not take -- an odd taps * C_in/groups (27 here: the tiled path packs the
    weight's depth in pairs), or float32 tiles that would not fit (32 pixels of 9 * 512 columns and 8 outputs, 4
    bytes each: 590 KiB) with few rows against the weight (30 against 4,608 columns) -- run the driver's columns
    through the half type's GEMMs (a convolution for the first, matrix products for the second): within the same
    rounding."""
    case = make_case(torch.float32, **kwargs)
    tensors = halves(case, half)
    with half_gemm_path("portable"):
        got = assert_native_forward_close(case, half, tensors)
    assert not torch.equal(got, float32_rounded(case, tensors, half))


# A layer whose float32 tiles would not fit (9 * 520 columns and 80 outputs a pixel: 32 pixels take 595 KiB). With
# 2 images of 13x13 it has rows enough against its weight (338, more than its depth of 4,680 over 16): the half
# types take it tiled, a whole image a tile, the GEMMs a depth block of the columns at a time (10 blocks, the last
# 72 rows deep) over two panels (64 and 16 output channels). With one image (169 rows) the driver's matrix products
# take it, which read the weight once.
LARGE_LAYER = dict(in_channels=520, out_channels=80, groups=1, offset_groups=2, size=(13, 13), kernel=(3, 3),
                   stride=(1, 1), padding=(1, 1), dilation=(1, 1))


@HALF_TYPES
@pytest.mark.parametrize("batch, tiled", [(2, True), (1, False)], ids=["tiled", "driver"])
def test_native_forward_of_a_layer_whose_tiles_do_not_fit(half, batch, tiled):
    """Within the same rounding on either path; the tiled one runs no GEMM of ATen's, the driver's its mm."""
    case = make_case(torch.float32, **LARGE_LAYER, batch=batch)
    tensors = halves(case, half)
    with half_gemm_path("portable"):
        with torch.profiler.profile() as profile:
            case.call(ours, tensors)
        got = assert_native_forward_close(case, half, tensors)
    gemms_of_aten = {"aten::mm", "aten::addmm", "aten::conv2d"} & {event.name for event in profile.events()}
    assert (not gemms_of_aten) == tiled, gemms_of_aten
    assert not torch.equal(got, float32_rounded(case, tensors, half))


@HALF_TYPES
@pytest.mark.parametrize("groups", [1, 2])
def test_native_forward_of_a_layer_whose_tiles_do_not_fit_here(half, groups):
    """The same tiled layer on this CPU's own path, and in two weight groups (40 output channels each: a panel of
    16, 16 and 8 columns, packed to 48). With AMX or AVX512-BF16 its weight is packed into VNNI pairs by one
    transpose of 32-bit words (cpu_half_path says so; for AMX the library checked that ATen packs the same bits when
    it chose the path). Without a native path, the float32 path rounded, bit for bit."""
    case = make_case(torch.float32, **dict(LARGE_LAYER, groups=groups), batch=2)
    tensors = halves(case, half)
    with half_gemm_path("auto"):
        if not native_here(half):
            assert torch.equal(case.call(ours, tensors), float32_rounded(case, tensors, half))
            return
        got = assert_native_forward_close(case, half, tensors)
    assert not torch.equal(got, float32_rounded(case, tensors, half))


@HALF_TYPES
def test_native_forward_of_a_large_layer_on_more_threads_than_images(half):
    """The large layer's whole-image tiles on 1, 2 and 4 threads for its 2 images: the same bits (how the tiles fall
    among threads never changes a sum)."""
    case = make_case(torch.float32, **LARGE_LAYER, batch=2)
    threads = torch.get_num_threads()
    results = []
    try:
        with half_gemm_path("portable"):
            for count in (1, 2, 4):
                torch.set_num_threads(count)
                results.append(case.call(ours, halves(case, half)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])


def native_grad_weight_tolerance(case, tensors, grad_output, half):
    """The weight's gradient on the native path sums, in float32, grad_output (exact in the half type) times the
    columns rounded to the half type: as for the forward, |g - exact| <= u |exact| + (u + (N + 20) 2**-24) S
    (1 + 2u), N the terms per sum (images * pixels), S the same gradient of the reference on |x|, |m| with
    |grad_output| (and no bias), plus float16's subnormals."""
    wide = [t.double().detach().requires_grad_() for t in tensors]
    exact = torch.autograd.grad(case.call(reference, wide), wide[2], grad_output.double())[0]
    absolute = [t.double().detach() for t in tensors]
    absolute[0] = absolute[0].abs()
    if case.mask is not None:
        absolute[-1] = absolute[-1].abs()
    if case.bias is not None:
        absolute[3] = torch.zeros_like(absolute[3])
    absolute = [t.requires_grad_() for t in absolute]
    s = torch.autograd.grad(case.call(reference, absolute), absolute[2], grad_output.double().abs())[0]
    u = torch.finfo(half).eps / 2
    terms = case.input.shape[0] * grad_output.shape[2] * grad_output.shape[3]
    subnormal = ((terms + 1) * 2**-25 * grad_output.double().abs().max().item() + 2**-24
                 if half == torch.float16 else 0.0)
    return exact, u * exact.abs() + (u + (terms + 20) * 2**-24) * s * (1 + 2 * u) + subnormal


@HALF_TYPES
@pytest.mark.parametrize("shape", ["awkward", "panels_depth_blocks", "odd_depths", "many_tiles"])
@pytest.mark.parametrize("gemm", ["portable", "own"])
def test_gradients_on_the_native_path(half, shape, gemm):
    """Every gradient on the native path: the weight's within the columns' rounding (native_grad_weight_tolerance);
    input, offset, bias and mask from sums of exact half products in float32, so within float32's tolerance of the
    float32 reference plus one half unit (test_properties.assert_half_close). On the float32 path each gradient is
    the float32 one rounded, bit for bit."""
    mode = native_gemm_path(half, gemm)
    case = make_case(torch.float32, **NATIVE_SHAPES[shape])
    tensors = halves(case, half)
    out_shape = case.call(ours, tensors).shape
    grad_output = torch.randn(out_shape, generator=torch.Generator().manual_seed(3)).to(half)

    def grads(fn, ts, g):
        leaves = [t.detach().clone().requires_grad_() for t in ts]
        return list(torch.autograd.grad(case.call(fn, leaves), leaves, g))

    with half_gemm_path(mode):
        native = grads(ours, tensors, grad_output)
    expected_weight, tolerance = native_grad_weight_tolerance(case, tensors, grad_output, half)
    error = (native[2].double() - expected_weight).abs()
    assert (error <= tolerance).all(), f"worst excess {(error - tolerance).max().item():.3g}"
    in_float32 = grads(reference_in_float32, tensors, grad_output)
    others = [0, 1, 3, 4]  # input, offset, bias, mask
    assert_half_close([native[i] for i in others], [in_float32[i] for i in others], half, same_nan=True)
    with half_gemm_path("float32"):
        rounded = [g.to(half) for g in grads(ours, [t.float() for t in tensors], grad_output.float())]
        for i, (g, e) in enumerate(zip(grads(ours, tensors, grad_output), rounded)):
            assert torch.equal(g, e), i
    # The native path ran: the weight's gradient sums rounded columns.
    assert not torch.equal(native[2], rounded[2])


def widened_shapes(run, half) -> list[list[int]]:
    """The shapes of the tensors that `run()` converts from `half` to float32 through ATen (the profiler's
    record of aten::_to_copy: its input's shape, and the dtype it was asked for, by code)."""
    with torch.profiler.profile(record_shapes=True) as prof:
        torch.ones(5, dtype=half).float()  # the float32 code, as this profiler records it
        run()
        torch.ones(3, 7, dtype=half).float()  # a widening after the call, which the record must show
    copies = [e for e in prof.events() if e.name == "aten::_to_copy"]
    float_code = copies[0].concrete_inputs[1]
    shapes = [e.input_shapes[0] for e in copies[1:] if e.concrete_inputs[1] == float_code]
    assert shapes[-1] == [3, 7], "the profiler did not record the widenings"
    return shapes[:-1]


@HALF_TYPES
def test_native_backward_reads_the_half_tensors_as_they_are(half):
    """The native backward samples the half-type input and multiplies grad_output and the weight as they are: no
    float32 copy of any of them (the offsets and the mask, sampling coordinates, are widened)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 7, 9, generator=g).to(half).requires_grad_()
    offset = torch.randn(2, 18, 7, 9, generator=g).to(half).requires_grad_()
    weight = torch.randn(10, 6, 3, 3, generator=g).to(half).requires_grad_()
    mask = torch.rand(2, 9, 7, 9, generator=g).to(half).requires_grad_()
    with half_gemm_path("portable"):
        out = ours(x, offset, weight, padding=1, mask=mask)
        grad_output = torch.randn(out.shape, generator=g).to(half)
        widened = widened_shapes(lambda: torch.autograd.grad(out, (x, offset, weight, mask), grad_output), half)
    for name, t in (("input", x), ("grad_output", grad_output), ("weight", weight)):
        assert list(t.shape) not in widened, f"the backward widened the {name}: {widened}"


@HALF_TYPES
def test_native_forward_propagates_nan(half):
    case = make_case(torch.float32, **NATIVE_SHAPES["one_image"])
    tensors = halves(case, half)
    # One point's dy (offset group 0: channels 0-3, weight group 0): NaN in that group's output channels there.
    tensors[1][0, 0, 2, 3] = float("nan")
    tensors[0][0, 1, 0, 0] = float("inf")  # an infinite input pixel
    with half_gemm_path("portable"):
        got = case.call(ours, tensors)
    expected = float32_rounded(case, tensors, half)
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.isnan(got[0, :3, 2, 3]).all() and not torch.isnan(got[0, 3:, 2, 3]).any()


@settings(PROFILE, max_examples=max(1, PROFILE.max_examples // 8))
@given(half=st.sampled_from([torch.bfloat16, torch.float16]), batch=st.integers(1, 4),
       per_group=st.integers(1, 12), groups=st.integers(1, 3), out_per_group=st.integers(1, 70),
       offset_groups=st.sampled_from([1, 2, 3]), kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       stride=st.tuples(st.integers(1, 2), st.integers(1, 2)), size=st.tuples(st.integers(3, 12), st.integers(3, 12)),
       with_mask=st.booleans(), with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_native_forward_property(half, batch, per_group, groups, out_per_group, offset_groups, kernel, stride, size,
                                 with_mask, with_bias, seed):
    """Random geometry on the native path: within the half rounding of the exact result, wherever it applies
    (elsewhere the float32 path's bits)."""
    in_channels = per_group * groups * offset_groups
    case = make_case(torch.float32, batch=batch, in_channels=in_channels, out_channels=out_per_group * groups,
                     groups=groups, offset_groups=offset_groups, kernel=kernel, stride=stride, padding=(1, 1),
                     dilation=(1, 1), size=size, with_mask=with_mask, with_bias=with_bias, seed=seed)
    with half_gemm_path("portable"):
        assert_native_forward_close(case, half)


CHILD = """
import json, sys, torch
import deform_conv
sys.path.insert(0, {tests!r})
from helpers.deform_conv2d import half_gemm_path, make_case
case = make_case(torch.float32, **json.loads(sys.argv[1]))
result = {{}}
for name, half in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
    tensors = [t.to(half) for t in case.tensors()]
    got = case.call(deform_conv.deform_conv2d, tensors)
    widened = case.call(deform_conv.deform_conv2d, [t.float() for t in tensors]).to(half)
    result[name] = dict(path=torch.ops.deform_conv.cpu_half_path(half), float32_bits=torch.equal(got, widened))
print(json.dumps(result))
"""


def amd_with_avx512_bf16() -> bool:
    """Whether /proc/cpuinfo names an AMD CPU with AVX512-BF16 (Zen 4 and later): the one kind without AMX whose
    bfloat16 GEMMs outrun float32's (cpu/half_gemm.cpp)."""
    try:
        cpu = first_processor(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False
    return cpu.get("vendor_id") == "AuthenticAMD" and "avx512_bf16" in cpu.get("flags", "").split()


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE", "AVX512_CORE_BF16"])
def test_onednn_limited_below_amx_forces_the_float32_path(isa):
    """ONEDNN_MAX_CPU_ISA (set before oneDNN starts, so in a child) below AMX: no native half GEMM, whatever the CPU
    has, and the half types' forward is the float32 one rounded, bit for bit -- but for bfloat16 at AVX512_CORE_BF16
    on AMD's cores, where its microkernels run (and outrun float32: cpu/half_gemm.cpp). On Intel's cores they ran
    bfloat16 layers slower than the float32 path, so they are not used there. AVX512_CORE: oneDNN refuses the half
    types' microkernels (an error of its own, not ATen's), and the library takes the float32 path."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa}
    env.pop(PATH_VARIABLE, None)
    shape = json.dumps(NATIVE_SHAPES["panels_depth_blocks"])
    child = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(Path(__file__).resolve().parents[1])), shape],
                           capture_output=True, text=True, timeout=600, env=env)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    for name in ("bf16", "fp16"):
        if name == "bf16" and isa == "AVX512_CORE_BF16" and amd_with_avx512_bf16():
            assert result[name]["path"].startswith("bfloat16: native, bfloat16 GEMMs on oneDNN's AVX512-BF16"), result
            assert not result[name]["float32_bits"], result
            continue
        assert "computed in float32 (no native" in result[name]["path"], result
        assert result[name]["float32_bits"], result


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch.backends.mkldnn.flags sets it
@HALF_TYPES
def test_onednn_off_takes_the_float32_path(half):
    case = make_case(torch.float32, **NATIVE_SHAPES["panels_depth_blocks"])
    tensors = halves(case, half)
    with torch.backends.mkldnn.flags(enabled=False), half_gemm_path("auto"):
        assert "computed in float32" in path(half)
        assert torch.equal(case.call(ours, tensors), float32_rounded(case, tensors, half))


@HALF_TYPES
def test_the_default_path_is_what_the_op_says(half):
    """Where the CPU multiplies half types natively, the default forward is the native one; elsewhere the
    float32 one rounded, bit for bit."""
    case = make_case(torch.float32, **NATIVE_SHAPES["panels_depth_blocks"])
    tensors = halves(case, half)
    with half_gemm_path("auto"):
        if native_here(half):
            got = assert_native_forward_close(case, half, tensors)
            assert not torch.equal(got, float32_rounded(case, tensors, half))
        else:
            assert torch.equal(case.call(ours, tensors), float32_rounded(case, tensors, half))



@HALF_TYPES
@pytest.mark.parametrize("shape", list(NATIVE_SHAPES) + ["large_layer"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_float32_path_reads_the_half_tensors_as_they_are(half, shape, layout):
    """Without a half GEMM, a layer the float32 tiled path takes (its tiles fit, on the batch-reduce GEMM) runs there
    in float32, its image and weight widened as they are turned and its output rounded as it is turned back; other
    layers (taps * C_in + C_out > 4096 here) run on the driver's float32 GEMMs, their input widened as it is turned
    channels-last and their weight as it is turned to the columns' order. The bits of the float32 path on widened
    copies, and no widened copy of the input or the weight through ATen. On 2 threads the input is turned per
    thread (an image per thread), up front (fewer images than threads: "one_image"), or is channels-last
    already."""
    kwargs = dict(LARGE_LAYER, batch=2) if shape == "large_layer" else NATIVE_SHAPES[shape]
    case = make_case(torch.float32, **kwargs)
    tensors = halves(case, half)
    x, weight = tensors[0], tensors[2]
    if layout == "channels_last":
        tensors[0] = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        tensors[0] = torch.stack((x, x), dim=-1)[..., 1]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with half_gemm_path("float32"):
            with torch.profiler.profile(record_shapes=True) as profile:
                got = case.call(ours, tensors)
        expected = float32_rounded(case, tensors, half)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))  # bit for bit, -0 included
    converted = [event.input_shapes[0] for event in profile.events() if event.name == "aten::_to_copy"]
    assert list(x.shape) not in converted, converted
    assert list(weight.shape) not in converted, converted


@HALF_TYPES
def test_float32_path_propagates_nan(half):
    """NaN offsets and weights, and an infinite pixel, on the float32 tiled path of a half-type layer: NaN where
    the float32 path on widened copies has NaN, its values elsewhere."""
    case = make_case(torch.float32, **NATIVE_SHAPES["panels_depth_blocks"])
    tensors = halves(case, half)
    tensors[1][0, 0, 2, 3] = float("nan")  # one point's dy
    tensors[0][1, 5, 0, 0] = float("inf")  # an infinite input pixel
    tensors[2][7, 3, 1, 1] = float("nan")  # a weight
    with half_gemm_path("float32"):
        with torch.profiler.profile(record_shapes=True) as profile:
            got = case.call(ours, tensors)
    converted = [event.input_shapes[0] for event in profile.events() if event.name == "aten::_to_copy"]
    if torch.ops.deform_conv.brgemm_available():
        assert list(tensors[0].shape) not in converted, converted  # the tiled path ran
    expected = float32_rounded(case, tensors, half)
    assert torch.isnan(got).any() and torch.isinf(got).any()
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    finite = ~torch.isnan(expected)
    assert torch.equal(got[finite], expected[finite])

def rounding_case(half, channels: int, seed: int = 3, groups: int = 1):
    """A 1x1 layer with the identity as its weight outputs its columns unchanged; a shift of half a pixel to the
    right, and the mask, make each column (0.5 a + 0.5 b + 0 c + 0 d) * m of two neighbours a, b (c, d the row
    below), a float32 value that needs rounding. A mask of NaN and one of -NaN make NaN columns, which the output
    must round to c10::BFloat16's NaN whatever their sign (the rounding instruction of AVX512-BF16, cpu_lanes.h,
    keeps it). (No infinities: the GEMM would add 0 * inf of the other channels. bfloat16's subnormal columns, of
    one channel in row 2, make their points round every channel value by value, but the half GEMMs read those
    columns themselves as zero: test_family_half_widening.py checks their rounding.) Returns the layer's inputs and
    the float32 values its columns must round."""
    g = torch.Generator().manual_seed(seed)
    height, width = 9, 33
    scale = 4.0 ** torch.randint(-9, 5, (1, channels, height, width), generator=g)
    x = torch.randn(1, channels, height, width, generator=g) * scale
    # One channel of row 2 near float32's smallest normal: its columns there are subnormal in bfloat16 (a point
    # with one rounds its channels value by value, cpu_lanes.h), zero in float16.
    x[0, 3, 2] = (torch.rand(width, generator=g) + 0.5) * 2.0**-126
    x = x.to(half)
    offset = torch.zeros(1, 2, height, width)
    offset[:, 1] = 0.5
    mask = torch.rand(1, 1, height, width, generator=g) * 3
    mask[..., 1, 2], mask[..., 2, 1] = float("nan"), -float("nan")  # (inside the driver test's crop)
    mask = mask.to(half)
    per_group = channels // groups  # each weight group the identity on its channels
    weight = torch.eye(per_group).repeat(groups, 1).view(channels, per_group, 1, 1).to(half)
    a, b = x[..., :-1].float(), x[..., 1:].float()
    return (x, offset.to(half), weight, mask), (0.5 * a + 0.5 * b) * mask[..., :-1].float()


def assert_rounded_as_torch(half, got, unrounded):
    expected = unrounded.to(half)
    got = got[..., :-1]  # the last column's right neighbour lies outside
    nan = unrounded.isnan()
    assert nan.any() and torch.equal(got.isnan(), nan)
    # bfloat16's subnormal columns: the half GEMMs read them as zero (oneDNN's, and ATen's portable one).
    flushed = (expected != 0) & (expected.abs() < torch.finfo(half).tiny) if half == torch.bfloat16 else nan & ~nan
    exact = ~nan & ~flushed
    assert torch.equal(got[exact], expected[exact])
    assert ((got[flushed] == 0) | (got[flushed] == expected[flushed])).all()
    bits = unrounded.view(torch.int32)
    if half == torch.bfloat16:  # ties to even happened: the 16 bits dropped were exactly 0x8000
        assert ((bits & 0xFFFF) == 0x8000).any()
        assert (got[nan].view(torch.int16) == 0x7FC0).all()  # c10::BFloat16's NaN, whatever the sign
    # subnormals happened
    assert ((expected != 0) & (expected.abs() < torch.finfo(half).tiny)).any()


@HALF_TYPES
@pytest.mark.parametrize("channels, groups", [(72, 1), (44, 1), (12, 1), (8, 1), (10, 1), (10, 5)])
def test_native_columns_are_rounded_as_torch_rounds(half, channels, groups):
    """Each column value is sampled in float32 and rounded once to the half type as it is written (16, 8 or 4
    channels at a time in registers, the rest one by one): exactly torch's rounding of the same float32 value
    (rounding_case). 72 channels: bfloat16 in pairs of 32 (even and odd channels apart, where the library has
    AVX512-BF16; the NaN masks' points value by value) and a block of 8; 44: two blocks of 16, one of 8 and one of
    4; 12 and 8: the loops of those widths fixed at compile time; 10, in one weight group and in five (pieces of 2):
    bfloat16 as one vector per point where the library has AVX512-BF16 (sampling_passes.cpp's GroupVector). The
    tiled forward."""
    (x, offset, weight, mask), unrounded = rounding_case(half, channels, groups=groups)
    with half_gemm_path("portable"):
        got = ours(x, offset, weight, mask=mask)  # (groups: the weight's shape)
    assert_rounded_as_torch(half, got, unrounded)


@HALF_TYPES
def test_native_columns_are_rounded_as_torch_rounds_on_the_driver(half):
    """The same on the driver's path (its columns filled in the half type for its GEMM in the half type): 2,050
    channels, too many for the tiled forward's tiles and too few rows (15) for its whole-image tiles."""
    (x, offset, weight, mask), unrounded = rounding_case(half, 2050)
    x, mask, unrounded = x[..., :3, :5], mask[..., :3, :5], unrounded[..., :3, :4]
    with half_gemm_path("portable"):
        got = ours(x, offset[..., :3, :5], weight, mask=mask)
    assert_rounded_as_torch(half, got, unrounded)


@HALF_TYPES
def test_native_backward_of_a_large_output(half):
    """A backward with more output pixels (520 x 520) than one scratch buffer holds a packed panel of: the columns
    are packed 512 pixels at a time."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 520, 520, generator=g).to(half).requires_grad_()
    offset = torch.randn(1, 18, 520, 520, generator=g).to(half)
    weight = torch.randn(3, 2, 3, 3, generator=g).to(half).requires_grad_()
    with half_gemm_path("portable"):
        out = ours(x, offset, weight, padding=1)
        grad_x, grad_w = torch.autograd.grad(out, (x, weight), torch.ones_like(out))
    with half_gemm_path("float32"):
        w_f = weight.detach().requires_grad_()
        out_f = ours(x.detach(), offset, w_f, padding=1)
        (grad_w_f,) = torch.autograd.grad(out_f, w_f, torch.ones_like(out_f))
        w_abs = weight.detach().requires_grad_()
        out_abs = ours(x.detach().abs(), offset, w_abs, padding=1)
        (sum_abs,) = torch.autograd.grad(out_abs, w_abs, torch.ones_like(out_abs))  # sum of |column| per weight
    assert torch.isfinite(grad_w).all() and torch.isfinite(grad_x).all()
    # The native GEMMs sum the columns rounded to the half type (u each) in float32 (n terms): off by at most
    # (u + n 2**-24) of the sum of |column|, and both results are rounded once more to the half type.
    u, n = torch.finfo(half).eps / 2, 520 * 520
    bound = (u + n * 2**-24) * sum_abs.float() + u * (grad_w.float().abs() + grad_w_f.float().abs())
    assert ((grad_w.float() - grad_w_f.float()).abs() <= bound).all()
