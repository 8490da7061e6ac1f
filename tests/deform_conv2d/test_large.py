"""64-bit indexing: an input of more than 2^31 elements, sampled next to its far end (flat indices past 2^31).
One float32 image of 46341 x 46341 pixels = 8 GiB; skipped where the machine has too little free memory.
(On a GPU the same case, forward and backward, is in test_cuda.py.)"""

from __future__ import annotations

import pytest

from helpers.deform_conv2d import SIDE, far_corner_case

import deform_conv


def available_gib() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


@pytest.mark.skipif(available_gib() < 14, reason=f"needs 14 GiB of free memory, {available_gib():.1f} GiB free")
def test_input_past_2_to_the_31_elements():
    x, offset, weight = far_corner_case()
    assert x.numel() > 2**31
    out = deform_conv.deform_conv2d(x, offset, weight, stride=SIDE)
    # y = SIDE - 1.5 (halfway between the rows), x = SIDE - 1.75 (a quarter past the second-last column).
    expected = 0.5 * (0.75 * 1 + 0.25 * 2) + 0.5 * (0.75 * 3 + 0.25 * 4)
    assert out.shape == (1, 1, 1, 1) and out.item() == expected
