"""DCNv3 on the CPU: ours (``deform_conv.dcnv3``) against InternImage's pure-PyTorch ``dcnv3_core_pytorch`` (the
only other CPU path; the unchanged copy in tests/upstream_models, run on ``install_dcnv3()``'s ``DCNv3`` stand-in,
which it imports) and against a depthwise 3x3 ``conv2d`` in channels_last of the same shape (the floor: DCNv3 reads
four corners of nine points where that conv reads nine pixels), on the same inputs.

    python benchmarks/dcnv3_speed.py [--threads 2] [--dtype float32] [--out benchmarks/results/dcnv3_cpu.md]

Shapes: InternImage-T's four stages at batch 2 (56x56 C 64 G 4; 28x28 C 128 G 8; 14x14 C 256 G 16; 7x7 C 512 G 32),
3x3, padding 1, offset_scale 1, offsets N(0, 1) pixels and the mask a softmax over each group's 9 points, as the
module makes them. Forward (under no_grad) and forward+backward (gradients of input, offset and mask; for conv2d of
input and weight). Times: the three take turns call by call (deform_conv._bench.timing.interleaved_medians), the
median reported. Peak memory: the rise of the resident set's high-water mark during one forward+backward after a
warm-up one, in a child process per measurement (as `deform-conv bench` measures it). Targets, reported as met or
not (nothing is asserted): ours >= 2x faster than the core forward and forward+backward, <= 5x the depthwise conv2d
forward and <= 8x its forward+backward, peak memory below the core's.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the upstream copy

import deform_conv  # noqa: E402
from deform_conv._bench.timing import interleaved_medians, steady_malloc  # noqa: E402
from deform_conv.compat import install_dcnv3  # noqa: E402

install_dcnv3()
from upstream_models.internimage_ops_dcnv3.functions.dcnv3_func import dcnv3_core_pytorch  # noqa: E402

STAGES = {"stage 1": (56, 64, 4), "stage 2": (28, 128, 8), "stage 3": (14, 256, 16), "stage 4": (7, 512, 32)}
BATCH, K = 2, 9
IMPLEMENTATIONS = ("ours", "core", "conv2d")


def inputs(stage: str, dtype: torch.dtype, seed: int = 0):
    size, channels, group = STAGES[stage]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, size, size, channels, generator=g)
    offset = torch.randn(BATCH, size, size, group * K * 2, generator=g)
    mask = torch.randn(BATCH, size, size, group, K, generator=g).softmax(-1).flatten(3)
    weight = torch.randn(channels, 1, 3, 3, generator=g)
    return {"x": x.to(dtype), "offset": offset.to(dtype), "mask": mask.to(dtype), "weight": weight.to(dtype),
            "group": group}


def forward(impl: str, t):
    group, channels = t["group"], t["x"].shape[-1]
    if impl == "ours":
        return deform_conv.dcnv3(t["x"], t["offset"], t["mask"], 3, 1, 1, 1, group, 1.0)
    if impl == "core":
        return dcnv3_core_pytorch(t["x"], t["offset"], t["mask"], 3, 3, 1, 1, 1, 1, 1, 1, group, channels // group,
                                  1.0, 0)
    # channels_last NCHW view of the same NHWC memory: what a depthwise layer of this shape reads and writes
    return F.conv2d(t["x"].permute(0, 3, 1, 2), t["weight"], padding=1, groups=channels)


def make_call(impl: str, stage: str, dtype: torch.dtype, backward: bool):
    # dcnv3_core_pytorch builds its sampling grid in float32 whatever the input's dtype, and grid_sample refuses a
    # bfloat16 input beside it: in a bfloat16 run the core runs in float32, its only working dtype.
    t = inputs(stage, torch.float32 if impl == "core" else dtype)
    if not backward:
        def call():
            with torch.no_grad():
                forward(impl, t)
        return call
    names = ("x", "weight") if impl == "conv2d" else ("x", "offset", "mask")
    for name in names:
        t[name].requires_grad_()
    with torch.no_grad():
        grad = torch.randn_like(forward(impl, t))

    def call():
        forward(impl, t).backward(grad)
        for name in names:
            t[name].grad = None
    return call


_PEAK = """
import sys, torch
sys.argv = sys.argv[:1] + ["--child"]
sys.path.insert(0, {benchmarks!r})
import dcnv3_speed as b
torch.set_num_threads({threads})
call = b.make_call({impl!r}, {stage!r}, getattr(torch, {dtype!r}), True)
call()
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])
open("/proc/self/clear_refs", "w").write("5")
before = hwm()
call()
print((hwm() - before) / 1024)
"""


def peak_mib(impl: str, stage: str, dtype: str, threads: int) -> float:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    code = _PEAK.format(benchmarks=str(Path(__file__).parent), threads=threads, impl=impl, stage=stage, dtype=dtype)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if child.returncode != 0:
        raise RuntimeError(child.stderr[-2000:])
    return float(child.stdout.strip().splitlines()[-1])


def whole_model(min_seconds: float):
    """The InternImage-T lines of the table (or why there are none)."""
    try:
        import timm  # noqa: F401
    except ImportError:
        return ["InternImage-T: not measured (timm is missing)."]
    import copy

    import upstream_models.internimage_ops_dcnv3 as upstream_ops_dcnv3
    from upstream_models.conftest import load_intern_image

    models = load_intern_image("intern_image_upstream", upstream_ops_dcnv3)
    torch.manual_seed(0)
    upstream = models.InternImage(core_op="DCNv3_pytorch", channels=64, depths=[4, 4, 18, 4], groups=[4, 8, 16, 32],
                                  offset_scale=1.0, mlp_ratio=4.0, drop_path_rate=0.0).eval()
    ours = deform_conv.compat.convert_modules(copy.deepcopy(upstream))
    image = torch.randn(1, 3, 224, 224)

    def run(model):
        def call():
            with torch.no_grad():
                model(image)
        return call

    with torch.no_grad():
        difference = float((ours(image) - upstream(image)).abs().max())
    t = interleaved_medians({"ours": run(ours), "core": run(upstream)}, min_seconds)
    return ["| model | ours (ms) | core_op='DCNv3_pytorch' (ms) | core / ours | max difference of the logits |",
            "|---|---:|---:|---:|---:|",
            f"| InternImage-T, 1x3x224x224, eval forward | {t['ours'] * 1e3:.1f} | {t['core'] * 1e3:.1f} | "
            f"{t['core'] / t['ours']:.2f}x | {difference:.1e} |"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--min-seconds", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steadied = steady_malloc()
    dtype = getattr(torch, args.dtype)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    lines = [f"# DCNv3 on the CPU, {args.dtype}", "",
             f"CPU: {cpu}, {os.cpu_count()} cores, {args.threads} threads; torch {torch.__version__}; "
             f"malloc steadied: {steadied}. Command: `python benchmarks/dcnv3_speed.py --threads {args.threads} "
             f"--dtype {args.dtype}`. Times in ms (medians, the three taking turns call by call); peak: the rise of "
             "the resident set during one forward+backward, MiB." + (
                 " dcnv3_core_pytorch runs in float32 (its grid is float32 whatever the input's dtype, and "
                 "grid_sample refuses a bfloat16 input beside it)." if args.dtype != "float32" else ""), "",
             "| stage | pass | ours | dcnv3_core_pytorch | depthwise conv2d | core / ours | ours / conv2d | target |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    peaks = []
    for stage in STAGES:
        for backward, phase, limit in ((False, "fwd", 5.0), (True, "fwd+bwd", 8.0)):
            calls = {impl: make_call(impl, stage, dtype, backward) for impl in IMPLEMENTATIONS}
            t = interleaved_medians(calls, args.min_seconds)
            speedup, ratio = t["core"] / t["ours"], t["ours"] / t["conv2d"]
            met = "met" if speedup >= 2 and ratio <= limit else "not met"
            lines.append(f"| {stage} | {phase} | {t['ours'] * 1e3:.2f} | {t['core'] * 1e3:.2f} | "
                         f"{t['conv2d'] * 1e3:.2f} | {speedup:.2f}x | {ratio:.2f}x | {met} (>= 2x, <= {limit:g}x) |")
            print(lines[-1], flush=True)
        peaks.append((stage, peak_mib("ours", stage, args.dtype, args.threads),
                      peak_mib("core", stage, args.dtype, args.threads)))
    lines += ["", "| stage | peak ours (MiB) | peak core (MiB) | below the core's |", "|---|---:|---:|---|"]
    lines += [f"| {s} | {o:.1f} | {c:.1f} | {'yes' if o < c else 'no'} |" for s, o, c in peaks]
    lines += ["", *whole_model(args.min_seconds)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__" and "--child" not in sys.argv:
    sys.exit(main())
