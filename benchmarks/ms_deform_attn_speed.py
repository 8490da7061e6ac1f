"""Multi-scale deformable attention: ours (``deform_conv.ms_deform_attn``) against Deformable DETR's pure-PyTorch
version (``ms_deform_attn_grid_sample``: a grid_sample a level and the weighted sum), on the same inputs.

    python benchmarks/ms_deform_attn_speed.py [--threads 2] [--out benchmarks/results/ms_deform_attn_cpu.md]
    python benchmarks/ms_deform_attn_speed.py --device cuda

Shapes: Deformable DETR on an 800x1200 image, batch 2, four levels at strides 8, 16, 32, 64 (H_l = ceil(800 / s),
W_l = ceil(1200 / s); S = 19,947 pixels), 8 heads of 32 channels, 4 points a level; the encoder's op (a query a
pixel, Lq = S) and the decoder's (Lq = 300). Inputs as the model makes them: reference points (the encoder's at
the pixel centres of every level, the decoder's anywhere in the image) plus offsets of a few pixels of each level
(so that some locations fall outside [0, 1]), and attention weights softmax-normalised over each head's levels and
points. Each case in float32 and bfloat16 (both implementations in the same dtype), forward (under no_grad) and
forward+backward (gradients of value, locations and weights).

Timing with torch.utils.benchmark: one warm-up call, then the two implementations take turns, a
``blocked_autorange`` each per round (its block-size estimate is a further warm-up) until each has had
``--min-seconds`` and at least 3 rounds, and the median of all their calls is reported; taking turns lets both meet
the same load on a shared machine, so that the ratio measures the implementations and not the load's drift.
Peak memory on the CPU as ``deform-conv bench`` measures it (deform_conv/_bench/timing.py): in a child process per
measurement, the rise of the resident set's high-water mark during one call after a warm-up one, with malloc
made to map every block of 64 KiB or more on its own so that the resident set follows the live memory, plus
the scratch memory our kernels keep between calls; on CUDA ``torch.cuda.max_memory_allocated`` over what the
inputs hold. The targets (ours >= 10x faster forward, >= 5x faster forward+backward, lower peak memory) are
reported as met or not; nothing is asserted.

The whole CPU run takes about 11 minutes on a 2-core AMD EPYC, most of it the grid_sample version's encoder
forward+backward: 8-12 s a call there, with a peak of 2 GiB in float32 (its per-level images, samples and their
gradients), against 1.1-1.4 s and 0.1 GiB for ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import benchmark

import deform_conv
from deform_conv._bench import steady_malloc
from deform_conv._ops.ms_deform_attn.function import _compiled_devices
from deform_conv._ops.ms_deform_attn.reference import ms_deform_attn_grid_sample

IMAGE = (800, 1200)
STRIDES = (8, 16, 32, 64)
LEVELS = [(math.ceil(IMAGE[0] / s), math.ceil(IMAGE[1] / s)) for s in STRIDES]  # (H_l, W_l)
PIXELS = sum(h * w for h, w in LEVELS)
BATCH, HEADS, CHANNELS, POINTS = 2, 8, 32, 4
CASES = {"encoder": PIXELS, "decoder": 300}  # name -> Lq
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PHASES = ("fwd", "fwd+bwd")
TARGETS = {"fwd": 10.0, "fwd+bwd": 5.0}  # ours at least this many times faster
IMPLEMENTATIONS = ("ours", "grid_sample")


@dataclasses.dataclass(frozen=True)
class Config:
    case: str
    dtype: str
    phase: str
    device: str = "cpu"
    seed: int = 0


def make_inputs(config: Config) -> Dict[str, torch.Tensor]:
    """The op's arguments for one case, built as Deformable DETR builds them (see the module's docstring)."""
    g = torch.Generator().manual_seed(config.seed)
    queries, levels = CASES[config.case], len(LEVELS)
    spatial_shapes = torch.tensor(LEVELS, dtype=torch.long)  # [L, 2]
    level_start_index = torch.cat((spatial_shapes.new_zeros(1), spatial_shapes.prod(1).cumsum(0)[:-1]))  # [L]
    value = torch.randn(BATCH, PIXELS, HEADS, CHANNELS, generator=g)  # [N, S, M, D]
    if config.case == "encoder":  # every pixel of every level, at its centre
        centres = []
        for height, width in LEVELS:
            y, x = torch.meshgrid((torch.arange(height) + 0.5) / height, (torch.arange(width) + 0.5) / width,
                                  indexing="ij")
            centres.append(torch.stack((x, y), -1).reshape(-1, 2))
        reference = torch.cat(centres).expand(BATCH, queries, 2)
    else:
        reference = torch.rand(BATCH, queries, 2, generator=g)
    # Offsets in pixels of each level: Deformable DETR's initial pattern (point p of head m at p + 1 pixels in
    # direction 2 pi m / M) plus noise of a pixel, as a trained model's spread around it.
    angle = torch.arange(HEADS) * (2 * math.pi / HEADS)
    direction = torch.stack((angle.cos(), angle.sin()), -1)
    direction = direction / direction.abs().max(-1, keepdim=True).values  # [M, 2]
    pattern = direction[:, None, None, :] * torch.arange(1, POINTS + 1)[None, None, :, None]  # [M, 1, P, 2]
    offsets = pattern + torch.randn(BATCH, queries, HEADS, levels, POINTS, 2, generator=g)
    normalizer = spatial_shapes.flip(1).float()[:, None]  # [L, 1, 2]: (W_l, H_l)
    locations = reference[:, :, None, None, None, :] + offsets / normalizer  # [N, Lq, M, L, P, 2]
    logits = torch.randn(BATCH, queries, HEADS, levels * POINTS, generator=g)
    weights = logits.softmax(-1).view(BATCH, queries, HEADS, levels, POINTS)  # [N, Lq, M, L, P]
    dtype, device = DTYPES[config.dtype], config.device
    return dict(value=value.to(device, dtype), spatial_shapes=spatial_shapes.to(device),
                level_start_index=level_start_index.to(device), sampling_locations=locations.to(device, dtype),
                attention_weights=weights.to(device, dtype))


def forward(impl: str, t: Dict[str, torch.Tensor]) -> torch.Tensor:
    if impl == "ours":
        return deform_conv.ms_deform_attn(t["value"], t["spatial_shapes"], t["level_start_index"],
                                          t["sampling_locations"], t["attention_weights"])
    return ms_deform_attn_grid_sample(t["value"], LEVELS, t["sampling_locations"], t["attention_weights"])


DIFFERENTIABLE = ("value", "sampling_locations", "attention_weights")


def make_call(impl: str, config: Config) -> Callable[[], None]:
    """One forward under no_grad, or one forward+backward (grad_output fixed, gradients dropped after it)."""
    t = make_inputs(config)
    if config.phase == "fwd":
        def call() -> None:
            with torch.no_grad():
                forward(impl, t)
        return call
    for name in DIFFERENTIABLE:
        t[name].requires_grad_()
    with torch.no_grad():
        grad_output = torch.randn_like(forward(impl, t))

    def call_backward() -> None:
        forward(impl, t).backward(grad_output)
        for name in DIFFERENTIABLE:
            t[name].grad = None
    return call_backward


def medians(calls: Dict[str, Callable[[], None]], threads: int, min_seconds: float) -> Dict[str, float]:
    """Median seconds a call of each, the calls taking turns (see the module's docstring)."""
    timers = {name: benchmark.Timer("call()", globals={"call": call}, num_threads=threads, label=name)
              for name, call in calls.items()}
    for call in calls.values():
        call()  # warm-up: thread pools, allocator, first-touch of the inputs
    per_call: Dict[str, List[float]] = {name: [] for name in calls}
    spent = {name: 0.0 for name in calls}
    rounds = 0
    while rounds < 3 or any(s < min_seconds for s in spent.values()):
        for name, timer in timers.items():
            if rounds >= 3 and spent[name] >= min_seconds:
                continue
            m = timer.blocked_autorange(min_run_time=min_seconds / 3)
            per_call[name] += [t / m.number_per_run for t in m.raw_times]
            spent[name] += sum(m.raw_times)
        rounds += 1
    return {name: statistics.median(times) for name, times in per_call.items()}


# -- peak memory --------------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def peak_child(config: Config, impl: str, threads: int) -> float:
    """In the child: the rise of VmHWM during one call after a warm-up one, plus our kernels' kept scratch, MiB."""
    torch.set_num_threads(threads)
    call = make_call(impl, config)
    call()  # one-time allocations (thread pools, caches) are not the call's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the high-water mark to the current resident set
    before = _status_kib("VmHWM:")  # measured from the reset mark itself, as _bench/timing.py does
    call()
    kept = torch.ops.deform_conv.kept_scratch_bytes() / 1024 if impl == "ours" and hasattr(
        torch.ops.deform_conv, "kept_scratch_bytes") else 0
    return (_status_kib("VmHWM:") - before + kept) / 1024


def peak_mib(config: Config, impl: str, threads: int) -> Optional[float]:
    """Peak memory of one call above what the inputs hold, in MiB (None where /proc cannot tell)."""
    if config.device == "cuda":
        call = make_call(impl, config)
        call()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    if not Path("/proc/self/clear_refs").exists():
        return None
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # see the module's docstring
    child = subprocess.run(
        [sys.executable, __file__, "--peak-child", json.dumps([dataclasses.asdict(config), impl, threads])],
        capture_output=True, text=True, env=env, timeout=1800)
    if child.returncode != 0:
        raise RuntimeError(f"peak memory of {impl} on {config} failed:\n{child.stderr[-2000:]}")
    return float(child.stdout.split()[-1])


# -- the machine --------------------------------------------------------------------------------------------------

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
             "amx_bf16")


