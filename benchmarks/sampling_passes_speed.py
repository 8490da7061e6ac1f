"""deform_conv2d's CPU sampling passes timed alone, in float32 and in the half types, from the ranges the op opens
around each pass in torch.profiler's trace (columns_driver.cpp: DC_PASS_RANGE).

    python benchmarks/sampling_passes_speed.py [--threads 2] [--cases S1,S2,S3] [--rounds 9] [--out FILE]

What a half type changes in the passes, whatever the CPU: the fill reads the image in the half type (widened in
registers) and writes its columns in it (rounded once), the coordinates' pass reads the image in it, and the input
turned channels-last moves half the bytes. The half types take that path where the CPU multiplies them natively
(`torch.ops.deform_conv.cpu_half_path` says "native"); elsewhere this script sets DEFORM_CONV_CPU_HALF_GEMM=portable
for their calls, which runs the same passes beside ATen's portable GEMMs (slow: their row says which GEMM ran), so
that the passes' own cost in the half type is measured on any CPU. The passes are timed in the backward, where each
is a pass of its own over a chunk of images (the forward's tiled path fills and multiplies tile by tile, with the same
fill loop), but where a chunk has an image per thread: the tiled backward (cpu/tiled_backward.h) then runs the GEMMs
and the coordinates' and the input's gradients tile by tile, and its row (`tiled_backward`) holds all three (a row
that no dtype's calls ran is left out; one that some ran says "-" for the others). Each round profiles one
forward+backward of every dtype, in a shuffled order; a pass's time is its ranges' wall time summed over the call,
and the table gives the median over the rounds with the ratio to float32.
The fill's ranges record the columns they fill: a half type whose columns were not in its own type (a layer the half
path does not take, its passes then float32's) stops the script with an error rather than give float32's times
under the half type's name. Nothing else is asserted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

from deform_conv._bench.cases import CASES, EXTRA_CASES, SMALL_CASES, SMOKE_CASES, Case
from deform_conv._bench.environment import environment, half_path
from deform_conv._bench.timing import make_call, steady_malloc

PASSES = ["channels_last", "fill_columns", "coordinate_grads", "input_grad", "channels_first"]
GEMMS = "backward_gemms"
# The tiled backward's range (cpu/tiled_backward.h): both GEMMs, the coordinates' and the input's gradients, tile by
# tile, where a chunk has an image per thread. The table leaves out the rows of passes that no dtype ran.
TILED = "tiled_backward"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HALF_GEMM_VARIABLE = "DEFORM_CONV_CPU_HALF_GEMM"


def half_gemm_setting(dtype: torch.dtype) -> Optional[str]:
    """The DEFORM_CONV_CPU_HALF_GEMM value for `dtype`'s calls: None where the CPU runs it natively, `portable`
    where it would otherwise take the float32 path."""
    if dtype == torch.float32:
        return None
    path = half_path(dtype) or ""
    return None if ": native," in path else "portable"


# The dtype the profiler names for the columns of each dtype.
COLUMN_TYPES = {"float32": "float", "bfloat16": "c10::BFloat16", "float16": "c10::Half"}


def profiled_call(call, setting: Optional[str]) -> Tuple[Dict[str, float], Set[str]]:
    """The wall time (ms) of each of the backward's pass ranges in one forward+backward call, summed over its chunks
    (a forward that takes the columns path opens ranges too, and which forwards do depends on the dtype), and the
    dtypes of the columns that the call's fill ranges filled."""
    saved = os.environ.get(HALF_GEMM_VARIABLE)
    if setting is not None:
        os.environ[HALF_GEMM_VARIABLE] = setting
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            call()
    finally:
        if setting is not None:
            if saved is None:
                del os.environ[HALF_GEMM_VARIABLE]
            else:
                os.environ[HALF_GEMM_VARIABLE] = saved
    events = prof.events()
    backward = [e.time_range for e in events if e.name == "deform_conv::deform_conv2d_backward"]
    times: Dict[str, float] = {}
    for event in events:
        within = any(op.start <= event.time_range.start and event.time_range.end <= op.end for op in backward)
        if event.name.startswith("deform_conv2d::") and within:
            name = event.name.split("::", 1)[1]
            times[name] = times.get(name, 0.0) + event.time_range.elapsed_us() / 1e3
    column_types = {event.dtypes()[0] for event in prof.profiler.kineto_results.events()
                    if event.name() == "deform_conv2d::fill_columns" and event.dtypes()}
    return times, column_types


