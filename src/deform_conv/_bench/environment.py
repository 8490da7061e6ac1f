"""The environment line every results file starts with: the CPU, cores and threads, the versions, the dtype, and
oneDNN's ISA (for a half dtype also how conv2d and ours run it)."""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
import sys
from typing import Dict, Optional, Sequence

import torch

from .cases import dtype_name


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


def _half_notes(dtype: torch.dtype) -> str:
    """The half table's additions to the environment line: how conv2d and ours run `dtype` here."""
    name = dtype_name(dtype)
    through = onednn_runs_conv2d(dtype)
    notes = "" if through is None else f"; conv2d's {name} through oneDNN: {'yes' if through else 'no'}"
    path = half_path(dtype)
    return notes + ("" if path is None else f"; ours' {name} path: {path}")


# The instruction sets the kernels' speed depends on, as /proc/cpuinfo's flags name them, and as the tables do.
_VECTOR_FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"),
                    ("avx512_fp16", "AVX512-FP16"), ("amx_bf16", "AMX"))


def first_processor(cpuinfo: str) -> Dict[str, str]:
    """The fields of the first processor in /proc/cpuinfo's text ("vendor_id", "model name", "flags", ...)."""
    fields: Dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def parse_cpu(cpuinfo: str) -> Optional[str]:
    """The first processor of /proc/cpuinfo's text: its model name, family and model (one name may cover several
    generations: "AMD EPYC" is Zen 3 as family 25 model 1 and Zen 4 as family 25 model 17), and which of the vector
    instruction sets the kernels use it has. None where the text names no model."""
    fields = first_processor(cpuinfo)
    if "model name" not in fields:
        return None
    flags = set(fields.get("flags", "").split())
    features = [name for flag, name in _VECTOR_FEATURES if flag in flags]
    where = f"family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}"
    return f"{fields['model name']} ({where}; {', '.join(features) or 'none of AVX2, AVX-512, AMX'})"


def cpu_name() -> str:
    """This machine's CPU (parse_cpu), or what the platform module says where /proc/cpuinfo is not there."""
    try:
        with open("/proc/cpuinfo") as f:
            named = parse_cpu(f.read())
    except OSError:
        named = None
    return named or platform.processor() or platform.machine()


def environment(malloc_steadied: bool = False, dtype: torch.dtype = torch.float32,
                threads: Optional[Sequence[int]] = None) -> str:
    """One line: the CPU, cores and threads (`threads`: the counts of a scaling table), the versions, the dtype,
    and oneDNN's ISA (plus, for a half dtype, how conv2d and ours run it)."""
    cpu = cpu_name()
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