def cpu_description() -> str:
    """lscpu's model name and the vector-ISA flags that matter here, and the ISA oneDNN says it uses."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        model = re.search(r"^Model name:\s*(.+)$", lscpu, re.MULTILINE).group(1).strip()
        flags = set(re.search(r"^Flags:\s*(.+)$", lscpu, re.MULTILINE).group(1).split())
    except (OSError, subprocess.SubprocessError, AttributeError):
        pass
    present = [f for f in ISA_FLAGS if f in flags] or ["none of " + "/".join(ISA_FLAGS)]
    # oneDNN names its ISA when verbose, on its first primitive: in a child, to keep this process quiet.
    probe = ("import torch; torch.mkldnn_convolution(torch.randn(1, 8, 8, 8), torch.randn(8, 8, 3, 3), None, "
             "[1, 1], [1, 1], [1, 1], 1)")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "ONEDNN_VERBOSE": "1"}).stdout
        isa = re.search(r"isa:([^,\n]+)", out).group(1).strip()
    except (OSError, subprocess.SubprocessError, AttributeError):
        isa = "not reported"
    return (f"{model} ({os.cpu_count()} cores; flags: {' '.join(present)}; oneDNN ISA: {isa}; "
            f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()})")


def cuda_kernel_missing() -> Optional[str]:
    """Why ours cannot run on CUDA, or None: without a CUDA library ms_deform_attn would quietly run the
    reference, which is not what this benchmark measures."""
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    if "cuda" not in _compiled_devices:
        return "deform_conv's CUDA library is not loaded"
    t = make_inputs(Config("decoder", "fp32", "fwd", "cuda"))
    try:
        torch.ops.deform_conv.ms_deform_attn(*t.values())
    except NotImplementedError as exc:
        return f"ms_deform_attn has no CUDA kernel in this build ({str(exc).splitlines()[0]})"
    return None


# -- the table ----------------------------------------------------------------------------------------------------


def verdict(ratio: float, phase: str, peaks: Tuple[Optional[float], Optional[float]]) -> str:
    missed = []
    if ratio < TARGETS[phase]:
        missed.append(f"speed-up < {TARGETS[phase]:g}x")
    if peaks[0] is not None and peaks[1] is not None and peaks[0] >= peaks[1]:
        missed.append("peak memory not lower")
    return "met" if not missed else "not met (" + "; ".join(missed) + ")"


HEADER = ("| case | Lq | dtype | pass | ours ms | grid_sample ms | speed-up | target | peak MiB: ours | grid_sample "
          "| targets |\n|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|")


def _mib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1f}" if value < 10 else f"{value:.0f}"


def run(device: str, threads: int, min_seconds: float, cases: Sequence[str], dtypes: Sequence[str],
        memory: bool) -> List[dict]:
    rows = []
    for case in cases:
        for dtype in dtypes:
            for phase in PHASES:
                config = Config(case, dtype, phase, device)
                t = medians({impl: make_call(impl, config) for impl in IMPLEMENTATIONS}, threads, min_seconds)
                peaks = tuple(peak_mib(config, impl, threads) if memory else None for impl in IMPLEMENTATIONS)
                ratio = t["grid_sample"] / t["ours"]
                row = dict(case=case, queries=CASES[case], dtype=dtype, phase=phase, ours=t["ours"],
                           grid_sample=t["grid_sample"], ratio=ratio, peaks=peaks,
                           verdict=verdict(ratio, phase, peaks))
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


def format_row(r: dict) -> str:
    return (f"| {r['case']} | {r['queries']} | {r['dtype']} | {r['phase']} | {r['ours'] * 1e3:.1f} "
            f"| {r['grid_sample'] * 1e3:.1f} | {r['ratio']:.1f}x | {TARGETS[r['phase']]:g}x | {_mib(r['peaks'][0])} "
            f"| {_mib(r['peaks'][1])} | {r['verdict']} |")


def outside_fraction() -> float:
    """Share of the sampling locations outside [0, 1] (either coordinate), over both cases."""
    outside = total = 0
    for case in CASES:
        loc = make_inputs(Config(case, "fp32", "fwd"))["sampling_locations"]
        outside += int(((loc < 0) | (loc > 1)).any(-1).sum())
        total += loc[..., 0].numel()
    return outside / total


def environment(device: str, threads: int) -> str:
    machine = (f"{torch.cuda.get_device_name(0)}; CUDA {torch.version.cuda}" if device == "cuda"
               else f"{cpu_description()}; {threads} threads")
    return (f"{machine}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"deform_conv {deform_conv.__version__}; malloc's trimming off for the timings (see steady_malloc)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU (default 2)")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="time spent per measurement")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated: encoder, decoder")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated: fp32, bf16")
    parser.add_argument("--no-memory", action="store_true", help="leave out the peak memory")
    parser.add_argument("--out", type=Path, help="also write the table, with its header, to this markdown file")
    parser.add_argument("--peak-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peak_child:
        config, impl, threads = json.loads(args.peak_child)
        print(peak_child(Config(**config), impl, threads))
        return 0
    cases, dtypes = args.cases.split(","), args.dtypes.split(",")
    for name, chosen, known in (("--cases", cases, CASES), ("--dtypes", dtypes, DTYPES)):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            parser.error(f"{name} must name some of {', '.join(known)}, got {', '.join(unknown)}")
    if args.device == "cuda":
        missing = cuda_kernel_missing()
        if missing:
            print(f"ms_deform_attn CUDA benchmark: nothing to measure: {missing}")
            return 0
        # Memory through torch.cuda in this process; timings synchronise through torch.utils.benchmark.
    else:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/ms_deform_attn_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"# Multi-scale deformable attention, {args.device.upper()}: ours vs the grid_sample version", "",
        f"Command: `{command.strip()}`", "",
        environment(args.device, args.threads), "",
        f"Deformable DETR on an {IMAGE[0]}x{IMAGE[1]} image: batch {BATCH}, levels (H, W) {LEVELS} (strides "
        f"{', '.join(map(str, STRIDES))}; S = {PIXELS}), {HEADS} heads x {CHANNELS} channels, {POINTS} points; "
        f"encoder Lq = S, decoder Lq = {CASES['decoder']}; {outside_fraction():.1%} of the sampling locations "
        "outside [0, 1]. Times: medians (torch.utils.benchmark, the two implementations taking turns); speed-up = "
        "grid_sample / ours; peak: the rise during one call (fwd under no_grad).", "",
        HEADER,
    ]
    print("\n".join(lines), flush=True)
    load = os.getloadavg()[0]
    rows = run(args.device, args.threads, args.min_seconds, cases, dtypes, memory=not args.no_memory)
    # Other work on the machine slows both implementations alike only on average: a loaded machine's times are
    # noisy, and the table says how loaded it was.
    note = (f"Load average (1 min): {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on "
            f"{os.cpu_count()} cores. A load above the benchmark's own {args.threads} threads means other work "
            "shared the cores: the times are then noisy, the ratios less so (the implementations take turns).")
    print(note)
    lines += [format_row(r) for r in rows] + ["", note, ""]
    write_table(args.out, lines)
    return 0


def write_table(path: Optional[Path], lines: Sequence[str]) -> None:
    """The table with its header into the markdown file `path` (--out), if one was given."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines))
        print(f"wrote {path}")


if __name__ == "__main__":
    # As deform-conv bench: for the timings malloc neither trims freed memory nor maps blocks of up to 32 MiB
    # afresh, so that neither implementation's time depends on what the call before it freed. (The peak memory
    # children want the opposite, and get it from MALLOC_MMAP_THRESHOLD_.)
    if "--peak-child" not in sys.argv:
        steady_malloc()
    sys.exit(main())
