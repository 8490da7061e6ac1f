"""The CUDA kernels, executed on the CPU by the CUDA simulation (deform_conv.testing), against the float64
reference: every dtype, the awkward geometry, groups and offset groups that do and do not nest, the lane and
vector splits, batch 0 and a batch of two chunks, non-finite offsets and masks, both index paths, blocks in a
shuffled order, and the deterministic backward. Run under AddressSanitizer + UBSan by scripts/sanitize-tests.

On a GPU, test_cuda.py runs the same kernels for real; this file is what runs them everywhere else."""

from __future__ import annotations

import subprocess
import sys
from typing import List, Optional

import pytest
import torch

from helpers.deform_conv2d import (Case, assert_all_close, assert_all_close_nonfinite, make_case, output_and_grads,
                                   with_special_offsets)
from helpers.simulation import deterministic_algorithms, simulation_options

import deform_conv
from deform_conv import testing

reference = deform_conv.deform_conv2d_reference


@pytest.fixture(scope="module", autouse=True)
def simulation():
    testing.load_cuda_simulation()
    yield
    testing.load_cuda_simulation()  # the defaults again for whatever runs next


def simulated(case: Case, tensors: Optional[List[torch.Tensor]] = None, seed: int = 1,
              border_gradient: str = "torchvision") -> List[torch.Tensor]:
    """[output, d/d each tensor of the case] from the simulated CUDA ops, for the grad_output output_and_grads
    draws (the same values, so the two compare directly)."""
    tensors = tensors or case.tensors()
    it = iter(tensors)
    input, offset, weight = next(it), next(it), next(it)
    bias = next(it) if case.bias is not None else None
    mask = next(it) if case.mask is not None else None
    geometry = [list(case.stride), list(case.padding), list(case.dilation)]
    out = torch.ops.deform_conv_sim.deform_conv2d(input, offset, weight, mask, bias, *geometry, border_gradient)
    grad_output = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    grad_output = grad_output.to(out.dtype)
    grad_input, grad_offset, grad_weight, grad_mask, grad_bias = torch.ops.deform_conv_sim.deform_conv2d_backward(
        grad_output, input, offset, weight, mask, *geometry, bias is not None, border_gradient)
    grads = [grad_input, grad_offset, grad_weight]
    if bias is not None:
        grads.append(grad_bias)
    if mask is not None:
        grads.append(grad_mask)
    return [out, *grads]


# Each geometry names what it exercises in the kernels (cuda/deform_conv_cuda.cu): the lane group a point gets
# (the smallest power of two covering its offset group's channel vectors, at most 32), whether 16-byte vectors fit
# (channels per offset group and per weight group multiples of 16 / element size), and the GEMM split.
GEOMETRIES = {
    # kernel 3x2, stride (2, 1), padding (1, 0), dilation (2, 1); 6 channels in 2 weight groups and 3 offset
    # groups that do not nest; 2 channels a point: 2 lanes, scalar loads (and for fp64, weight groups of 3).
    "awkward": dict(),
    # one offset group of 32 channels spanning both weight groups (16 channels each): wide vectors in every dtype.
    "wide_vectors": dict(in_channels=32, out_channels=6, groups=2, offset_groups=1, size=(9, 7)),
    # offset groups of one channel each: one thread a point.
    "one_channel_per_point": dict(in_channels=5, out_channels=3, groups=1, offset_groups=5, kernel=(2, 2)),
    # 96 channels in one offset group: a full warp a point, several vectors a lane; one GEMM a chunk.
    "full_warp": dict(in_channels=96, out_channels=4, groups=1, offset_groups=1, size=(6, 5), kernel=(3, 3),
                      stride=(1, 1), padding=(1, 1), dilation=(1, 1)),
    # weight groups nested in the offset groups: 4 weight groups of 3 channels, 2 offset groups of 6.
    "nested": dict(in_channels=12, out_channels=8, groups=4, offset_groups=2, kernel=(1, 3), stride=(1, 2),
                   padding=(0, 2), dilation=(1, 2)),
    # depthwise (groups == in_channels == out_channels): no columns, no GEMMs; 2 channels a point.
    "depthwise": dict(in_channels=6, out_channels=6, groups=6, offset_groups=3),
    # depthwise with 16 channels an offset group: wide vectors.
    "depthwise_wide": dict(in_channels=32, out_channels=32, groups=32, offset_groups=2, size=(7, 9)),
}


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_matches_the_reference(dtype, geometry):
    case = make_case(dtype, **GEOMETRIES[geometry])
    assert_all_close(simulated(case), output_and_grads(reference, case), dtype)


