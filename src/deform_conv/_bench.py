"""Benchmark suite (`deform-conv bench [--gpu]`, `python benchmarks/cpu_speed.py`).

For each case: forward and forward+backward time of ours, of torchvision's deform_conv2d and of conv2d at the
same shape (the floor), the ratios, and the peak memory of ours and torchvision's during a forward+backward
(measured in a child process each: the rise of the resident set's high-water mark over what the inputs occupy,
with malloc made to return freed blocks at once so that the resident set follows the live memory; for ours plus
the scratch memory its kernels keep between calls). onnxruntime's DeformConv runs as a forward-only peer where it
is installed, timed on its own after the others (its threads spin for a while after each run, on the cores the
next implementation would need). Timing: one warm-up call each, then
ours, torchvision's and conv2d take turns, one call each per round, so that all of them meet the same machine (a
shared machine's load drifts within seconds, and measured one after the other the ratios would measure the
drift); each is called until at least ``min_seconds`` of its calls have passed (at least 3, at most 50 calls) and
its median is reported; threads = all cores. The command line also turns malloc's trimming off (steady_malloc).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    in_channels: int
    out_channels: int
    size: int
    groups: int = 1
    offset_groups: int = 1
    mask: bool = True
    kernel: int = 3
    stride: int = 1
    padding: int = 1

    def describe(self) -> str:
        extra = []
        if self.groups > 1:
            extra.append("depthwise" if self.groups == self.in_channels else f"groups {self.groups}")
        if self.offset_groups > 1:
            extra.append(f"offset_groups {self.offset_groups}")
        extra.append("DCNv2" if self.mask else "DCNv1")
        if (self.kernel, self.stride, self.padding) != (3, 1, 1):
            extra.append(f"k{self.kernel} s{self.stride} p{self.padding}")
        return (f"batch {self.batch}, {self.in_channels}->{self.out_channels}, {self.size}x{self.size}, "
                + ", ".join(extra))


CASES = [
    Case("S1", 8, 64, 64, 56),
    Case("S2", 4, 256, 256, 28),
    Case("S3", 2, 512, 512, 14),
    Case("S4", 8, 128, 128, 28, groups=128),
    Case("S5", 4, 128, 128, 32, offset_groups=4, mask=False),
]

# Shapes beyond the five: other kernel sizes, strides and group counts, so the speed is not tuned to a list.
EXTRA_CASES = [
    Case("X1", 4, 96, 192, 40, kernel=5, stride=2, padding=2),
    Case("X2", 4, 128, 128, 28, groups=4, offset_groups=2),
    Case("X3", 2, 48, 96, 64, kernel=1, padding=0, offset_groups=3, mask=False),
]

# A few milliseconds each: what CI runs so the suite cannot rot.
SMOKE_CASES = [Case("T1", 2, 8, 8, 10), Case("T2", 2, 8, 8, 10, groups=8, mask=False)]


def make_inputs(case: Case, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
                ) -> Dict[str, torch.Tensor]:
    tensors = _make_inputs(case, seed)
    return {k: (v.to(device=device, dtype=dtype) if v is not None else None) for k, v in tensors.items()}


def _make_inputs(case: Case, seed: int) -> Dict[str, Optional[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = (case.size + 2 * case.padding - case.kernel) // case.stride + 1
    taps = case.kernel * case.kernel
    return {
        "x": torch.randn(case.batch, case.in_channels, case.size, case.size, generator=g),
        "weight": torch.randn(case.out_channels, case.in_channels // case.groups, case.kernel, case.kernel, generator=g)
        / math.sqrt(case.in_channels // case.groups * taps),
        "offset": torch.randn(case.batch, 2 * case.offset_groups * taps, out, out, generator=g),
        "mask": torch.rand(case.batch, case.offset_groups * taps, out, out, generator=g) if case.mask else None,
    }


def _ours(case: Case, t: Dict[str, torch.Tensor]) -> torch.Tensor:
    import deform_conv

    return deform_conv.deform_conv2d(t["x"], t["offset"], t["weight"], None, case.stride, case.padding, 1, t["mask"])


def _torchvision(case: Case, t: Dict[str, torch.Tensor]) -> torch.Tensor:
    import torchvision

    return torchvision.ops.deform_conv2d(t["x"], t["offset"], t["weight"], None, case.stride, case.padding, 1,
                                         t["mask"])


def _conv2d(case: Case, t: Dict[str, torch.Tensor]) -> torch.Tensor:
    return F.conv2d(t["x"], t["weight"], None, case.stride, case.padding, 1, case.groups)


IMPLEMENTATIONS: Dict[str, Callable[[Case, Dict[str, torch.Tensor]], torch.Tensor]] = {
    "ours": _ours,
    "torchvision": _torchvision,
    "conv2d": _conv2d,
}


def steady_malloc() -> bool:
    """Stops glibc's malloc, in this process, from handing freed memory back to the kernel (trimming) and from
    mapping blocks of up to 32 MiB afresh on every allocation, so that no implementation's time depends on what
    the call before it freed. Without this, conv2d's own S1 forward took 8.6 ms in one process and 15.6 ms in
    another (4,500 page faults a call). False where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    return bool(mallopt(m_trim_threshold, 1 << 30)) and bool(mallopt(m_mmap_threshold, 32 << 20))


