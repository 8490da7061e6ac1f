"""Multi-scale deformable attention's CUDA kernels, executed on the CPU by the CUDA simulation (deform_conv.testing),
against the float64 reference: every dtype, lane splits from 1 to a whole warp and beyond, awkward levels, batch 0,
non-finite inputs, both index paths, shuffled block orders, grid-stride loops, the deterministic backward and its
runs of images, and the kernels' own check of levels they cannot trust. Run under AddressSanitizer + UBSan by
scripts/sanitize-tests."""

from __future__ import annotations

from typing import List

import pytest
import torch

from helpers.ms_deform_attn_cuda import (NAMES, SHAPES, TOLERANCES, Attention, grad_output_for, make_attention,
                                         referenced)
from helpers.simulation import deterministic_algorithms, simulation_options

from deform_conv import testing

sim = torch.ops.deform_conv_sim


@pytest.fixture(scope="module", autouse=True)
def simulation():
    testing.load_cuda_simulation()
    yield
    testing.load_cuda_simulation()  # the defaults again for whatever runs next


def simulated(a: Attention, grad_output: torch.Tensor) -> List[torch.Tensor]:
    out = sim.ms_deform_attn(*a)
    return [out, *sim.ms_deform_attn_backward(grad_output.to(out.dtype), *a)]


