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
its median is reported; threads = all cores unless --threads says otherwise. The command line also turns malloc's
trimming off (steady_malloc).

Two more CPU tables come from the same timing (their code, and the GPU table's: _bench_tables.py):
`--threads 1,2,4` (a list) times ours and conv2d in fp32 at each thread count (thread scaling, cpu_threads.md),
and `--dtype bfloat16` / `--dtype float16` times ours in that dtype against ours in fp32 and conv2d in that dtype,
NCHW and channels_last (cpu_<dtype>.md); torchvision's CPU kernels have no bfloat16, so it is left out of that
table, as are onnxruntime and the peak memory.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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
    width: Optional[int] = None  # None: a square image, `size` by `size`; otherwise `size` is the height

    def image_size(self) -> Tuple[int, int]:
        """(height, width) of the input image."""
        return self.size, self.size if self.width is None else self.width

    def output_size(self) -> Tuple[int, int]:
        """(height, width) of the output, as conv2d computes it (dilation 1)."""
        height, width = self.image_size()
        return self._output_extent(height), self._output_extent(width)

    def _output_extent(self, extent: int) -> int:
        return (extent + 2 * self.padding - self.kernel) // self.stride + 1

    def describe(self) -> str:
        extra = []
        if self.groups > 1:
            extra.append("depthwise" if self.groups == self.in_channels else f"groups {self.groups}")
        if self.offset_groups > 1:
            extra.append(f"offset_groups {self.offset_groups}")
        extra.append("DCNv2" if self.mask else "DCNv1")
        if (self.kernel, self.stride, self.padding) != (3, 1, 1):
            extra.append(f"k{self.kernel} s{self.stride} p{self.padding}")
        height, width = self.image_size()
        return (f"batch {self.batch}, {self.in_channels}->{self.out_channels}, {height}x{width}, "
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

# Small images and few channels, with weight and offset groups and a non-square image: here the per-call and
# per-group overheads weigh as much as the arithmetic, which the S and X shapes hide.
SMALL_CASES = [
    Case("G1", 16, 32, 48, 80, offset_groups=2, stride=2),
    Case("G2", 3, 60, 60, 33, groups=3, offset_groups=5, width=31),
    Case("G3", 4, 96, 96, 40, kernel=5, padding=2),
]

# Thread scaling runs on these: the shapes of S1-S3 differ in how much work each thread gets.
SCALING_CASES = CASES[:3]

# A few milliseconds each: what CI runs so the suite cannot rot.
SMOKE_CASES = [Case("T1", 2, 8, 8, 10), Case("T2", 2, 8, 8, 10, groups=8, mask=False)]


def make_inputs(case: Case, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
                ) -> Dict[str, torch.Tensor]:
    tensors = _make_inputs(case, seed)
    return {k: (v.to(device=device, dtype=dtype) if v is not None else None) for k, v in tensors.items()}


def _make_inputs(case: Case, seed: int) -> Dict[str, Optional[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    height, width = case.image_size()
    out_h, out_w = case.output_size()
    taps = case.kernel * case.kernel
    return {
        "x": torch.randn(case.batch, case.in_channels, height, width, generator=g),
        "weight": torch.randn(case.out_channels, case.in_channels // case.groups, case.kernel, case.kernel, generator=g)
        / math.sqrt(case.in_channels // case.groups * taps),
        "offset": torch.randn(case.batch, 2 * case.offset_groups * taps, out_h, out_w, generator=g),
        "mask": torch.rand(case.batch, case.offset_groups * taps, out_h, out_w, generator=g) if case.mask else None,
    }


def to_channels_last(tensors: Dict[str, Optional[torch.Tensor]]) -> Dict[str, Optional[torch.Tensor]]:
    """The input and the weight in channels_last, as a model moved with `.to(memory_format=torch.channels_last)`
    would hold them (conv2d picks its layout from both); offset and mask as they are."""
    return {k: (v.contiguous(memory_format=torch.channels_last) if k in ("x", "weight") else v)
            for k, v in tensors.items()}


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

# (name, backward) of the two measurements per implementation.
PHASES = (("fwd", False), ("fwdbwd", True))


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
              dtype: torch.dtype = torch.float32, channels_last: bool = False) -> Callable[[], None]:
    """One forward (under no_grad), or one forward+backward, of `impl` on fresh inputs of `case` (with the input
    and weight in channels_last if asked)."""
    tensors = make_inputs(case, device=device, dtype=dtype)
    if channels_last:
        tensors = to_channels_last(tensors)
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
torch.set_num_threads(int(sys.argv[3]))  # the parent's count: per-thread buffers make the peak depend on it
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
    args = [json.dumps(dataclasses.asdict(case)), impl, str(torch.get_num_threads())]
    child = subprocess.run([sys.executable, "-c", _PEAK_CHILD.format(src=src), *args],
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


# A conv2d big enough for PyTorch to hand it to oneDNN in every dtype oneDNN takes on this CPU: oneDNN prints its
# ISA line when it creates its first primitive, and one convolution line for each it runs (with the dtypes).
_ONEDNN_PROBE = """
import torch, torch.nn.functional as F
with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w = torch.randn(2, 16, 16, 16, dtype=dtype), torch.randn(16, 16, 3, 3, dtype=dtype)
        F.conv2d(x, w)
        F.conv2d(x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last))
"""

# oneDNN's names for the dtypes in its verbose lines.
_ONEDNN_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@functools.cache
def _onednn_verbose() -> str:
    """oneDNN's verbose output for _ONEDNN_PROBE, run in a child process (it goes to the process's stdout, from C,
    and its first line only comes once per process); "" where the child fails."""
    try:
        child = subprocess.run([sys.executable, "-c", _ONEDNN_PROBE], capture_output=True, text=True, timeout=120,
                               check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return child.stdout if child.returncode == 0 else ""


def parse_onednn_isa(verbose: str) -> str:
    """The ISA in a line like `onednn_verbose,v1,info,cpu,isa:Intel AVX2` (`dnnl_verbose,...` from older
    oneDNN); "unknown" where there is none."""
    match = re.search(r"^(?:onednn|dnnl)_verbose,.*?\bcpu,isa:(.+)$", verbose, re.MULTILINE)
    return match.group(1).strip() if match else "unknown"


def onednn_isa() -> str:
    """The instruction set oneDNN dispatches to on this CPU (e.g. `Intel AVX2`), or "unknown"."""
    return parse_onednn_isa(_onednn_verbose())


def onednn_runs_conv2d(dtype: torch.dtype) -> Optional[bool]:
    """Whether PyTorch ran conv2d in `dtype` through oneDNN in the probe (without it, PyTorch's own slower
    kernels run it: the floor the half table compares with is then a different one); None where the probe failed."""
    verbose = _onednn_verbose()
    if not verbose:
        return None
    return any(",convolution," in line and f"src:{_ONEDNN_DTYPES[dtype]}:" in line for line in verbose.splitlines())


def half_path(dtype: torch.dtype) -> Optional[str]:
    """Which path our CPU kernels take for `dtype`, where the loaded library can say (cpu_half_path)."""
    if not hasattr(torch.ops.deform_conv, "cpu_half_path"):
        return None
    return str(torch.ops.deform_conv.cpu_half_path(dtype))


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16, and so on."""
    return str(dtype).replace("torch.", "")


def _half_notes(dtype: torch.dtype) -> str:
    """The half table's additions to the environment line: how conv2d and ours run `dtype` here."""
    name = dtype_name(dtype)
    through = onednn_runs_conv2d(dtype)
    notes = "" if through is None else f"; conv2d's {name} through oneDNN: {'yes' if through else 'no'}"
    path = half_path(dtype)
    return notes + ("" if path is None else f"; ours' {name} path: {path}")


def environment(malloc_steadied: bool = False, dtype: torch.dtype = torch.float32,
                threads: Optional[Sequence[int]] = None) -> str:
    """One line: the CPU, cores and threads (`threads`: the counts of a scaling table), the versions, the dtype,
    and oneDNN's ISA (plus, for a half dtype, how conv2d and ours run it)."""
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

    thread_text = (f"{torch.get_num_threads()} threads" if threads is None
                   else f"{', '.join(map(str, threads))} threads (a row each)")
    label = "fp32" if dtype == torch.float32 else dtype_name(dtype)
    return (f"{cpu}, {os.cpu_count()} cores, {thread_text}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, torchvision {tv}, onnxruntime {ort}, deform_conv {deform_conv.__version__}; "
            + label + ("; malloc's trimming off for the timings (see steady_malloc)" if malloc_steadied else "")
            + f"; oneDNN ISA: {onednn_isa()}" + ("" if dtype == torch.float32 else _half_notes(dtype)))


def run(cases: Sequence[Case], min_seconds: float = 1.0, memory: bool = True, onnx: bool = True) -> List[dict]:
    rows = []
    for case in cases:
        row: Dict[str, object] = {"case": case.name, "config": case.describe()}
        calls = {f"{impl}_{phase}": make_call(case, impl, backward)
                 for impl in IMPLEMENTATIONS for phase, backward in PHASES}
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


def _document(title: str, command: str, env: str, header: str, lines: Sequence[str], notes: Sequence[str] = ()) -> str:
    """A results file: title, command, environment line (and notes), then the table."""
    return "\n".join([f"# {title}", "", f"Command: `{command}`", "", env, "", *[f"{n}\n" for n in notes], header,
                      *lines, ""])


def markdown(rows: List[dict], command: str, malloc_steadied: bool) -> str:
    return _document("CPU speed", command, environment(malloc_steadied), HEADER, [format_row(r) for r in rows])


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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    return parser


def _check_combinations(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses the combinations one table cannot honour (parser.error exits, naming the arguments)."""
    scaling = args.threads is not None and len(args.threads) > 1
    if args.gpu and (args.small or args.dtype != "float32" or args.threads is not None):
        parser.error("argument --gpu: the GPU table has its own cases, dtypes and threads; "
                     "drop --small, --dtype and --threads")
    if scaling and args.dtype != "float32":
        parser.error("argument --threads: a list of counts runs the fp32 scaling table; drop --dtype")
    if scaling and (args.extra or args.small):
        parser.error("argument --threads: a list of counts runs on S1-S3 (or --smoke's shapes); drop --extra and "
                     "--small")


def command_line(args: argparse.Namespace) -> str:
    """The command a results file names: the flags that choose what was run."""
    parts = ["deform-conv bench"] + [f"--{flag}" for flag in ("smoke", "extra", "small") if getattr(args, flag)]
    if args.threads is not None:
        parts.append("--threads " + ",".join(map(str, args.threads)))
    if args.dtype != "float32":
        parts.append(f"--dtype {args.dtype}")
    return " ".join(parts)


def _write(out: Optional[Path], name: str, text: str) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
        print(f"wrote {out / name}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_combinations(parser, args)
    from . import _bench_tables  # (which imports this module)

    if args.gpu:
        return _bench_tables.gpu_main(args.out, min_seconds=min(args.min_seconds, 0.3))
    cases = (SMOKE_CASES if args.smoke
             else CASES + (EXTRA_CASES if args.extra else []) + (SMALL_CASES if args.small else []))
    min_seconds = 0.05 if args.smoke else args.min_seconds
    steadied = steady_malloc()  # for this process, which ends with the run
    if args.threads is not None and len(args.threads) > 1:
        return _bench_tables.threads_main(parser, args, min_seconds, steadied)
    if args.threads is not None:
        torch.set_num_threads(args.threads[0])
    if args.dtype != "float32":
        return _bench_tables.half_main(args, cases, min_seconds, steadied)
    print(environment(steadied))
    print(HEADER)
    rows = run(cases, min_seconds=min_seconds, memory=True, onnx=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu.md").write_text(markdown(rows, command_line(args), steadied))
        plotted = plot(rows, args.out / "cpu.png")
        print(f"wrote {args.out / 'cpu.md'}" + (f" and {args.out / 'cpu.png'}" if plotted else " (no plot: matplotlib missing)"))
    return 0
