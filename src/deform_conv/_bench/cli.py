"""The benchmark's command line (`deform-conv bench`, `python benchmarks/cpu_speed.py`): its options, the
combinations one table cannot honour, and which table a run makes."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from . import family, tables
from .cases import CASES, DTYPES, EXTRA_CASES, SMALL_CASES, SMOKE_CASES
from .environment import environment
from .family import table
from .report import command_line
from .suite import HEADER, markdown, plot, run
from .timing import steady_malloc


def thread_counts(text: str) -> List[int]:
    """`--threads`'s value: one count, or a comma list of distinct counts (the scaling table)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a thread count or a comma list of them (e.g. 1,2,4), got {text!r}"
                                         ) from None
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"thread counts are at least 1, got {text!r}")
    if len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"each thread count once, got {text!r}")
    return counts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deform-conv bench", description="CPU benchmark: ours vs torchvision vs conv2d")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, seconds (what CI runs)")
    parser.add_argument("--extra", action="store_true", help="also the shapes beyond S1-S5")
    parser.add_argument("--small", action="store_true",
                        help="also G1-G3: small images, weight and offset groups, a non-square image")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="time spent per measurement")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for cpu.md and cpu.png (cpu_threads.md, cpu_<dtype>.md; gpu.md)")
    parser.add_argument("--threads", type=thread_counts, default=None, metavar="N[,N...]",
                        help="torch's thread count for the run (default: torch's, all cores); a comma list, e.g. "
                        "1,2,4, instead times ours and conv2d in fp32 at each count on S1-S3 (the smoke shapes "
                        "with --smoke) and writes cpu_threads.md, skipping counts above the cores")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="float32: the main table; bfloat16 or float16: ours in that dtype against ours in "
                        "fp32 and conv2d in that dtype (NCHW and channels_last), written to cpu_<dtype>.md")
    parser.add_argument("--gpu", action="store_true", help="S1-S5 at batch 32 on the GPU, fp32 and bf16")
    parser.add_argument("--op", choices=("deform_conv2d",) + family.OPS, default="deform_conv2d",
                        help="the op: deform_conv2d (the tables above), or dcnv3, dcnv4, flash_deform_attn against "
                        "their grid_sample compositions and the floor of their shape, written to cpu_<op>.md")
    return parser


def _check_combinations(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses the combinations one table cannot honour (parser.error exits, naming the arguments)."""
    if args.op != "deform_conv2d" and (args.gpu or args.small or args.extra or
                                        (args.threads is not None and len(args.threads) > 1)):
        parser.error(f"argument --op: {args.op}'s table has its own shapes, on the CPU at one thread count; drop "
                     "--gpu, --small, --extra and a --threads list")
    scaling = args.threads is not None and len(args.threads) > 1
    if args.gpu and (args.small or args.dtype != "float32" or args.threads is not None):
        parser.error("argument --gpu: the GPU table has its own cases, dtypes and threads; "
                     "drop --small, --dtype and --threads")
    if scaling and args.dtype != "float32":
        parser.error("argument --threads: a list of counts runs the fp32 scaling table; drop --dtype")
    if scaling and (args.extra or args.small):
        parser.error("argument --threads: a list of counts runs on S1-S3 (or --smoke's shapes); drop --extra and "
                     "--small")


def _family_main(args: argparse.Namespace) -> int:
    """`--op dcnv3|dcnv4|flash_deform_attn`: that op's table (family.py)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads[0])
    steadied = steady_malloc()
    dtype = DTYPES[args.dtype]
    header = environment(steadied, dtype)
    print(header)
    text = table(args.op, args.smoke, 0.05 if args.smoke else args.min_seconds, dtype)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"cpu_{args.op}.md"
        path.write_text(f"# {args.op} on the CPU\n\n{header}\n\nCommand: `{command_line(args)} --op {args.op}`\n\n"
                        + text)
        print(f"wrote {path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_combinations(parser, args)
    if args.gpu:
        return tables.gpu_main(args.out, min_seconds=min(args.min_seconds, 0.3))
    if args.op != "deform_conv2d":
        return _family_main(args)
    cases = (SMOKE_CASES if args.smoke
             else CASES + (EXTRA_CASES if args.extra else []) + (SMALL_CASES if args.small else []))
    min_seconds = 0.05 if args.smoke else args.min_seconds
    steadied = steady_malloc()  # for this process, which ends with the run
    if args.threads is not None and len(args.threads) > 1:
        return tables.threads_main(parser, args, min_seconds, steadied)
    if args.threads is not None:
        torch.set_num_threads(args.threads[0])
    if args.dtype != "float32":
        return tables.half_main(args, cases, min_seconds, steadied)
    print(environment(steadied))
    print(HEADER)
    rows = run(cases, min_seconds=min_seconds, memory=True, onnx=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu.md").write_text(markdown(rows, command_line(args), steadied))
        plotted = plot(rows, args.out / "cpu.png")
        print(f"wrote {args.out / 'cpu.md'}" + (f" and {args.out / 'cpu.png'}" if plotted else " (no plot: matplotlib missing)"))
    return 0
