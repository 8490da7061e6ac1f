"""Measures the loader: the machine's header cost (one unit that includes only <ATen/ATen.h> and <torch/library.h>,
compiled with the library's flags), the cold build of the CPU library, the cold build of the CPU and CUDA libraries
for one GPU arch (where nvcc is there), an incremental rebuild after one source changes, each unit's compile time
(from ninja's log), and the warm import overhead of `import deform_conv` over `import torch`. Writes
benchmarks/results/loader.md.

    python benchmarks/loader.py [--repeats 15] [--cuda-arch 9.0] [--skip-cuda]

Builds run in fresh temporary caches with the machine's default MAX_JOBS; run it on an otherwise idle machine (the
table gives the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch
from torch.utils import cpp_extension

RESULTS = Path(__file__).resolve().parent / "results" / "loader.md"
PACKAGE = Path(__file__).resolve().parents[1] / "src" / "deform_conv"

IMPORT_OVERHEAD = (
    "import time, torch\n"
    "start = time.perf_counter()\n"
    "import deform_conv\n"
    "print(time.perf_counter() - start, deform_conv.libraries[0].from_cache)\n"
)


def run(command: List[str], cache: str, **extra: str) -> subprocess.CompletedProcess:
    # Bytecode cached as on a user's machine (PYTHONDONTWRITEBYTECODE would make every import compile the package's
    # modules again, tens of ms that are not the loader's).
    dropped = ("TORCH_CUDA_ARCH_LIST", "PYTHONDONTWRITEBYTECODE")
    env = {**{k: v for k, v in os.environ.items() if k not in dropped}, "DEFORM_CONV_CACHE_DIR": cache, **extra}
    return subprocess.run(command, capture_output=True, text=True, env=env, check=True)


def yardstick_seconds(repeats: int = 3) -> float:
    """Median wall time of compiling a unit that includes only <ATen/ATen.h> and <torch/library.h>, with the flags
    cpp_extension gives the library's units: what torch's headers cost on this machine."""
    sys.path.insert(0, str(PACKAGE / "_jit"))
    import sources  # plain data (setup.py reads it the same way)

    standard = "-std=c++17" if torch.__version__ < "2.10" else "-std=c++20"
    flags = [standard, "-fPIC", *sources.CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
             *(f"-isystem{path}" for path in cpp_extension.include_paths())]
    times = []
    with tempfile.TemporaryDirectory() as directory:
        unit = Path(directory) / "headers.cpp"
        unit.write_text("#include <ATen/ATen.h>\n#include <torch/library.h>\n")
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run([os.environ.get("CXX", "c++"), *flags, "-c", str(unit), "-o", str(unit.with_suffix(".o"))],
                           check=True)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def entry_keys(cache: str) -> Dict[str, dict]:
    """{entry name: key} of the cache's entries."""
    return {p.name: json.loads((p / "key.json").read_text()) for p in Path(cache).iterdir()
            if (p / "key.json").is_file()}


def units_row(key: dict) -> str:
    units = sorted(key["unit_seconds"].items(), key=lambda unit: -unit[1])
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in units)