def assert_matches_reference(a: Attention, tolerance: float = None) -> None:
    grad_output = grad_output_for(a)
    actual, expected = simulated(a, grad_output), referenced(a, grad_output)
    tol = TOLERANCES[a.value.dtype] if tolerance is None else tolerance
    for name, x, e in zip(NAMES, actual, expected):
        torch.testing.assert_close(x.double(), e, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_matches_the_reference(shape, deterministic, dtype):
    with deterministic_algorithms(deterministic):
        assert_matches_reference(make_attention(**SHAPES[shape], dtype=dtype))


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", ["eight_lanes_five_channels", "a_warp"])
def test_half_types(half, shape):
    """Against the reference run on the same (rounded) inputs: the kernels accumulate in float32 and round each
    result once, so the error is the final rounding (half an ulp of the type, relative) plus float32's, on sums
    whose terms are O(1) (values ~ N(0, 1), weights in [0, 1], up to 8 terms): 2 ulps of the type, relative to
    the largest result, bounds it with room for the locations' own rounding."""
    a = make_attention(**SHAPES[shape], dtype=half)
    grad_output = grad_output_for(a).to(half).double()
    eps = torch.finfo(half).eps
    for name, x, e in zip(NAMES, simulated(a, grad_output), referenced(a, grad_output)):
        assert x.dtype == half, name
        scale = e.abs().max().item()
        torch.testing.assert_close(x.double(), e, rtol=2 * eps, atol=2 * eps * scale, msg=lambda m: f"{name}: {m}")


def test_the_default_limit_takes_the_32_bit_path():
    a = make_attention(**SHAPES["eight_lanes_five_channels"])
    before = testing.simulation_statistics()
    simulated(a, grad_output_for(a))
    after = testing.simulation_statistics()
    assert after.int32_launches > before.int32_launches and after.int64_launches == before.int64_launches


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("shape", ["eight_lanes_five_channels", "a_warp"])
def test_64_bit_index_path(shape, deterministic):
    with simulation_options(int32_limit=1), deterministic_algorithms(deterministic):
        before = testing.simulation_statistics()
        assert_matches_reference(make_attention(**SHAPES[shape]))
        after = testing.simulation_statistics()
    assert after.int64_launches > before.int64_launches and after.int32_launches == before.int32_launches


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("max_blocks", [1, 2])
@pytest.mark.parametrize("shape", ["one_lane", "a_warp", "odd_many_queries"])
def test_grid_stride_loops(shape, max_blocks, deterministic):
    with simulation_options(max_blocks=max_blocks), deterministic_algorithms(deterministic):
        assert_matches_reference(make_attention(**SHAPES[shape]))


@pytest.mark.parametrize("budget_bytes", [1, 70_000])
def test_deterministic_backward_in_runs_of_images(budget_bytes):
    """A small budget splits the deterministic gather into runs of one (or two) images of a batch of three."""
    a = make_attention(**SHAPES["eight_lanes_five_channels"] | dict(batch=3))
    with simulation_options(budget_bytes=budget_bytes), deterministic_algorithms(True):
        before = testing.simulation_statistics()
        assert_matches_reference(a)
        launches = testing.simulation_statistics().launches - before.launches
    # forward, backward, then 2 launches (keys, gather) a run: 3 runs of 1 image, or 2 runs (2 + 1) at 70 kB
    assert launches == 2 + 2 * (3 if budget_bytes == 1 else 2)


def test_deterministic_backward_has_the_same_bits_in_any_block_order():
    a = make_attention(**SHAPES["odd_many_queries"] | dict(batch=2), dtype=torch.float32)
    grad_output = grad_output_for(a)
    with deterministic_algorithms(True):
        runs = []
        for seed in range(3):
            with simulation_options(shuffle_blocks=True, seed=seed, max_blocks=4):
                runs.append(simulated(a, grad_output))
    for run in runs[1:]:
        for name, x, y in zip(NAMES, runs[0], run):
            assert torch.equal(x, y), name


def test_shuffled_blocks_change_the_order_of_the_atomic_sums():
    """The atomic path's value gradient depends on the block order (which the deterministic test above would
    otherwise not show to matter): many points share few pixels, in float32."""
    a = make_attention([(2, 2)], batch=1, heads=1, channels=1, queries=600, points=4, dtype=torch.float32)
    grad_output = grad_output_for(a)
    results = []
    for seed in range(4):
        with simulation_options(shuffle_blocks=True, seed=seed):
            results.append(simulated(a, grad_output)[1])
    assert any(not torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_batch_of_zero_images_and_zero_queries(deterministic):
    with deterministic_algorithms(deterministic):
        for a in (make_attention([(3, 2)], batch=0), make_attention([(3, 2)], queries=0)):
            out, grad_value, grad_locations, grad_weights = simulated(a, grad_output_for(a))
            assert out.shape == (a.value.shape[0], a.sampling_locations.shape[1], 15)
            assert torch.equal(grad_value, torch.zeros_like(a.value))
            assert grad_locations.shape == a.sampling_locations.shape
            assert grad_weights.shape == a.attention_weights.shape


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_non_finite_locations_and_weights_as_the_cpu_kernels(deterministic):
    """NaN and +-inf locations, and NaN and inf weights, give what the CPU kernels give (whose semantics
    test_ms_deform_attn.py checks): the same non-finite entries, the same finite values."""
    a = make_attention(**SHAPES["eight_lanes_five_channels"])
    locations, weights = a.sampling_locations.clone(), a.attention_weights.clone()
    locations[0, 0, 0, 0, 0, 0] = float("nan")
    locations[0, 1, 1, 1, 0, 1] = float("inf")
    locations[1, 2, 2, 2, 1, 0] = -float("inf")
    locations[1, 3, 0, 3, 0] = 1e30
    weights[0, 4, 1, 0, 1] = float("nan")
    weights[1, 5, 2, 1, 0] = float("inf")
    weights[1, 1, 1, 1, 0] = float("inf")
    locations[1, 1, 1, 1, 0] = 5.0  # an infinite weight on a point outside its level
    a = a.with_floats(a.value, locations, weights)
    grad_output = grad_output_for(a)
    with deterministic_algorithms(deterministic):
        actual = simulated(a, grad_output)
    cpu = torch.ops.deform_conv
    expected = [cpu.ms_deform_attn(*a), *cpu.ms_deform_attn_backward(grad_output, *a)]
    for name, x, e in zip(NAMES, actual, expected):
        assert torch.equal(torch.isnan(x), torch.isnan(e)), f"{name}: NaN in different places"
        assert torch.equal(torch.isinf(x), torch.isinf(e)), f"{name}: inf in different places"
        finite = torch.isfinite(e)
        torch.testing.assert_close(x[finite], e[finite], rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    assert torch.isnan(actual[0]).any() and torch.isnan(actual[2]).any()  # the NaN location did propagate


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_levels_that_do_not_fit_sample_nan_and_read_nothing(deterministic):
    """On a GPU the host does not read spatial_shapes (a device synchronisation a call), so the kernels check each
    level themselves: one whose pixels would run past value's samples NaN and reads nothing (the sanitizer run
    checks the nothing); the others are unaffected. (With the host code's device-side check off, which stops such
    a call first: test_inconsistent_levels_are_refused_on_the_device.)"""
    a = make_attention([(3, 4), (2, 2)])
    starts = a.level_start_index.clone()
    starts[1] = 13  # 13 + 2 * 2 > 16 pixels
    bad = a._replace(level_start_index=starts)
    grad_output = grad_output_for(a)
    good = a._replace(spatial_shapes=a.spatial_shapes[:1], level_start_index=a.level_start_index[:1],
                      value=a.value[:, :12], sampling_locations=a.sampling_locations[:, :, :, :1].contiguous(),
                      attention_weights=a.attention_weights[:, :, :, :1].contiguous())
    with simulation_options(level_checks=False), deterministic_algorithms(deterministic):
        out, grad_value, grad_locations, grad_weights = simulated(bad, grad_output)
        expected = sim.ms_deform_attn_backward(grad_output, *good)
    assert torch.isnan(out).all()  # every head samples level 1
    assert torch.isnan(grad_locations[:, :, :, 1]).all() and torch.isnan(grad_weights[:, :, :, 1]).all()
    torch.testing.assert_close(grad_value[:, :12], expected[0], rtol=0, atol=0)  # level 0 alone, the same bits
    assert torch.equal(grad_value[:, 12:], torch.zeros_like(grad_value[:, 12:]))
    torch.testing.assert_close(grad_locations[:, :, :, :1], expected[1], rtol=0, atol=0)


@pytest.mark.parametrize("case", ["starts all 0", "overlapping levels", "pixels beyond the levels", "level 0x4",
                                  "a level whose pixel count wraps around int64"])
def test_inconsistent_levels_are_refused_on_the_device(case):
    """Level metadata the GPU path cannot read on the host (it would synchronise) is checked on the device
    (torch._assert_async, which fails at the next synchronisation on a GPU and at once in the simulation), forward
    and backward: levels that fit in value but contradict each other would otherwise sample the wrong pixels
    without a word."""
    a = make_attention([(3, 4), (2, 2)])  # 16 pixels, levels starting at 0 and 12
    shapes, starts, value = a.spatial_shapes.clone(), a.level_start_index.clone(), a.value
    if case == "starts all 0":
        starts[:] = 0
    elif case == "overlapping levels":
        starts[1] = 10
    elif case == "pixels beyond the levels":
        value = torch.cat([value, value[:, :3]], 1)  # 19 pixels, the levels cover 16
    elif case == "level 0x4":
        shapes[0] = torch.tensor([0, 4])
    else:  # 2^32 x 2^32 is 0 in int64 arithmetic: level 1 would start at 0 as the sums say
        shapes[0] = torch.tensor([2**32, 2**32])
        starts[1] = 0
    bad = a._replace(spatial_shapes=shapes, level_start_index=starts, value=value)
    with pytest.raises(RuntimeError, match="checked on the device"):
        sim.ms_deform_attn(*bad)
    with pytest.raises(RuntimeError, match="checked on the device"):
        sim.ms_deform_attn_backward(grad_output_for(a), *bad)


def test_non_contiguous_inputs():
    a = make_attention(**SHAPES["eight_lanes_five_channels"])
    value = a.value.transpose(2, 3).contiguous().transpose(2, 3)
    locations = torch.cat([a.sampling_locations, torch.zeros_like(a.sampling_locations)], dim=-1)[..., :2]
    weights = a.attention_weights.transpose(0, 1).contiguous().transpose(0, 1)
    assert not (value.is_contiguous() or locations.is_contiguous() or weights.is_contiguous())
    assert_matches_reference(a.with_floats(value, locations, weights))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_float32_locations_beside_a_half_value_run_the_family_kernels(dtype, deterministic):
    """The CUDA backend's mixed-dtype path (float32_points: float32 locations and weights beside a half value, on
    the family's sampled_sum kernels) launches those kernels and computes what the CPU op computes on the same
    tensors (each sums in float32, in its own order: to a few float32 ulps before the final rounding)."""
    a = make_attention([(3, 4), (2, 2)])
    mixed = a._replace(value=a.value.to(dtype), sampling_locations=a.sampling_locations.float(),
                       attention_weights=a.attention_weights.float())
    grad_output = grad_output_for(a).to(dtype)
    before = testing.simulation_statistics().launches
    with deterministic_algorithms(deterministic):
        actual = [sim.ms_deform_attn(*mixed), *sim.ms_deform_attn_backward(grad_output, *mixed)]
    assert testing.simulation_statistics().launches - before >= (4 if deterministic else 2)
    expected = [torch.ops.deform_conv.ms_deform_attn(*mixed),
                *torch.ops.deform_conv.ms_deform_attn_backward(grad_output, *mixed)]
    assert [t.dtype for t in actual] == [dtype, dtype, torch.float32, torch.float32]
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10  # one ulp of the half type: a rounding may tip
    for name, x, e in zip(NAMES, actual, expected):
        scale = float(e.double().abs().max()) + 1
        torch.testing.assert_close(x.double(), e.double(), rtol=ulp if x.dtype == dtype else 1e-5,
                                   atol=(ulp if x.dtype == dtype else 1e-5) * scale, msg=lambda m: f"{name}: {m}")
