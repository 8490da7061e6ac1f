"""The order in which the CPU kernels sum over channels (csrc/cpu_lanes.h), taken step by step in Python: what the
lane-order tests of each op compare the kernels' bits with."""

from __future__ import annotations

import torch

LANES = 16


def lane_order_sum(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum(a * b) as cpu_lanes.h adds it: channel d to lane d % 16, in order, then the lanes pairwise (j + j + 8,
    j + j + 4, j + j + 2, 0 + 1); each product and each addition rounded to `dtype`."""
    products = a.to(dtype) * b.to(dtype)
    lanes = [torch.zeros((), dtype=dtype) for _ in range(LANES)]
    for d, p in enumerate(products):
        lanes[d % LANES] = lanes[d % LANES] + p
    width = LANES // 2
    while width >= 1:
        lanes = [lanes[j] + lanes[j + width] for j in range(width)]
        width //= 2
    return lanes[0]


def sequential_sum(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same products added one after another: what the data must tell apart from the lane order."""
    total = torch.zeros((), dtype=dtype)
    for p in a.to(dtype) * b.to(dtype):
        total = total + p
    return total


def spread(shape, generator: torch.Generator) -> torch.Tensor:
    """float64 values whose magnitudes span six decades, so that the order of additions shows in the bits."""
    return (torch.randn(shape, generator=generator, dtype=torch.float64)
            * 10.0 ** torch.randint(-3, 3, shape, generator=generator))
