"""Where the time of a forward goes, on the CPU: ours against conv2d, the GEMM part alone (the oneDNN 1x1
convolutions over one image's columns each, as the op runs them, with and without copying their channels-last
output back to channels-first), and the input's conversion to channels-last. The calls take turns
(_bench.interleaved_medians); medians.

    python benchmarks/forward_breakdown.py [S1|S2|S3|S5]     # default S1

The sampling pass is what remains of ours after the GEMMs, the copies and the conversion.
"""

import sys

import torch
import torch.nn.functional as F

import deform_conv
from deform_conv import _bench


def main(name: str) -> None:
    case = next(c for c in _bench.CASES if c.name == name)
    assert case.groups == 1 and (case.kernel, case.stride, case.padding) == (3, 1, 1), "plain 3x3 cases only"
    _bench.steady_malloc()
    t = _bench.make_inputs(case)
    taps, size = case.kernel * case.kernel, case.size
    columns = torch.randn(1, taps * case.in_channels, size, size).contiguous(memory_format=torch.channels_last)
    weight_1x1 = torch.randn(case.out_channels, taps * case.in_channels, 1, 1)
    output = torch.empty(case.batch, case.out_channels, size, size)

    def gemms(copy: bool) -> None:
        for n in range(case.batch):
            result = F.conv2d(columns, weight_1x1)
            if copy:
                output[n:n + 1].copy_(result)

    calls = {
        "conv2d (3x3)": lambda: F.conv2d(t["x"], t["weight"], None, 1, 1),
        "ours": lambda: deform_conv.deform_conv2d(t["x"], t["offset"], t["weight"], padding=1, mask=t["mask"]),
        "GEMMs over the columns": lambda: gemms(copy=False),
        "GEMMs + output copies": lambda: gemms(copy=True),
        "input to channels-last": lambda: t["x"].contiguous(memory_format=torch.channels_last),
    }
    with torch.no_grad():
        medians = _bench.interleaved_medians(calls, min_seconds=1.0)
    print(f"{case.name}: {case.describe()}; {torch.get_num_threads()} threads")
    for name, seconds in medians.items():
        print(f"  {name:24s} {1e3 * seconds:7.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "S1")