@pytest.mark.parametrize("geometry", ["awkward", "depthwise"])
@pytest.mark.parametrize("with_mask, with_bias", [(True, False), (False, True), (False, False)],
                         ids=["no_bias", "no_mask", "neither"])
def test_without_mask_or_bias(dtype, geometry, with_mask, with_bias):
    case = make_case(dtype, with_mask=with_mask, with_bias=with_bias, **GEOMETRIES[geometry])
    assert_all_close(simulated(case), output_and_grads(reference, case), dtype)


@pytest.mark.parametrize("border", ["torchvision", "mmcv"])
@pytest.mark.parametrize("geometry", ["awkward", "depthwise"])
def test_border_gradient_conventions(border, geometry):
    """Zero offsets, stride 1, padding 1: the first row's and column's taps sit exactly at -1, where the two
    conventions' offset gradients differ (test_border_gradient.py)."""
    case = make_case(torch.float64, **{**GEOMETRIES[geometry], "stride": (1, 1), "padding": (1, 1),
                                       "dilation": (1, 1), "kernel": (3, 3)}, offset_scale=0.0)
    expected = output_and_grads(lambda *a: reference(*a, border_gradient=border), case)
    assert_all_close(simulated(case, border_gradient=border), expected, torch.float64)


@pytest.mark.repeats_under_sanitizers  # (the deterministic 64-bit test below runs there)
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_64_bit_index_path(dtype, geometry):
    case = make_case(dtype, **GEOMETRIES[geometry])
    expected = output_and_grads(reference, case)
    before = testing.simulation_statistics()
    with simulation_options(int32_limit=1):
        results = simulated(case)
    after = testing.simulation_statistics()
    assert after.int64_launches - before.int64_launches == 4  # forward: fill; backward: fill, coordinates, input
    assert after.int32_launches == before.int32_launches
    assert_all_close(results, expected, dtype)


def test_the_default_limit_takes_the_32_bit_path():
    before = testing.simulation_statistics()
    simulated(make_case(torch.float32))
    after = testing.simulation_statistics()
    assert after.int32_launches - before.int32_launches == 4 and after.int64_launches == before.int64_launches


# Half types against float64 on the same rounded inputs (rounding may move a point across a kink of the
# interpolant, so the reference must see the rounded offsets too). What is left: the columns (and their gradient)
# rounded once to the half type, each result rounded once, float32 sums in between. Relative to the result's
# largest magnitude that is a few units of the type's precision: 2^-11 = 4.9e-4 (fp16), 2^-8 = 3.9e-3 (bf16);
# 8 units allows for the sums of rounded columns without reaching a wrong index (off by a pixel or a channel:
# errors of order 1).
HALF_TOLERANCE = {torch.float16: 8 * 2.0**-11, torch.bfloat16: 8 * 2.0**-8}


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_half_types(half, geometry):
    case = make_case(torch.float64, offset_scale=1.0, **GEOMETRIES[geometry])
    halves = [t.to(half) for t in case.tensors()]
    expected = output_and_grads(reference, case, [t.double() for t in halves])
    results = simulated(case, halves)
    names = ["output", "input", "offset", "weight", "bias", "mask"]
    for name, got, want in zip(names, results, expected):
        assert got.dtype == half, name
        scale = want.abs().max().clamp_min(1)
        torch.testing.assert_close(got.double() / scale, want / scale, rtol=0, atol=HALF_TOLERANCE[half], msg=name)


def test_batch_of_zero_images():
    case = make_case(torch.float64, batch=0)
    results = simulated(case)
    expected = output_and_grads(reference, case)
    assert [r.shape for r in results] == [e.shape for e in expected]
    assert_all_close(results, expected, torch.float64)


