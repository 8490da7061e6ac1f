"""How the benchmark measures: malloc held steady, the calls taking turns (interleaved medians), one call of an
implementation on fresh inputs, the peak memory of a forward+backward in a child process, and onnxruntime's
DeformConv as a forward-only peer."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from .cases import IMPLEMENTATIONS, Case, make_inputs, to_channels_last


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
    """Median seconds of each call, the calls taking turns one call at a time (see the module's docstring), in an
    order shuffled every round (seeded, so runs repeat it): the call that runs right after a slow one finds the
    caches, and the scratch memory our calls share, cold. In a fixed order ours in bfloat16, timed right after
    conv2d's bfloat16, took 1.15-1.18x as long as ours in float32 on G6 (AVX2 EPYC), and 0.85x with the two
    swapped; 1.04x with no conv2d between them."""
    for fn in calls.values():
        fn()  # warm-up
    times: Dict[str, List[float]] = {name: [] for name in calls}
    order = list(calls)
    shuffle = random.Random(0).shuffle

    def wants_more(name: str) -> bool:
        done = times[name]
        return len(done) < 3 or (sum(done) < min_seconds and len(done) < 50)

    while any(wants_more(name) for name in calls):
        shuffle(order)
        for name in order:
            if wants_more(name):
                start = _now(device)
                calls[name]()
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
# above the mark, which made small rises come out negative. The mark is read through the same counters (T1's rise
# once read 5 pages below it): a rise of a maximum is never negative, so a reading below the mark is the counters'
# lag and counts as none.
before = status("VmHWM:")
fn(case, leaves).sum().backward()
# Scratch memory our CPU kernels keep from call to call is resident since the first call: count it too.
kept = 0
if impl == "ours" and hasattr(torch.ops.deform_conv, "kept_scratch_bytes"):  # absent when the reference runs
    kept = torch.ops.deform_conv.kept_scratch_bytes() / 1024
print((max(0, status("VmHWM:") - before) + kept) / 1024)
"""


def peak_memory_mib(case: Case, impl: str) -> Optional[float]:
    """Rise of the peak resident memory during one forward+backward, in MiB (None where /proc cannot tell)."""
    if not Path("/proc/self/clear_refs").exists():
        return None
    src = str(Path(__file__).resolve().parents[2])  # the folder that holds deform_conv/
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
