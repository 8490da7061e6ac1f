"""Half types on the CPU (computed in float32) and the op under CPU autocast, which must treat it as it treats
conv2d: float32 tensors cast to the autocast dtype, float64 left alone, the result in conv2d's dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.deform_conv2d import make_case

import deform_conv

ours = deform_conv.deform_conv2d
HALF_TYPES = pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


def grads_for(case, tensors, grad_output):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = case.call(ours, leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_output)]


@HALF_TYPES
def test_cpu_half_types_are_float32_results_rounded_once(half, monkeypatch):
    """On its float32 path (where the CPU has no native half GEMM, or forced as here; the native forward:
    test_half_precision.py) the CPU computes a half-type call in float32 from the same (already rounded) inputs
    and rounds each result once, so it equals the float32 call on the widened inputs, rounded: bit for bit."""
    monkeypatch.setenv("DEFORM_CONV_CPU_HALF_GEMM", "float32")
    case = make_case(torch.float32, offset_scale=1.0)
    halves = [t.to(half) for t in case.tensors()]
    out_shape = case.call(ours, halves).shape
    grad_output = torch.randn(out_shape, generator=torch.Generator().manual_seed(3)).to(half)
    got = grads_for(case, halves, grad_output)
    widened = grads_for(case, [t.float() for t in halves], grad_output.float())
    for i, (g, w) in enumerate(zip(got, widened)):
        assert g.dtype == half, i
        assert torch.equal(g, w.to(half)), f"result {i} differs from the rounded float32 result"


@HALF_TYPES
def test_cpu_autocast_casts_like_conv2d(half):
    case = make_case(torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in case.tensors()]
    with torch.autocast("cpu", dtype=half):
        out = case.call(ours, leaves)
        conv = F.conv2d(case.input, case.weight, case.bias, case.stride, case.padding, case.dilation, groups=2)
    assert out.dtype == conv.dtype == half
    # Exactly the op on the inputs cast to the autocast dtype.
    assert torch.equal(out, case.call(ours, [t.to(half) for t in case.tensors()]))
    # Gradients flow back through the casts to the float32 leaves.
    grads = torch.autograd.grad(out.float().sum(), leaves)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_cpu_autocast_leaves_float64_alone_like_conv2d():
    case = make_case(torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = case.call(ours, case.tensors())
        conv = F.conv2d(case.input, case.weight, case.bias, case.stride, case.padding, case.dilation, groups=2)
    assert out.dtype == conv.dtype == torch.float64
    assert torch.equal(out, case.call(ours, case.tensors()))


def test_cpu_autocast_inside_torch_compile():
    case = make_case(torch.float32)
    compiled = torch.compile(lambda *t: case.call(ours, list(t)), fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(*case.tensors())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, case.call(ours, [t.to(torch.bfloat16) for t in case.tensors()]))


def test_cpu_autocast_takes_mixed_dtypes_as_conv2d_does():
    """Under autocast a layer's tensors often differ in dtype (the conv_offset layer's bfloat16 offset beside a
    float32 input): the op casts them all, as conv2d does, instead of refusing them."""
    case = make_case(torch.float32)
    tensors = case.tensors()
    tensors[1] = tensors[1].to(torch.bfloat16)  # the offset
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = case.call(ours, tensors)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, case.call(ours, [t.to(torch.bfloat16) for t in case.tensors()]))


def test_ms_deform_attn_module_under_cpu_autocast():
    """MSDeformAttn under autocast: value comes from a Linear (bfloat16), the locations from float32 reference
    points plus offsets, the weights from a softmax (float32): the op runs in bfloat16 on all of them."""
    torch.manual_seed(0)
    attn = deform_conv.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)
    shapes = torch.tensor([[5, 6], [2, 3]])
    starts = torch.tensor([0, 30])
    query, flatten = torch.randn(2, 7, 32), torch.randn(2, 36, 32)
    reference = torch.rand(2, 7, 2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(query, reference, flatten, shapes, starts)
    assert out.dtype == torch.bfloat16
    expected = attn(query, reference, flatten, shapes, starts)
    # bfloat16 throughout: the input casts, the value projection, the sampling and the output projection each round
    # to half a bfloat16 ulp of values of about the output's scale; 8 ulps of that scale bound their sum with room
    # (1.6 measured).
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=8 * torch.finfo(torch.bfloat16).eps * scale)