def test_batch_of_two_chunks():
    """At most 32 images share a column buffer (columns_driver.cpp): 35 images take two chunks, the second
    starting at image 32, whose offsets into every tensor the kernels must get right."""
    case = make_case(torch.float64, batch=35, size=(5, 4))
    assert_all_close(simulated(case), output_and_grads(reference, case), torch.float64)


@pytest.mark.parametrize("geometry", ["awkward", "depthwise"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_one_image_a_chunk(geometry, deterministic):
    """A budget smaller than one image's columns (and than one image's keys in the deterministic mode): every
    image is a chunk (and a run of the gather) of its own."""
    case = make_case(torch.float64, batch=4, **GEOMETRIES[geometry])
    with simulation_options(budget_bytes=1):
        with deterministic_algorithms(deterministic):
            results = simulated(case)
    assert_all_close(results, output_and_grads(reference, case), torch.float64)


@pytest.mark.parametrize("geometry", ["awkward", "depthwise"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_non_finite_offsets_and_masks(dtype, geometry, deterministic):
    case = make_case(dtype, **GEOMETRIES[geometry])
    with_special_offsets(case, dtype)
    case.mask[2, 4, 1, 1] = float("inf")
    case.mask[0, 2, 2, 2] = float("nan")
    expected = output_and_grads(deform_conv.deform_conv2d, case)  # the CPU kernels, tested against the reference
    with deterministic_algorithms(deterministic):
        results = simulated(case)
    assert_all_close_nonfinite(results, expected, dtype, same_nan=False)


@pytest.mark.repeats_under_sanitizers  # block order does not change which addresses a kernel touches
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_shuffled_block_order(geometry):
    case = make_case(torch.float64, **GEOMETRIES[geometry])
    with simulation_options(shuffle_blocks=True, seed=7):
        results = simulated(case)
    assert_all_close(results, output_and_grads(reference, case), torch.float64)


@pytest.mark.repeats_under_sanitizers  # (the deterministic tests of chunks, runs and non-finite inputs run there)
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_deterministic_backward_matches_the_reference(dtype, geometry):
    case = make_case(dtype, **GEOMETRIES[geometry])
    with deterministic_algorithms(True):
        results = simulated(case)
    assert_all_close(results, output_and_grads(reference, case), dtype)


def _grad_input_in_shuffled_runs(case: Case, deterministic: bool, seeds) -> List[torch.Tensor]:
    runs = []
    for seed in seeds:
        with simulation_options(shuffle_blocks=True, seed=seed), deterministic_algorithms(deterministic):
            runs.append(simulated(case)[1])
    return runs


# Many points read each pixel (3x3 kernel, stride 1, offsets of about a pixel), so the order in which the input
# gradient's terms are added shows in the last bits of a float32 sum.
OVERLAPPING = dict(batch=2, in_channels=8, out_channels=4, size=(12, 11), kernel=(3, 3), stride=(1, 1),
                   padding=(1, 1), dilation=(1, 1), groups=1, offset_groups=1, offset_scale=1.0)


def test_deterministic_backward_has_the_same_bits_in_any_block_order():
    case = make_case(torch.float32, **OVERLAPPING)
    first, *others = _grad_input_in_shuffled_runs(case, deterministic=True, seeds=[1, 2, 3])
    for other in others:
        assert torch.equal(first, other)


def test_shuffled_blocks_change_the_order_of_the_atomic_sums():
    """The shuffle is real: with atomics, the input gradient's last bits follow the block order (which is why the
    deterministic mode does not use them)."""
    case = make_case(torch.float32, **OVERLAPPING)
    first, *others = _grad_input_in_shuffled_runs(case, deterministic=False, seeds=[1, 2, 3])
    assert any(not torch.equal(first, other) for other in others)
    for other in others:
        torch.testing.assert_close(other, first, rtol=1e-5, atol=1e-5)


@pytest.mark.repeats_under_sanitizers  # the same addresses as one pass, in another order
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_grid_stride_loops(geometry, deterministic):
    """One or two blocks a launch: every kernel's grid-stride loop runs many times (on a GPU the grid covers the
    work in one pass unless it is larger than 2^28 threads)."""
    case = make_case(torch.float64, **GEOMETRIES[geometry])
    expected = output_and_grads(reference, case)
    for max_blocks in (1, 2):
        with simulation_options(max_blocks=max_blocks):
            with deterministic_algorithms(deterministic):
                results = simulated(case)
        assert_all_close(results, expected, torch.float64)


def test_gather_runs_inside_a_chunk():
    """A budget of two images' columns but less than one image's keys: the deterministic gather splits each chunk
    of two images into runs of one, the second starting one image into the chunk's columns."""
    case = make_case(torch.float64, batch=5, **GEOMETRIES["one_channel_per_point"])
    _, channels, height, width = case.input.shape
    _, _, out_h, out_w = case.offset.shape
    taps, offset_groups = 4, 5
    columns_per_image = out_h * out_w * taps * channels * 8
    keys_per_image = 4 * out_h * out_w * offset_groups * taps * 48 + offset_groups * height * width * 16
    assert keys_per_image > 2 * columns_per_image  # so the run is one image while the chunk is two
    with simulation_options(budget_bytes=2 * columns_per_image):
        with deterministic_algorithms(True):
            results = simulated(case)
    assert_all_close(results, output_and_grads(reference, case), torch.float64)


@pytest.mark.parametrize("geometry", ["awkward", "depthwise", "wide_vectors"])
def test_deterministic_backward_on_the_64_bit_path(geometry):
    case = make_case(torch.float64, **GEOMETRIES[geometry])
    with simulation_options(int32_limit=1):
        with deterministic_algorithms(True):
            results = simulated(case)
    assert_all_close(results, output_and_grads(reference, case), torch.float64)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("geometry", ["wide_vectors", "depthwise_wide"])
def test_half_types_deterministic_bits_in_any_block_order(half, geometry):
    case = make_case(torch.float64, offset_scale=1.0, **GEOMETRIES[geometry])
    halves = [t.to(half) for t in case.tensors()]
    runs = []
    for seed in (1, 2):
        with simulation_options(shuffle_blocks=True, seed=seed), deterministic_algorithms(True):
            runs.append(simulated(case, halves))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def channels_last_at_an_odd_address(t: torch.Tensor) -> torch.Tensor:
    """t's values in a channels-last tensor whose data starts one element past an aligned address: the kernels
    must fall back from 16-byte vectors."""
    b, c, h, w = t.shape
    storage = torch.empty(1 + t.numel(), dtype=t.dtype)
    shifted = storage[1:].view(b, h, w, c).permute(0, 3, 1, 2)
    shifted.copy_(t)
    assert shifted.is_contiguous(memory_format=torch.channels_last) and shifted.data_ptr() % 16 != 0
    return shifted


@pytest.mark.parametrize("geometry", ["wide_vectors", "depthwise_wide"])
def test_misaligned_input_takes_scalar_loads(geometry):
    case = make_case(torch.float32, **GEOMETRIES[geometry])
    tensors = case.tensors()
    tensors[0] = channels_last_at_an_odd_address(tensors[0])
    assert_all_close(simulated(case, tensors), output_and_grads(reference, case), torch.float32)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_blocks_is_checked(value):
    with pytest.raises(ValueError, match=r"max_blocks must be a positive int or None, got"):
        testing.load_cuda_simulation(max_blocks=value)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_budget_bytes_is_checked(value):
    with pytest.raises(ValueError, match=r"budget_bytes must be a positive int or None, got"):
        testing.load_cuda_simulation(budget_bytes=value)


def test_statistics_count_the_work():
    before = testing.simulation_statistics()
    simulated(make_case(torch.float32))
    after = testing.simulation_statistics()
    assert after.launches - before.launches == 4  # forward: fill; backward: fill, coordinates, input
    assert after.shuffles > before.shuffles      # the coordinate kernel's butterfly ran
    assert after.threads - before.threads >= 4 * 256


@pytest.mark.parametrize("value", [0, -1, 2**30 + 1, 1.5, True])
def test_int32_limit_is_checked(value):
    with pytest.raises(ValueError, match=r"int32_limit must be an int in \[1, 2\*\*30\] or None, got"):
        testing.load_cuda_simulation(int32_limit=value)


def test_the_simulation_is_not_loaded_by_a_plain_import():
    script = ("import deform_conv, torch\n"
              "try:\n    torch.ops.deform_conv_sim.deform_conv2d\nexcept (AttributeError, RuntimeError):\n"
              "    print('not loaded')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "not loaded"
