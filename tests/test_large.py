"""64-bit indexing: an input of more than 2^31 elements, sampled next to its far end (flat indices past 2^31).
One float32 image of 46341 x 46341 pixels = 8 GiB; skipped where the machine has too little free memory.
(On a GPU the same case, forward and backward, is in test_cuda.py.)"""

from __future__ import annotations

import pytest
import torch

import deform_conv

SIDE = 46341  # SIDE * SIDE = 2_147_488_281 > 2^31


def available_gib() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def far_corner_case(device: str = "cpu"):
    """A single output pixel (1x1 kernel, stride = the image size) that samples halfway between the last two
    rows and columns, where the flat index is past 2^31: the bilinear mean of 1, 2, 3, 4."""
    x = torch.zeros(1, 1, SIDE, SIDE, device=device)
    x[0, 0, -2:, -2:] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    weight = torch.ones(1, 1, 1, 1, device=device)
    offset = torch.tensor([SIDE - 1.5, SIDE - 1.75], device=device).reshape(1, 2, 1, 1)
    return x, offset, weight


@pytest.mark.skipif(available_gib() < 14, reason=f"needs 14 GiB of free memory, {available_gib():.1f} GiB free")
def test_input_past_2_to_the_31_elements():
    x, offset, weight = far_corner_case()
    assert x.numel() > 2**31
    out = deform_conv.deform_conv2d(x, offset, weight, stride=SIDE)
    # y = SIDE - 1.5 (halfway between the rows), x = SIDE - 1.75 (a quarter past the second-last column).
    expected = 0.5 * (0.75 * 1 + 0.25 * 2) + 0.5 * (0.75 * 3 + 0.25 * 4)
    assert out.shape == (1, 1, 1, 1) and out.item() == expected
