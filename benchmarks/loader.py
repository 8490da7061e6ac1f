"""Measures the loader: the cold build of the CPU library on this machine, and the warm import overhead of
`import deform_conv` over `import torch` (target: <= 0.15 s). Writes benchmarks/results/loader.md.

    python benchmarks/loader.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "loader.md"

IMPORT_OVERHEAD = (
    "import time, torch\n"
    "start = time.perf_counter()\n"
    "import deform_conv\n"
    "print(time.perf_counter() - start, deform_conv.libraries[0].from_cache)\n"
)


def run(code: str, cache: str) -> str:
    env = {**os.environ, "DEFORM_CONV_CACHE_DIR": cache}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        cold_seconds, from_cache = run(IMPORT_OVERHEAD, cache).split()
        cold_wall = time.perf_counter() - start
        assert from_cache == "False"
        warm = []
        for _ in range(args.repeats):
            seconds, from_cache = run(IMPORT_OVERHEAD, cache).split()
            assert from_cache == "True"
            warm.append(float(seconds))

    cpu = platform.processor() or platform.machine()
    try:  # the CPU's model name, which platform.processor() does not give on Linux
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name")) + f", {cpu}"
    except (OSError, StopIteration):
        pass
    lines = [
        "# Loader: cold build and warm import",
        "",
        f"Machine: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, torch {torch.__version__}, "
        f"MAX_JOBS {os.environ.get('MAX_JOBS', 'default')}. Command: `python benchmarks/loader.py`.",
        "",
        "| what | time |",
        "|---|---|",
        f"| cold: `import deform_conv` with an empty cache (compiles the CPU library) | {float(cold_seconds):.1f} s "
        f"({cold_wall:.1f} s for the whole process) |",
        f"| warm: `import deform_conv` after `import torch`, median of {args.repeats} processes | "
        f"{1e3 * statistics.median(warm):.1f} ms (min {1e3 * min(warm):.1f}, max {1e3 * max(warm):.1f}) |",
        "",
        "Target for the warm import overhead: <= 150 ms.",
    ]
    text = "\n".join(lines) + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