def _now(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def interleaved_medians(calls: Dict[str, Callable[[], object]], min_seconds: float, device: str = "cpu"
                        ) -> Dict[str, float]:
    """Median seconds of each call, the calls taking turns one call at a time (see the module's docstring)."""
    for fn in calls.values():
        fn()  # warm-up
    times: Dict[str, List[float]] = {name: [] for name in calls}

    def wants_more(name: str) -> bool:
        done = times[name]
        return len(done) < 3 or (sum(done) < min_seconds and len(done) < 50)

    while any(wants_more(name) for name in calls):
        for name, fn in calls.items():
            if wants_more(name):
                start = _now(device)
                fn()
                times[name].append(_now(device) - start)
    return {name: statistics.median(done) for name, done in times.items()}


def make_call(case: Case, impl: str, backward: bool, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> Callable[[], None]:
    """One forward (under no_grad), or one forward+backward, of `impl` on fresh inputs of `case`."""
    tensors = make_inputs(case, device=device, dtype=dtype)
    fn = IMPLEMENTATIONS[impl]
    if not backward:
        def call() -> None:
            with torch.no_grad():
                fn(case, tensors)
        return call
    leaves = {k: (v.requires_grad_() if v is not None and (impl != "conv2d" or k in ("x", "weight")) else v)
              for k, v in tensors.items()}
    grad_output = torch.randn_like(fn(case, leaves))

    def call_backward() -> None:
        fn(case, leaves).backward(grad_output)
        for v in leaves.values():
            if v is not None:
                v.grad = None
    return call_backward


_PEAK_CHILD = """
import json, sys, torch
sys.path.insert(0, {src!r})
from deform_conv import _bench
case = _bench.Case(**json.loads(sys.argv[1]))
impl = sys.argv[2]
tensors = _bench.make_inputs(case)
leaves = {{k: (v.requires_grad_() if v is not None else v) for k, v in tensors.items()}}
fn = _bench.IMPLEMENTATIONS[impl]
fn(case, leaves).sum().backward()  # first call: one-time allocations (thread pools, caches)
for v in leaves.values():
    if v is not None: v.grad = None
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the high-water mark to the current resident set
# The rise is measured from the reset mark itself: VmRSS is summed from per-CPU counters and may read a few pages
# above the mark, which made small rises come out negative.
before = status("VmHWM:")
fn(case, leaves).sum().backward()
# Scratch memory our CPU kernels keep from call to call is resident since the first call: count it too.
kept = 0
if impl == "ours" and hasattr(torch.ops.deform_conv, "kept_scratch_bytes"):  # absent when the reference runs
    kept = torch.ops.deform_conv.kept_scratch_bytes() / 1024
print((status("VmHWM:") - before + kept) / 1024)
"""


def peak_memory_mib(case: Case, impl: str) -> Optional[float]:
    """Rise of the peak resident memory during one forward+backward, in MiB (None where /proc cannot tell)."""
    if not Path("/proc/self/clear_refs").exists():
        return None
    src = str(Path(__file__).resolve().parents[1])
    # A fixed mmap threshold: every block of 64 KiB or more is mapped when allocated and unmapped when freed,
    # so the resident set follows the live memory instead of what malloc happens to keep for reuse.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    child = subprocess.run([sys.executable, "-c", _PEAK_CHILD.format(src=src), json.dumps(dataclasses.asdict(case)), impl],
                           capture_output=True, text=True, timeout=1800, env=env)
    if child.returncode != 0:
        raise RuntimeError(f"peak memory of {impl} on {case.name} failed:\n{child.stderr[-2000:]}")
    return float(child.stdout.strip().splitlines()[-1])


def onnxruntime_call(case: Case) -> Optional[Callable[[], object]]:
    """A forward of onnxruntime's DeformConv (opset 19), or None where onnxruntime (or its kernel) is missing."""
    try:
        import onnx
        import onnxruntime
        from onnx import TensorProto, helper
    except ImportError:
        return None
    t = make_inputs(case)
    names = ["x", "weight", "offset", "", "mask"] if case.mask else ["x", "weight", "offset"]
    node = helper.make_node(
        "DeformConv", names, ["y"], kernel_shape=[case.kernel] * 2, strides=[case.stride] * 2,
        pads=[case.padding] * 4, dilations=[1, 1], group=case.groups, offset_group=case.offset_groups,
    )
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(t[n].shape)) for n in names if n]
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph([node], "deform_conv", inputs, [output]),
                              opset_imports=[helper.make_opsetid("", 19)])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    try:
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:  # no DeformConv kernel in this onnxruntime
        return None
    feeds = {n: t[n].numpy() for n in names if n}
    return lambda: session.run(None, feeds)


