"""A smoke run of the CPU benchmark suite (tiny shapes, seconds) so that it cannot rot; the full run is
`python benchmarks/cpu_speed.py --extra`, not a test. Likewise the GPU check's memcheck case, run on the CPU."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from deform_conv import _bench


def test_smoke_benchmark_measures_every_column():
    rows = _bench.run(_bench.SMOKE_CASES, min_seconds=0.01, memory=True, onnx=True)
    assert [r["case"] for r in rows] == ["T1", "T2"]
    for row in rows:
        for impl in ("ours", "torchvision", "conv2d"):
            for phase in ("fwd", "fwdbwd"):
                value = row[f"{impl}_{phase}"]
                assert math.isfinite(value) and value > 0, (impl, phase, value)
        for impl in ("ours", "torchvision"):
            assert row[f"{impl}_peak_mib"] is None or row[f"{impl}_peak_mib"] >= 0


def test_bench_command_writes_the_table(tmp_path):
    result = subprocess.run([sys.executable, "-m", "deform_conv", "bench", "--smoke", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "cpu.md").read_text()
    assert "| case | config | fwd ms: ours |" in table
    assert "| T1 |" in table and "| T2 |" in table and "torch " in table


def test_interleaved_medians_call_each_at_least_three_times_in_turns():
    order = []
    medians = _bench.interleaved_medians({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                                         min_seconds=0.0)
    assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())
    assert order == ["a", "b"] * 4  # a warm-up each, then three rounds of one call each


def test_gpu_memcheck_case_runs_on_the_cpu():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_memcheck_case.py"
    result = subprocess.run([sys.executable, str(script), "cpu"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "memcheck case ran on cpu" in result.stdout
