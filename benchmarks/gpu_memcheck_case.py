"""A small forward+backward for compute-sanitizer: in-image, border, far-outside and non-finite sampling points,
with a mask, in fp32 and bf16, on the GEMM path and the depthwise path, in the default mode and the deterministic
one; then multi-scale deformable attention the same way, with a level that does not fit in value (which the
kernels must refuse to read). Run by benchmarks/gpu_check.sh on the GPU (`python gpu_memcheck_case.py`), and on
the CPU by the tests (`python gpu_memcheck_case.py cpu`) so that it cannot rot."""

import itertools
import os
import sys

import torch

import deform_conv

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
torch.manual_seed(0)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # torch's deterministic mode asks for it
for dtype, out_channels, deterministic in itertools.product((torch.float32, torch.bfloat16), (4, 6), (False, True)):
    torch.use_deterministic_algorithms(deterministic)
    # Input 11x8, kernel 3x2, stride (2, 1), padding (1, 0), dilation (2, 1): output 5x7, 3 offset groups; weight
    # groups 2 (the GEMM path) or 6 (6 output channels: the depthwise path).
    groups = 6 if out_channels == 6 else 2
    x = torch.randn(2, 6, 11, 8, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(out_channels, 6 // groups, 3, 2, device=device, dtype=dtype, requires_grad=True)
    offset = 3 * torch.randn(2, 2 * 3 * 6, 5, 7, device=device, dtype=dtype)
    offset[0, 0, 0, 0] = float("nan")
    offset[0, 1, 0, 1] = float("inf")
    offset[1, 2, 1, 1] = -1e30
    offset[1, 3, 2, 2] = -float("inf")
    offset[0, 5, 4, 6] = float("nan")                      # an x-offset
    offset.requires_grad_()
    mask = torch.rand(2, 3 * 6, 5, 7, device=device, dtype=dtype)
    mask[0, 4, 1, 1] = float("nan")
    mask[1, 0, 0, 0] = float("inf")
    mask.requires_grad_()
    out = deform_conv.deform_conv2d(x, offset, weight, None, (2, 1), (1, 0), (2, 1), mask)
    assert out.shape == (2, out_channels, 5, 7), out.shape
    out.float().square().sum().backward()
    # Multi-scale deformable attention: levels 4x5, 1x1 and 2x3 (S = 27), 5 channels a head (8 lanes, 3 idle).
    shapes = torch.tensor([[4, 5], [1, 1], [2, 3]], device=device)
    starts = torch.tensor([0, 20, 21], device=device)
    value = torch.randn(2, 27, 3, 5, device=device, dtype=dtype, requires_grad=True)
    locations = torch.rand(2, 7, 3, 3, 2, 2, device=device, dtype=dtype) * 1.6 - 0.3
    locations[0, 0, 0, 0, 0, 0] = float("nan")
    locations[1, 1, 1, 1, 1, 1] = float("inf")
    locations[1, 2, 2, 2, 0, 0] = -1e30
    locations.requires_grad_()
    weights = torch.rand(2, 7, 3, 3, 2, device=device, dtype=dtype, requires_grad=True)
    out = deform_conv.ms_deform_attn(value, shapes, starts, locations, weights)
    assert out.shape == (2, 7, 15), out.shape
    out.float().square().sum().backward()
    if device == "cuda":  # the CPU checks the levels; on the GPU the kernels do: level 2 would end past S
        out = deform_conv.ms_deform_attn(value, shapes, torch.tensor([0, 20, 22], device=device), locations, weights)
        out.float().sum().backward()
if device == "cuda":
    torch.cuda.synchronize()
print(f"memcheck case ran on {device}")