def environment(malloc_steadied: bool = False) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import torchvision
        tv = torchvision.__version__
    except ImportError:
        tv = "not installed"
    try:
        import onnxruntime
        ort = onnxruntime.__version__
    except ImportError:
        ort = "not installed"
    import deform_conv

    return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads; Python {platform.python_version()}, "
            f"torch {torch.__version__}, torchvision {tv}, onnxruntime {ort}, deform_conv {deform_conv.__version__}; "
            "fp32" + ("; malloc's trimming off for the timings (see steady_malloc)" if malloc_steadied else ""))


def run(cases: Sequence[Case], min_seconds: float = 1.0, memory: bool = True, onnx: bool = True) -> List[dict]:
    rows = []
    for case in cases:
        row: Dict[str, object] = {"case": case.name, "config": case.describe()}
        calls = {f"{impl}_{phase}": make_call(case, impl, backward)
                 for impl in IMPLEMENTATIONS for phase, backward in (("fwd", False), ("fwdbwd", True))}
        row.update(interleaved_medians(calls, min_seconds))
        onnxruntime = onnxruntime_call(case) if onnx else None
        row["onnxruntime_fwd"] = (interleaved_medians({"ort": onnxruntime}, min_seconds)["ort"]
                                  if onnxruntime is not None else None)
        for impl in ("ours", "torchvision"):
            row[f"{impl}_peak_mib"] = peak_memory_mib(case, impl) if memory else None
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def _ms(seconds: Optional[float]) -> str:
    return "n/a" if seconds is None else f"{1e3 * seconds:.2f}"


def _mib(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0f}"


HEADER = (
    "| case | config | fwd ms: ours | torchvision | conv2d | onnxruntime | ours/conv2d | ours/tv "
    "| fwd+bwd ms: ours | torchvision | conv2d | ours/conv2d | ours/tv | peak MiB: ours | torchvision |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def format_row(r: dict) -> str:
    return (
        f"| {r['case']} | {r['config']} | {_ms(r['ours_fwd'])} | {_ms(r['torchvision_fwd'])} | {_ms(r['conv2d_fwd'])} "
        f"| {_ms(r['onnxruntime_fwd'])} | {r['ours_fwd'] / r['conv2d_fwd']:.2f} "
        f"| {r['ours_fwd'] / r['torchvision_fwd']:.3f} | {_ms(r['ours_fwdbwd'])} | {_ms(r['torchvision_fwdbwd'])} "
        f"| {_ms(r['conv2d_fwdbwd'])} | {r['ours_fwdbwd'] / r['conv2d_fwdbwd']:.2f} "
        f"| {r['ours_fwdbwd'] / r['torchvision_fwdbwd']:.3f} | {_mib(r['ours_peak_mib'])} "
        f"| {_mib(r['torchvision_peak_mib'])} |"
    )


def markdown(rows: List[dict], command: str, malloc_steadied: bool) -> str:
    return "\n".join(["# CPU speed", "", f"Command: `{command}`", "", environment(malloc_steadied), "", HEADER,
                      *[format_row(r) for r in rows], ""])


def plot(rows: List[dict], path: Path) -> bool:
    """Bar chart of the ratios to conv2d, forward and forward+backward (False where matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["case"] for r in rows]
    for ax, phase in zip(axes, ("fwd", "fwdbwd")):
        width = 0.38
        xs = range(len(rows))
        ours = [r[f"ours_{phase}"] / r[f"conv2d_{phase}"] for r in rows]
        theirs = [r[f"torchvision_{phase}"] / r[f"conv2d_{phase}"] for r in rows]
        ax.bar([x - width / 2 for x in xs], ours, width, label="deform_conv")
        ax.bar([x + width / 2 for x in xs], theirs, width, label="torchvision")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("time / conv2d time (log scale)")
        ax.set_title("forward" if phase == "fwd" else "forward + backward")
        ax.legend()
    fig.suptitle("Deformable convolution on the CPU, relative to conv2d of the same shape (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="deform-conv bench", description="CPU benchmark: ours vs torchvision vs conv2d")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, seconds (what CI runs)")
    parser.add_argument("--extra", action="store_true", help="also the shapes beyond S1-S5")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="time spent per measurement")
    parser.add_argument("--out", type=Path, default=None, help="directory for cpu.md and cpu.png (gpu.md)")
    parser.add_argument("--gpu", action="store_true", help="S1-S5 at batch 32 on the GPU, fp32 and bf16")
    args = parser.parse_args(argv)
    if args.gpu:
        return gpu_main(args.out, min_seconds=min(args.min_seconds, 0.3))
    cases = SMOKE_CASES if args.smoke else CASES + (EXTRA_CASES if args.extra else [])
    min_seconds = 0.05 if args.smoke else args.min_seconds
    steadied = steady_malloc()  # for this process, which ends with the run
    print(environment(steadied))
    print(HEADER)
    rows = run(cases, min_seconds=min_seconds, memory=True, onnx=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "deform-conv bench" + (" --smoke" if args.smoke else "") + (" --extra" if args.extra else "")
        (args.out / "cpu.md").write_text(markdown(rows, command, steadied))
        plotted = plot(rows, args.out / "cpu.png")
        print(f"wrote {args.out / 'cpu.md'}" + (f" and {args.out / 'cpu.png'}" if plotted else " (no plot: matplotlib missing)"))
    return 0
