"""CUDA kernels against the CPU and torchvision's CUDA op (skipped without a GPU; run by benchmarks/gpu_check.sh)."""

from __future__ import annotations

import os

import pytest
import torch
import torchvision

from helpers.deform_conv2d import (SIDE, assert_all_close, assert_all_close_nonfinite, far_corner_case, make_case,
                                   output_and_grads, with_special_offsets)
from helpers.loader import check_no_local_memory

import deform_conv

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or "cuda" not in {lib.variant.kind for lib in deform_conv.libraries},
    reason="needs a visible GPU and the CUDA library (built when a GPU is visible)",
)

ours = deform_conv.deform_conv2d


def to_cuda(case):
    for name in ("input", "offset", "weight", "bias", "mask"):
        value = getattr(case, name)
        if value is not None:
            setattr(case, name, value.cuda())
    return case


def on_cpu(results):
    return [r.cpu() for r in results]


@pytest.mark.parametrize("geometry", [dict(), dict(in_channels=6, out_channels=6, groups=6, offset_groups=3),
                                      dict(in_channels=32, out_channels=32, groups=32, offset_groups=2, size=(7, 9))],
                         ids=["awkward", "depthwise", "depthwise_wide"])
def test_depthwise_and_gemm_paths_match_the_cpu(dtype, geometry):
    case = make_case(dtype, **geometry)
    cpu = output_and_grads(ours, case)
    assert_all_close(on_cpu(output_and_grads(ours, to_cuda(case))), cpu, dtype)


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_awkward_geometry_matches_cpu_and_torchvision(dtype, with_mask, with_bias):
    case = make_case(dtype, with_mask=with_mask, with_bias=with_bias)
    cpu = output_and_grads(ours, case)
    cuda_case = to_cuda(case)
    cuda = on_cpu(output_and_grads(ours, cuda_case))
    assert_all_close(cuda, cpu, dtype)
    assert_all_close(cuda, on_cpu(output_and_grads(torchvision.ops.deform_conv2d, cuda_case)), dtype)


def test_gradcheck_cuda():
    case = to_cuda(make_case(torch.float64, batch=2, size=(7, 6)))
    tensors = [t.detach().clone().requires_grad_() for t in case.tensors()]
    # The input gradient sums with atomics in no fixed order: the two backward passes gradcheck compares may
    # differ in the last bits.
    assert torch.autograd.gradcheck(lambda *t: case.call(ours, list(t)), tensors, eps=1e-6, atol=1e-5, rtol=1e-4,
                                    nondet_tol=1e-12)


# Half types against float32 on the same (rounded) inputs: the reference must see the rounded offsets too, as
# rounding may move a sampling point across an integer coordinate, a kink of the bilinear interpolant, where the
# offset's gradient jumps. What is left is the rounding of the columns and of the results to 8 (bf16) or 11
# (fp16) significant bits, with float32 accumulation inside.
HALF_TOLERANCES = {torch.float16: (2e-2, 2e-2), torch.bfloat16: (1e-1, 1e-1)}


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_types_against_float32(half):
    case = to_cuda(make_case(torch.float32, batch=4, in_channels=16, out_channels=8, size=(20, 18), offset_groups=2,
                             offset_scale=1.0))
    halves = [t.to(half) for t in case.tensors()]
    reference = output_and_grads(ours, case, [t.float() for t in halves])
    results = output_and_grads(ours, case, halves)
    rtol, atol = HALF_TOLERANCES[half]
    for name, got, want in zip(["output", "input", "offset", "weight", "bias", "mask"], results, reference):
        assert got.dtype == half, name
        scale = want.abs().max().clamp_min(1)
        torch.testing.assert_close(got.float() / scale, want / scale, rtol=rtol, atol=atol, msg=name)


def test_large_case_cpu_and_cuda_gradients_agree():
    """torchvision #2598: batch 8, 9 channels, 1000x110."""
    case = make_case(torch.float64, batch=8, in_channels=9, out_channels=9, size=(1000, 110), kernel=(3, 3),
                     stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1, offset_groups=1)
    cpu = output_and_grads(ours, case)
    assert_all_close(on_cpu(output_and_grads(ours, to_cuda(case))), cpu, torch.float64)


