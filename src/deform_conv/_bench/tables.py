"""The benchmark's other tables (`deform-conv bench --threads 1,2,4`, `--dtype bfloat16`, `--gpu`), on the
suite's cases, inputs and timing (cases.py, timing.py): thread scaling of ours and conv2d in fp32
(cpu_threads.md); ours in a half type against ours in fp32 and conv2d in that type, NCHW and channels_last
(cpu_<dtype>.md); and S1-S5 at batch 32 on the GPU in fp32 and bf16 (gpu.md)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .cases import CASES, DTYPES, IMPLEMENTATIONS, PHASES, SCALING_CASES, SMOKE_CASES, Case, dtype_name, make_inputs
from .environment import environment
from .report import _document, _ms, _write, command_line
from .timing import interleaved_medians, make_call


def run_threads(cases: Sequence[Case], counts: Sequence[int], min_seconds: float = 1.0) -> List[dict]:
    """Thread-scaling rows: for each case and thread count (in the order given; none skipped here), fp32 forward
    and forward+backward medians of ours and conv2d, and ours' speed-up over ours at the first count. The calls
    are made once per case, so every count times the same inputs; torch's thread count is restored after."""
    rows = []
    before = torch.get_num_threads()
    try:
        for case in cases:
            calls = {f"{impl}_{phase}": make_call(case, impl, backward)
                     for impl in ("ours", "conv2d") for phase, backward in PHASES}
            first: Optional[dict] = None
            for count in counts:
                torch.set_num_threads(count)
                row: Dict[str, object] = {"case": case.name, "config": case.describe(), "threads": count,
                                          **interleaved_medians(calls, min_seconds)}
                if first is None:
                    first = row
                for phase, _ in PHASES:
                    row[f"speedup_{phase}"] = first[f"ours_{phase}"] / row[f"ours_{phase}"]
                rows.append(row)
                print(format_threads_row(row), flush=True)
    finally:
        torch.set_num_threads(before)
    return rows


def threads_header(first: int) -> str:
    baseline = f"{first} thread" + ("" if first == 1 else "s")
    return (
        f"| case | config | threads | fwd ms: ours | conv2d | ours/conv2d | ours' speed-up over {baseline} "
        f"| fwd+bwd ms: ours | conv2d | ours/conv2d | ours' speed-up over {baseline} |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )


def format_threads_row(r: dict) -> str:
    return (
        f"| {r['case']} | {r['config']} | {r['threads']} | {_ms(r['ours_fwd'])} | {_ms(r['conv2d_fwd'])} "
        f"| {r['ours_fwd'] / r['conv2d_fwd']:.2f} | {r['speedup_fwd']:.2f} | {_ms(r['ours_fwdbwd'])} "
        f"| {_ms(r['conv2d_fwdbwd'])} | {r['ours_fwdbwd'] / r['conv2d_fwdbwd']:.2f} | {r['speedup_fwdbwd']:.2f} |"
    )


def usable_thread_counts(counts: Sequence[int], cores: Optional[int] = None) -> Tuple[List[int], List[str]]:
    """The counts up to the number of cores (more would time the scheduler's time-slicing, not the kernels), and
    a note for each one left out."""
    cores = cores or os.cpu_count() or 1
    usable = [n for n in counts if n <= cores]
    notes = [f"{n} threads skipped: more than the {cores} cores" for n in counts if n > cores]
    return usable, notes


def _half_variants(dtype: torch.dtype) -> Dict[str, Tuple[str, torch.dtype, bool]]:
    """The half table's implementations by row key: (implementation, dtype of its inputs, channels_last)."""
    return {
        "ours_half": ("ours", dtype, False),
        "ours_fp32": ("ours", torch.float32, False),
        "conv2d_half": ("conv2d", dtype, False),
        "conv2d_cl_half": ("conv2d", dtype, True),
    }


def run_half(cases: Sequence[Case], dtype: torch.dtype, min_seconds: float = 1.0) -> List[dict]:
    """Half-table rows: forward and forward+backward medians of ours in `dtype`, ours in fp32 on the same values,
    and conv2d in `dtype` with NCHW and channels_last tensors, all eight taking turns (interleaved_medians)."""
    rows = []
    for case in cases:
        calls = {f"{name}_{phase}": make_call(case, impl, backward, dtype=d, channels_last=cl)
                 for name, (impl, d, cl) in _half_variants(dtype).items() for phase, backward in PHASES}
        row: Dict[str, object] = {"case": case.name, "config": case.describe(),
                                  **interleaved_medians(calls, min_seconds)}
        rows.append(row)
        print(format_half_row(row), flush=True)
    return rows


def half_header(dtype: torch.dtype) -> str:
    name = dtype_name(dtype)
    columns = (f"ours {name} | ours fp32 | conv2d {name} | conv2d {name} channels_last "
               f"| speed-up (ours fp32 / ours {name}) | ours/conv2d {name}")
    return (f"| case | config | fwd ms: {columns} | fwd+bwd ms: {columns} |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def format_half_row(r: dict) -> str:
    cells = []
    for phase, _ in PHASES:
        cells += [_ms(r[f"ours_half_{phase}"]), _ms(r[f"ours_fp32_{phase}"]), _ms(r[f"conv2d_half_{phase}"]),
                  _ms(r[f"conv2d_cl_half_{phase}"]), f"{r[f'ours_fp32_{phase}'] / r[f'ours_half_{phase}']:.2f}",
                  f"{r[f'ours_half_{phase}'] / r[f'conv2d_half_{phase}']:.2f}"]
    return f"| {r['case']} | {r['config']} | " + " | ".join(cells) + " |"


def gpu_peak_mib(case: Case, impl: str, dtype: torch.dtype) -> float:
    """Peak CUDA memory allocated during one forward+backward above what the inputs hold, in MiB."""
    tensors = {k: (v.requires_grad_() if v is not None else None)
               for k, v in make_inputs(case, device="cuda", dtype=dtype).items()}
    fn = IMPLEMENTATIONS[impl]
    fn(case, tensors).sum().backward()  # warm-up: cuDNN/cuBLAS workspaces
    for v in tensors.values():
        if v is not None:
            v.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(case, tensors).sum().backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def run_gpu(cases: Sequence[Case], min_seconds: float) -> List[str]:
    """GPU rows: ours in fp32 and bf16 against torchvision (fp32, and fp16 for the bf16 rows: it has no bf16)
    and cuDNN's conv2d in the same dtype as ours."""
    lines = []
    for case in cases:
        for dtype, tv_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float16)):
            t = interleaved_medians({f"{impl}_{phase}": make_call(case, impl, backward, "cuda", d)
                                     for impl, d in (("ours", dtype), ("torchvision", tv_dtype), ("conv2d", dtype))
                                     for phase, backward in (("fwd", False), ("fwdbwd", True))}, min_seconds, "cuda")
            peak = (gpu_peak_mib(case, "ours", dtype), gpu_peak_mib(case, "torchvision", tv_dtype))
            name = str(dtype).replace("torch.", "")
            line = (
                f"| {case.name} | {case.describe()} | {name} | {_ms(t['ours_fwd'])} | {_ms(t['torchvision_fwd'])} "
                f"| {_ms(t['conv2d_fwd'])} | {t['ours_fwd'] / t['conv2d_fwd']:.2f} | {t['ours_fwd'] / t['torchvision_fwd']:.3f} "
                f"| {_ms(t['ours_fwdbwd'])} | {_ms(t['torchvision_fwdbwd'])} | {_ms(t['conv2d_fwdbwd'])} "
                f"| {t['ours_fwdbwd'] / t['conv2d_fwdbwd']:.2f} | {t['ours_fwdbwd'] / t['torchvision_fwdbwd']:.3f} "
                f"| {peak[0]:.0f} | {peak[1]:.0f} |"
            )
            lines.append(line)
            print(line, flush=True)
    return lines