def cpu_model() -> str:
    cpu = platform.processor() or platform.machine()
    try:  # the CPU's model name, which platform.processor() does not give on Linux
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name")) + f", {cpu}"
    except (OSError, StopIteration):
        pass
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cuda-arch", default="9.0")
    parser.add_argument("--skip-cuda", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    yardstick = yardstick_seconds()
    rows = [f"| one unit of only `<ATen/ATen.h>` + `<torch/library.h>` (the machine's header cost), median of 3 | "
            f"{yardstick:.1f} s | 1.0 |"]
    units: List[str] = []

    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        cold_seconds, from_cache = run([sys.executable, "-c", IMPORT_OVERHEAD], cache, DEFORM_CONV_CUDA="0") \
            .stdout.split()
        cold_wall = time.perf_counter() - start
        assert from_cache == "False"
        ((cpu_name, cpu_key),) = entry_keys(cache).items()
        tag = cpu_name.split("-torch")[0]  # the entry's tag names the instruction set: cpu-avx512f, ...
        rows.append(f"| cold: `import deform_conv` with an empty cache, CPU library for this CPU ({tag}; "
                    f"{cold_wall:.1f} s for the whole process) | {float(cold_seconds):.1f} s | "
                    f"{float(cold_seconds) / yardstick:.1f} |")
        units.append(f"| CPU ({tag}), cold | {cpu_key['build_seconds']:.1f} s | {units_row(cpu_key)} |")
        warm = []
        for _ in range(args.repeats):
            seconds, from_cache = run([sys.executable, "-c", IMPORT_OVERHEAD], cache, DEFORM_CONV_CUDA="0") \
                .stdout.split()
            assert from_cache == "True"
            warm.append(float(seconds))
        rows.append(f"| warm: `import deform_conv` after `import torch`, median of {args.repeats} processes | "
                    f"{1e3 * statistics.median(warm):.1f} ms (min {1e3 * min(warm):.1f}, max {1e3 * max(warm):.1f}) | |")

        # One source edited, as during development: a line appended to a kernel file for the rebuild, then the
        # file restored as it was (its bytes and its mtime).
        edited = PACKAGE / "csrc" / "ms_deform_attn" / "cpu" / "ms_deform_attn_cpu.cpp"
        original, stat = edited.read_bytes(), edited.stat()
        before = set(entry_keys(cache))
        try:
            edited.write_bytes(original + b"// edited\n")
            start = time.perf_counter()
            run([sys.executable, "-c", "import deform_conv"], cache, DEFORM_CONV_CUDA="0")
            rebuild_wall = time.perf_counter() - start
        finally:
            edited.write_bytes(original)
            os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        (rebuilt,) = [k for name, k in entry_keys(cache).items() if name not in before]
        rows.append(f"| incremental: the same after one line of `ms_deform_attn/cpu/ms_deform_attn_cpu.cpp` changed "
                    f"({rebuild_wall:.1f} s for the whole process; {len(rebuilt['reused_units'])} of "
                    f"{len(rebuilt['unit_sha256'])} units reused) | {rebuilt['build_seconds']:.1f} s | |")
        units.append(f"| CPU, after that edit | {rebuilt['build_seconds']:.1f} s | {units_row(rebuilt)} |")

    with tempfile.TemporaryDirectory() as cache:  # the library to copy to other machines, as every build was before
        start = time.perf_counter()
        run([sys.executable, "-m", "deform_conv", "build", "--cpu-only", "--portable"], cache)
        portable_wall = time.perf_counter() - start
        (portable_key,) = entry_keys(cache).values()
    rows.append(f"| cold: `deform-conv build --cpu-only --portable`, the CPU library for every x86-64 CPU (whole "
                f"process) | {portable_wall:.1f} s | {portable_wall / yardstick:.1f} |")
    units.append(f"| CPU (portable), cold | {portable_key['build_seconds']:.1f} s | {units_row(portable_key)} |")

    nvcc = shutil.which("nvcc") or (Path(cpp_extension.CUDA_HOME or "/nonexistent") / "bin" / "nvcc")
    if not args.skip_cuda and torch.version.cuda and Path(nvcc).exists():
        with tempfile.TemporaryDirectory() as cache:
            start = time.perf_counter()
            run([sys.executable, "-m", "deform_conv", "build", "--cuda-arch", args.cuda_arch], cache)
            both_wall = time.perf_counter() - start
            keys = entry_keys(cache)
        rows.append(f"| cold: `deform-conv build --cuda-arch {args.cuda_arch}`, CPU and CUDA libraries compiled at "
                    f"once (whole process) | {both_wall:.1f} s | {both_wall / yardstick:.1f} |")
        for name, key in sorted(keys.items()):
            units.append(f"| {name.split('-')[0].upper()}, compiled beside the other | {key['build_seconds']:.1f} s | "
                         f"{units_row(key)} |")

    lines = [
        "# Loader: build times and warm import",
        "",
        f"Machine: {os.cpu_count()} cores ({cpu_model()}), Python {platform.python_version()}, torch "
        f"{torch.__version__}, MAX_JOBS {os.environ.get('MAX_JOBS', 'default')}; load average "
        f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after. Command: `python benchmarks/loader.py`.",
        "",
        "| what | time | / header cost |",
        "|---|---|---|",
        *rows,
        "",
        "Targets: cold CPU build <= 3x the header cost (20 s on the 2-core Sapphire Rapids Xeon), cold CPU + CUDA for "
        "one arch <= 9x (60 s there); warm import overhead about 20-25 ms.",
        "",
        "Each library's units, from ninja's log (the units run two at a time on two cores, so they add up to more "
        "than the build):",
        "",
        "| build | total | units, slowest first |",
        "|---|---|---|",
        *units,
    ]
    text = "\n".join(lines) + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
