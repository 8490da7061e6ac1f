"""The main CPU table (`deform-conv bench`): per case the forward and forward+backward times of ours,
torchvision's and conv2d, onnxruntime's forward, the ratios and the peak memory (cpu.md), and its plot (cpu.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

from .cases import IMPLEMENTATIONS, PHASES, Case
from .environment import environment
from .report import _document, _mib, _ms
from .timing import interleaved_medians, make_call, onnxruntime_call, peak_memory_mib


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