GPU_HEADER = (
    "| case | config | dtype (torchvision: fp32 / fp16) | fwd ms: ours | torchvision | cuDNN conv2d | ours/conv2d "
    "| ours/tv | fwd+bwd ms: ours | torchvision | conv2d | ours/conv2d | ours/tv | peak MiB: ours | torchvision |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def gpu_main(out: Optional[Path], min_seconds: float) -> int:
    cases = [dataclasses.replace(c, batch=32) for c in CASES]
    # float32 means float32 for every implementation: cuDNN would otherwise run conv2d on TF32 (10-bit mantissas),
    # a different and faster computation than ours and torchvision's.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    header = (f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}, CUDA {torch.version.cuda}; TF32 off "
              "(cuDNN and cuBLAS)")
    print(header)
    print(GPU_HEADER)
    lines = run_gpu(cases, min_seconds)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        text = "\n".join(["# GPU speed (batch 32)", "", "Command: `deform-conv bench --gpu`", "", header, "",
                          GPU_HEADER, *lines, ""])
        (out / "gpu.md").write_text(text)
        print(f"wrote {out / 'gpu.md'}")
    return 0


def threads_main(parser: argparse.ArgumentParser, args: argparse.Namespace, min_seconds: float, steadied: bool) -> int:
    """The thread-scaling table (a list given to --threads)."""
    counts, notes = usable_thread_counts(args.threads)
    for note in notes:
        print(note)
    if not counts:
        parser.error(f"argument --threads: every count is above the {os.cpu_count()} cores")
    env = environment(steadied, threads=counts)
    print(env)
    print(threads_header(counts[0]))
    rows = run_threads(SMOKE_CASES if args.smoke else SCALING_CASES, counts, min_seconds)
    lines = [format_threads_row(r) for r in rows]
    _write(args.out, "cpu_threads.md",
           _document("CPU thread scaling", command_line(args), env, threads_header(counts[0]), lines, notes))
    return 0


def half_main(args: argparse.Namespace, cases: Sequence[Case], min_seconds: float, steadied: bool) -> int:
    """The bfloat16 or float16 table."""
    dtype = DTYPES[args.dtype]
    env = environment(steadied, dtype=dtype)
    print(env)
    print(half_header(dtype))
    rows = run_half(cases, dtype, min_seconds)
    _write(args.out, f"cpu_{args.dtype}.md", _document(f"CPU speed, {args.dtype}", command_line(args), env,
                                                      half_header(dtype), [format_half_row(r) for r in rows]))
    return 0
