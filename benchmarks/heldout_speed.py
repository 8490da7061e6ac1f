"""Layers held out of the benchmark's table: ours against conv2d of the same shape, forward and forward+backward,
float32, to see whether the table's speed holds beyond its shapes (strided layers with few channels, weight groups
and offset groups that do not divide each other, depthwise layers, odd image sizes).

    python benchmarks/heldout_speed.py [--threads 2] [--min-seconds 2] [--out benchmarks/results/cpu_heldout.md]

The two implementations take turns call by call in a shuffled order (deform_conv._bench.interleaved_medians) after
a warm-up call, and the median of each is reported with the ratio; malloc's trimming is off during the timings
(steady_malloc). Nothing is asserted: the targets (forward <= 2x conv2d, forward+backward <= 3x) are reported.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from deform_conv._bench.cases import Case
from deform_conv._bench.environment import environment
from deform_conv._bench.timing import interleaved_medians, make_call, steady_malloc

HELD_OUT = [
    Case("H1", 32, 8, 16, 48, width=40, stride=2),
    Case("H2", 16, 24, 24, 37, width=29, stride=2, offset_groups=3),
    Case("H3", 4, 48, 48, 23, width=41, groups=2, offset_groups=3),
    Case("H4", 6, 36, 72, 31, width=19, groups=3, offset_groups=2),
    Case("H5", 2, 96, 96, 35, groups=4, offset_groups=6),
    Case("H6", 6, 64, 64, 45, width=33, groups=64),
    Case("H7", 8, 96, 96, 39, stride=2, groups=96, offset_groups=2),
    Case("H8", 4, 40, 40, 27, width=53, groups=5, offset_groups=4),
]
TARGETS = {"fwd": 2.0, "fwd+bwd": 3.0}


def row(case: Case, min_seconds: float) -> str:
    cells: List[str] = []
    for backward in (False, True):
        calls = {impl: make_call(case, impl, backward) for impl in ("ours", "conv2d")}
        times = interleaved_medians(calls, min_seconds)
        ratio = times["ours"] / times["conv2d"]
        target = TARGETS["fwd+bwd" if backward else "fwd"]
        cells += [f"{times['ours'] * 1e3:.2f}", f"{times['conv2d'] * 1e3:.2f}", f"{ratio:.2f}",
                  "met" if ratio <= target else "not met"]
    return f"| {case.name} | {case.describe()} | " + " | ".join(cells) + " |"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch's thread count (default: torch's)")
    parser.add_argument("--min-seconds", type=float, default=2.0, help="time per implementation and pass")
    parser.add_argument("--out", type=Path, default=None, help="write the table here too")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    steadied = steady_malloc()
    lines = ["# CPU speed on layers held out of the benchmark", "",
             "Command: `python benchmarks/heldout_speed.py" + (f" --threads {args.threads}`" if args.threads else "`"),
             "", environment(steadied), "",
             "| case | config | fwd ms: ours | conv2d | ours/conv2d | <= 2x | fwd+bwd ms: ours | conv2d | ours/conv2d "
             "| <= 3x |", "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    for case in HELD_OUT:
        lines.append(row(case, args.min_seconds))
        print(lines[-1], flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