def check_columns(case: str, dtype: str, column_types: Set[str]) -> None:
    """Raises SystemExit unless the backward filled `dtype`'s columns in `dtype` itself."""
    if column_types != {COLUMN_TYPES[dtype]}:
        found = ", ".join(sorted(column_types)) or "none recorded"
        raise SystemExit(f"sampling_passes_speed: {case} in {dtype} filled columns of {found}, expected "
                         f"{COLUMN_TYPES[dtype]}: the layer did not take the {dtype} path here, so its passes are "
                         f"not {dtype}'s; leave it out of --cases")


def case_rows(case: Case, dtypes: Sequence[str], rounds: int, seed: int) -> List[str]:
    settings = {name: half_gemm_setting(DTYPES[name]) for name in dtypes}
    calls = {name: make_call(case, "ours", True, dtype=DTYPES[name]) for name in dtypes}
    for name in dtypes:  # warm-up: buffers, the half GEMM's probe
        profiled_call(calls[name], settings[name])
    samples: Dict[str, List[Dict[str, float]]] = {name: [] for name in dtypes}
    order = list(dtypes)
    shuffler = random.Random(seed)
    for _ in range(rounds):
        shuffler.shuffle(order)
        for name in order:
            times, column_types = profiled_call(calls[name], settings[name])
            check_columns(case.name, name, column_types)
            samples[name].append(times)

    def median(name: str, key: str) -> Optional[float]:
        values = [sample[key] for sample in samples[name] if key in sample]
        return statistics.median(values) if len(values) == len(samples[name]) else None

    def sampling_total(name: str) -> Optional[float]:
        if not any(key in sample for sample in samples[name] for key in PASSES):
            return None
        return statistics.median(sum(sample.get(key, 0.0) for key in PASSES) for sample in samples[name])

    rows = []
    for key in PASSES + ["sampling passes", GEMMS, TILED]:
        cells = []
        base = sampling_total("float32") if key == "sampling passes" else median("float32", key)
        for name in dtypes:
            value = sampling_total(name) if key == "sampling passes" else median(name, key)
            cells.append("-" if value is None else f"{value:.3f}")
            if name != "float32":
                cells.append("-" if value is None or not base else f"{value / base:.2f}")
        if all(cell == "-" for cell in cells):
            continue  # a pass no dtype ran: the tiled backward's, or the three it stands for
        label = key
        if key in (GEMMS, TILED):
            label += " (" + ", ".join(f"{name}: {settings[name] or 'native'}" for name in dtypes
                                      if name != "float32") + ")"
        rows.append(f"| {case.name} | {label} | " + " | ".join(cells) + " |")
    return rows


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=positive, default=None, help="torch's thread count (default: torch's)")
    parser.add_argument("--cases", default="S1,S2,S3",
                        help="benchmark cases, comma-separated (S1-S5, X1-X3, G1-G6; T1: seconds, what the test runs)")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16", help="float32 first, then half types")
    parser.add_argument("--rounds", type=positive, default=9, help="profiled calls of each dtype")
    parser.add_argument("--out", type=Path, default=None, help="write the table here too")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtypes = args.dtypes.split(",")
    if dtypes[0] != "float32" or any(name not in DTYPES for name in dtypes) or len(set(dtypes)) < len(dtypes):
        parser.error(f"--dtypes: float32 first, then bfloat16 and/or float16, each once; got {args.dtypes!r}")
    by_name = {case.name: case for case in CASES + EXTRA_CASES + SMALL_CASES + SMOKE_CASES}
    unknown = [name for name in args.cases.split(",") if name not in by_name]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; the cases are {', '.join(by_name)}")
    steadied = steady_malloc()
    header = ["case", "pass", "float32 ms"]
    for name in dtypes[1:]:
        header += [f"{name} ms", f"{name} / float32"]
    lines = ["# CPU sampling passes alone, float32 and half types", "",
             "Command: `python benchmarks/sampling_passes_speed.py"
             + (f" --threads {args.threads}" if args.threads else "") + f" --cases {args.cases}`", "",
             environment(steadied).replace("; fp32;", "; " + ", ".join(dtypes) + ";"), ""]
    lines += [f"- {half_path(DTYPES[name])}" for name in dtypes[1:]]
    lines += ["", "| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    print("\n".join(lines), flush=True)
    for index, name in enumerate(args.cases.split(",")):
        rows = case_rows(by_name[name], dtypes, args.rounds, seed=index)
        lines += rows
        print("\n".join(rows), flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
