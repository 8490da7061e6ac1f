"""The family's CUDA kernels (csrc/sampled_sum/cuda/), executed on the CPU by the CUDA simulation
(deform_conv.testing), against the CPU ops on the same arguments: dcnv3, dcnv4 and flash_deform_attn, forward and
backward, in every dtype; the default configuration (32-bit indices), the 64-bit index path, blocks in a shuffled
order, and the deterministic gather of the value's gradient (the same bits in any block order)."""

from __future__ import annotations

import pytest
import torch

from helpers.common import TOLERANCES
from helpers.family import GRAD_NAMES, Case, assert_identical, make_case, op_results
from helpers.simulation import deterministic_algorithms, simulation_options

from deform_conv import testing

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp64", "fp32", "fp16", "bf16"]

# Each names what it exercises: the lanes a point gets follow the channels a group (5, 71, 1).
CASES = {
    "dcnv3_awkward": ("dcnv3", dict()),
    "dcnv3_K25_c71": ("dcnv3", dict(kernel=5, stride=1, padding=2, dilation=1, group=1, group_channels=71,
                                    size=(5, 4), batch=1)),
    "dcnv3_c1_remove_center": ("dcnv3", dict(kernel=3, stride=1, padding=1, group=3, group_channels=1,
                                             remove_center=True, offset_scale=2.0, far_fraction=0.2)),
    "dcnv4_softmax_padded": ("dcnv4", dict(softmax=True, extra_channels=3, kernel=(2, 3), stride=1, padding=(0, 1),
                                           dilation=(1, 2), group=1, group_channels=3, offset_scale=0.5)),
    "dcnv4_mask": ("dcnv4", dict()),
    "flash_3_levels": ("flash_deform_attn", dict()),
    "flash_1_level_1_point": ("flash_deform_attn", dict(levels=((6, 5),), n_points=1, channels=71, group=1)),
}
CONFIG_CASES = ["dcnv3_awkward", "dcnv4_softmax_padded", "flash_3_levels"]

sim = torch.ops.deform_conv_sim
cpu = torch.ops.deform_conv


@pytest.fixture(scope="module", autouse=True)
def simulation():
    """The simulation's statistics when this module started."""
    testing.load_cuda_simulation()  # built once (cached), as the other simulation tests do
    yield testing.simulation_statistics()
    testing.load_cuda_simulation()  # the defaults again for whatever runs next


def case_for(name: str, dtype: torch.dtype) -> Case:
    op, kwargs = CASES[name]
    return make_case(op, dtype, **kwargs)


def assert_matches_cpu(case: Case, results=None) -> None:
    """The simulated ops' output and gradients against the CPU ops'. They sum in other orders: in float64 and
    float32 within the dtype's tolerance (helpers/common.py). In the half types both compute in float32 and round
    each result once, so a float32 difference can tip a rounding: one unit of the type, at most eps relative to
    the largest result (the gradients of points are the same float32 values rounded once too)."""
    actual = op_results(sim, case) if results is None else results
    expected = op_results(cpu, case)
    dtype = case.value.dtype
    for name, a, e in zip(GRAD_NAMES[case.op], actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        if dtype in TOLERANCES:
            rtol, atol = TOLERANCES[dtype]
        else:
            rtol = torch.finfo(e.dtype).eps if e.dtype != torch.float32 else torch.finfo(dtype).eps
            atol = rtol * (float(e.abs().max()) if e.numel() else 0.0)
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_default_configuration_matches_the_cpu_ops(name, dtype):
    case = case_for(name, dtype)
    before = testing.simulation_statistics()
    assert_matches_cpu(case)
    after = testing.simulation_statistics()
    assert after.int32_launches > before.int32_launches and after.int64_launches == before.int64_launches


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", CONFIG_CASES)
def test_float32_points_beside_a_half_value(name, dtype):
    """float32 points beside a half value (the family's mixed case); float32 and float64 values repeat the default
    test's (their points have the value's dtype)."""
    points_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    assert_matches_cpu(case_for(name, torch.float64).to(dtype, points_dtype))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", CONFIG_CASES)
def test_64_bit_index_path(name, dtype, deterministic):
    case = case_for(name, dtype)
    with simulation_options(int32_limit=1), deterministic_algorithms(deterministic):
        before = testing.simulation_statistics()
        results = op_results(sim, case)
        after = testing.simulation_statistics()
    assert after.int64_launches > before.int64_launches and after.int32_launches == before.int32_launches
    assert_matches_cpu(case, results)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", CONFIG_CASES)
def test_shuffled_blocks(name, dtype):
    case = case_for(name, dtype)
    with simulation_options(shuffle_blocks=True, seed=3):
        results = op_results(sim, case)
    assert_matches_cpu(case, results)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", CONFIG_CASES)
def test_deterministic_gather_has_the_same_bits_in_any_block_order(name, dtype):
    """Under torch.use_deterministic_algorithms(True) the value's gradient is a gather in a fixed order: two runs
    with the blocks (and warps) shuffled by different seeds give the same bits, close to the CPU ops."""
    case = case_for(name, dtype)
    runs = []
    with deterministic_algorithms(True):
        for seed in (1, 2):
            with simulation_options(shuffle_blocks=True, seed=seed, max_blocks=3):
                before = testing.simulation_statistics().launches
                runs.append(op_results(sim, case))
                # forward, backward, then the gather's 2 launches (keys, gather) for the one run of images
                assert testing.simulation_statistics().launches - before == 4
    assert_identical(runs[1], runs[0], GRAD_NAMES[case.op])
    assert_matches_cpu(case, runs[0])


@pytest.mark.parametrize("name", CONFIG_CASES)
def test_batch_zero_and_no_queries(name):
    op, kwargs = CASES[name]
    variants = [dict(batch=0)] + ([dict(queries=0)] if op == "flash_deform_attn" else [])
    for deterministic in (False, True):
        with deterministic_algorithms(deterministic):
            for extra in variants:
                assert_matches_cpu(make_case(op, torch.float64, **{**kwargs, **extra}))


def test_both_index_paths_ran_over_the_module(simulation):
    """Over this module (the tests above, and one call of each op on either path here, so that the test stands
    alone), counted by torch.ops.deform_conv_sim.statistics() (launches, blocks, threads, shuffles, 32-bit
    launches, 64-bit launches): launches on both index paths, and every launch on one of them."""
    for name in CONFIG_CASES:
        op_results(sim, case_for(name, torch.float32))
        with simulation_options(int32_limit=1):
            op_results(sim, case_for(name, torch.float32))
    now = torch.ops.deform_conv_sim.statistics()
    launches, blocks, threads, _, int32_launches, int64_launches = (a - b for a, b in zip(now, simulation))
    assert int32_launches > 0 and int64_launches > 0
    assert launches == int32_launches + int64_launches and threads >= blocks > 0
