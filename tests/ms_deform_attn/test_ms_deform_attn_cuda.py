"""Multi-scale deformable attention's CUDA kernels on a real GPU against the float64 reference (skipped without a
GPU; run by benchmarks/gpu_check.sh). Everywhere else the same kernels run through the CUDA simulation
(test_ms_deform_attn_cuda_simulation.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.ms_deform_attn_cuda import NAMES, SHAPES, TOLERANCES, grad_output_for, make_attention, referenced

import deform_conv

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or "cuda" not in {lib.variant.kind for lib in deform_conv.libraries},
    reason="needs a visible GPU and the CUDA library (built when a GPU is visible)",
)


def on_gpu(a):
    return a._replace(**{name: t.cuda() for name, t in a._asdict().items()})


def through_autograd(a, grad_output):
    floats = [t.detach().requires_grad_() for t in a.floats()]
    out = deform_conv.ms_deform_attn(floats[0], a.spatial_shapes, a.level_start_index, *floats[1:])
    grads = torch.autograd.grad(out, floats, grad_output.to(out.dtype).cuda())
    return [t.cpu() for t in (out, *grads)]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_matches_the_reference(shape, dtype, deterministic):
    a = make_attention(**SHAPES[shape], dtype=dtype)
    grad_output = grad_output_for(a)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        actual = through_autograd(on_gpu(a), grad_output)
        again = through_autograd(on_gpu(a), grad_output)
    finally:
        torch.use_deterministic_algorithms(previous)
    tol = TOLERANCES[dtype]
    for name, x, e in zip(NAMES, actual, referenced(a, grad_output)):
        torch.testing.assert_close(x.double(), e, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    if deterministic:
        for name, x, y in zip(NAMES, actual, again):
            assert torch.equal(x, y), f"{name}: not the same bits in two runs"


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_types(half):
    """Tolerance as in the simulation's test_half_types: two ulps of the type, relative to the largest result."""
    a = make_attention(**SHAPES["a_warp"], dtype=half)
    grad_output = grad_output_for(a).to(half).double()
    eps = torch.finfo(half).eps
    for name, x, e in zip(NAMES, through_autograd(on_gpu(a), grad_output), referenced(a, grad_output)):
        assert x.dtype == half, name
        torch.testing.assert_close(x.double(), e, rtol=2 * eps, atol=2 * eps * e.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_levels_that_do_not_fit_sample_nan():
    """On the GPU the level sizes are not read back (no synchronisation): a level past value's end samples NaN."""
    a = make_attention([(3, 4), (2, 2)])
    starts = a.level_start_index.clone()
    starts[1] = 13
    out = deform_conv.ms_deform_attn(*on_gpu(a._replace(level_start_index=starts)))
    assert torch.isnan(out).all()