def test_runs_on_the_current_non_default_stream():
    case = to_cuda(make_case(torch.float32, batch=3))
    expected = output_and_grads(ours, case)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        results = output_and_grads(ours, case)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    # The input gradient sums with atomics in no fixed order; cuBLAS promises the same bits only within one
    # stream, so the rest may differ in the last bits too.
    assert_all_close(results, expected, torch.float32)


@pytest.mark.parametrize("name", ["offset", "weight", "mask", "bias"])
def test_mismatched_devices_raise(name):
    case = to_cuda(make_case(torch.float32))
    args = dict(input=case.input, offset=case.offset, weight=case.weight, bias=case.bias, mask=case.mask)
    args[name] = args[name].cpu()
    with pytest.raises(ValueError, match=f"{name} must be on the input's device cuda:0, got cpu"):
        ours(args["input"], args["offset"], args["weight"], args["bias"], case.stride, case.padding, case.dilation,
             args["mask"])
    with pytest.raises(RuntimeError, match=f"{name} must be on the input's device cuda:0, got cpu"):
        torch.ops.deform_conv.deform_conv2d(args["input"], args["offset"], args["weight"], args["mask"], args["bias"],
                                            list(case.stride), list(case.padding), list(case.dilation))


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_autocast_casts_like_conv2d(half):
    case = to_cuda(make_case(torch.float32))
    with torch.autocast("cuda", dtype=half):
        out = case.call(ours, case.tensors())
        conv = torch.nn.functional.conv2d(case.input, case.weight, case.bias, case.stride, case.padding,
                                          case.dilation, groups=2)
    assert out.dtype == conv.dtype == half
    assert torch.equal(out, case.call(ours, [t.to(half) for t in case.tensors()]))


def test_non_finite_offsets_and_masks_match_the_cpu(dtype):
    case = make_case(dtype)
    with_special_offsets(case, dtype)
    case.mask[2, 4, 1, 1] = float("inf")
    case.mask[0, 2, 2, 2] = float("nan")
    cpu = output_and_grads(ours, case)
    assert_all_close_nonfinite(on_cpu(output_and_grads(ours, to_cuda(case))), cpu, dtype, same_nan=False)


@pytest.mark.parametrize("groups", [1, 16], ids=["gemm", "depthwise"])
def test_deterministic_backward_is_bitwise_reproducible(monkeypatch, groups):
    """Under torch.use_deterministic_algorithms(True) the input gradient is gathered in a fixed order instead of
    summed with atomics: two runs give the same bits (and the same values as the default mode, to rounding)."""
    # torch refuses cuBLAS GEMMs in that mode without a fixed workspace configuration.
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    case = to_cuda(make_case(torch.float32, batch=4, in_channels=16, out_channels=16, size=(24, 20), kernel=(3, 3),
                             stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=groups, offset_groups=2,
                             offset_scale=1.0))
    default = output_and_grads(ours, case)
    torch.use_deterministic_algorithms(True)
    try:
        first = output_and_grads(ours, case)
        second = output_and_grads(ours, case)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert_all_close(first, default, torch.float32)


def test_input_past_2_to_the_31_elements_forward_and_backward():
    x, offset, weight = far_corner_case("cuda")
    x.requires_grad_()
    out = ours(x, offset, weight, stride=SIDE)
    expected = 0.5 * (0.75 * 1 + 0.25 * 2) + 0.5 * (0.75 * 3 + 0.25 * 4)
    assert out.item() == expected
    out.backward(torch.ones_like(out))
    corner = x.grad[0, 0, -2:, -2:].cpu()
    torch.testing.assert_close(corner, torch.tensor([[0.375, 0.125], [0.375, 0.125]]), rtol=0, atol=0)
    assert x.grad.sum().item() == 1.0


def test_the_loaded_cuda_library_has_no_local_memory():
    """ptxas' report in the build log of the library this process loaded (built for this GPU's arch)."""

    (library,) = [lib for lib in deform_conv.libraries if lib.variant.kind == "cuda"]
    log = library.entry / "build.log"
    if not log.is_file():
        pytest.skip(f"{library.entry} has no build.log (a bundled library)")
    check_no_local_memory(log.read_text())
