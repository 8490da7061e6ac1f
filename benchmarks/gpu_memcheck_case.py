"""A small forward+backward on the GPU for compute-sanitizer: in-image, border, far-outside and non-finite
sampling points, with a mask, in fp32 and bf16. Run by benchmarks/gpu_check.sh."""

import torch

import deform_conv

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(2, 6, 9, 8, device="cuda", dtype=dtype, requires_grad=True)
    weight = torch.randn(4, 3, 3, 2, device="cuda", dtype=dtype, requires_grad=True)
    offset = 3 * torch.randn(2, 2 * 3 * 6, 5, 7, device="cuda", dtype=dtype)
    offset[0, 0, 0, 0] = float("nan")
    offset[0, 1, 0, 1] = float("inf")
    offset[1, 2, 1, 1] = -1e30
    offset[1, 3, 2, 2] = -float("inf")
    offset[0, 5, 4, 6] = float("nan")                      # an x-offset
    offset.requires_grad_()
    mask = torch.rand(2, 3 * 6, 5, 7, device="cuda", dtype=dtype)
    mask[0, 4, 1, 1] = float("nan")
    mask[1, 0, 0, 0] = float("inf")
    mask.requires_grad_()
    out = deform_conv.deform_conv2d(x, offset, weight, None, (2, 1), (1, 0), (2, 1), mask)
    out.float().square().sum().backward()
torch.cuda.synchronize()
print("memcheck case ran")
