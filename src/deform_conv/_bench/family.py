"""`deform-conv bench --op dcnv3|dcnv4|flash_deform_attn`: the DCNv3 family on the CPU, ours against the
grid_sample composition of the same op (what InternImage's ``dcnv3_core_pytorch`` and Deformable DETR's
pure-PyTorch attention compute: one grid_sample over the points, then the weighted sum; here the ops' own
compositions, which their ONNX exports emit) and against the floor of the same shape: a depthwise 3x3 conv2d in
channels_last for the convolutions (it reads nine pixels where they read four corners of nine points), the
softmax plus ``ms_deform_attn`` (the same work unfused) for FlashDeformAttn.

Shapes: InternImage-T's four stages at batch 2 (56x56 C 64 G 4; 28x28 C 128 G 8; 14x14 C 256 G 16; 7x7 C 512 G
32; 3x3, padding 1) for dcnv3 and dcnv4 (offset_mask padded to a multiple of 8 channels, as the DCNv4 module
makes it); Deformable DETR's decoder on an 800x1200 image for FlashDeformAttn (batch 2, four levels, 8 groups of
32 channels, 4 points, Lq 300). Forward (under no_grad) and forward+backward; the three take turns call by call
(timing.interleaved_medians). ``benchmarks/dcnv3_speed.py`` compares dcnv3 with InternImage's own
``dcnv3_core_pytorch`` (from a checkout's test copies) and measures peak memory.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

from .._ops.dcnv3 import dcnv3
from .._ops.dcnv3.onnx import dcnv3_symbolic
from .._ops.dcnv4 import dcnv4
from .._ops.dcnv4.onnx import dcnv4_symbolic
from .._ops.flash_deform_attn import flash_deform_attn
from .._ops.flash_deform_attn.onnx import flash_deform_attn_symbolic
from .._ops.ms_deform_attn import ms_deform_attn
from .timing import interleaved_medians

OPS = ("dcnv3", "dcnv4", "flash_deform_attn")
STAGES = {"stage 1": (56, 64, 4), "stage 2": (28, 128, 8), "stage 3": (14, 256, 16), "stage 4": (7, 512, 32)}
SMOKE_STAGES = {"smoke": (6, 8, 2)}
LEVELS = [(math.ceil(800 / s), math.ceil(1200 / s)) for s in (8, 16, 32, 64)]
SMOKE_LEVELS = [(5, 7), (3, 4)]
BATCH, K = 2, 9


def _grid_calls(op: str, size: int, channels: int, group: int, dtype: torch.dtype) -> Dict[str, Tuple]:
    """{implementation: (function, its tensors, the names that get gradients)} for one stage."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, size, size, channels, generator=g).to(dtype)
    geometry = (3, 1, 1, 1, group, 1.0, False)
    if op == "dcnv3":
        offset = torch.randn(BATCH, size, size, group * K * 2, generator=g).to(dtype)
        mask = torch.randn(BATCH, size, size, group, K, generator=g).softmax(-1).flatten(3).to(dtype)
        ours = (lambda t: dcnv3(t["x"], t["offset"], t["mask"], *geometry), dict(x=x, offset=offset, mask=mask))
        composed = (lambda t: dcnv3_symbolic(t["x"], t["offset"], t["mask"], *geometry),
                    dict(x=x.clone(), offset=offset.clone(), mask=mask.clone()))
    else:
        width = math.ceil(group * K * 3 / 8) * 8
        offset_mask = torch.randn(BATCH, size, size, width, generator=g).to(dtype)
        ours = (lambda t: dcnv4(t["x"], t["offset_mask"], *geometry), dict(x=x, offset_mask=offset_mask))
        composed = (lambda t: dcnv4_symbolic(t["x"], t["offset_mask"], *geometry, False),
                    dict(x=x.clone(), offset_mask=offset_mask.clone()))
    weight = torch.randn(channels, 1, 3, 3, generator=g).to(dtype)
    conv = (lambda t: F.conv2d(t["x"].permute(0, 3, 1, 2), t["weight"], padding=1, groups=channels),
            dict(x=x.clone(), weight=weight))  # the channels-last NCHW view of the same memory
    return {"ours": ours, "grid_sample": composed, "floor": conv}


def _flash_calls(levels: List[Tuple[int, int]], dtype: torch.dtype) -> Dict[str, Tuple]:
    g = torch.Generator().manual_seed(0)
    groups, channels, points, queries = 8, 32, 4, 300
    shapes = torch.tensor(levels)
    starts = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
    pixels = int(shapes.prod(1).sum())
    value = torch.randn(BATCH, pixels, groups, channels, generator=g).to(dtype)
    n = len(levels) * points
    loc_attn = torch.cat([torch.rand(BATCH, queries, groups, 2 * n, generator=g),
                          torch.randn(BATCH, queries, groups, n, generator=g)], -1).to(dtype)

    def unfused(t):
        locations = t["loc_attn"][..., : 2 * n].reshape(BATCH, queries, groups, len(levels), points, 2)
        weights = t["loc_attn"][..., 2 * n:].softmax(-1).reshape(BATCH, queries, groups, len(levels), points)
        return ms_deform_attn(t["value"], shapes, starts, locations, weights)

    return {
        "ours": (lambda t: flash_deform_attn(t["value"], shapes, starts, t["loc_attn"], points),
                 dict(value=value, loc_attn=loc_attn)),
        "grid_sample": (lambda t: flash_deform_attn_symbolic(t["value"], shapes, starts, t["loc_attn"], points),
                        dict(value=value.clone(), loc_attn=loc_attn.clone())),
        "floor": (unfused, dict(value=value.clone(), loc_attn=loc_attn.clone())),
    }


def _call(fn: Callable, tensors: Dict[str, torch.Tensor], backward: bool) -> Callable[[], None]:
    if not backward:
        def forward() -> None:
            with torch.no_grad():
                fn(tensors)
        return forward
    for t in tensors.values():
        t.requires_grad_()
    with torch.no_grad():
        grad = torch.randn_like(fn(tensors))

    def forward_backward() -> None:
        fn(tensors).backward(grad)
        for t in tensors.values():
            t.grad = None
    return forward_backward


def table(op: str, smoke: bool, min_seconds: float, dtype: torch.dtype) -> str:
    """The op's markdown table (and prints each row as it is measured)."""
    floor = "softmax + ms_deform_attn" if op == "flash_deform_attn" else "depthwise conv2d"
    lines = [f"| case | pass | ours (ms) | grid_sample composition (ms) | {floor} (ms) | composition / ours | "
             "ours / floor |", "|---|---|---:|---:|---:|---:|---:|"]
    if op == "flash_deform_attn":
        cases = {"decoder, Lq 300": lambda: _flash_calls(SMOKE_LEVELS if smoke else LEVELS, dtype)}
    else:
        stages = SMOKE_STAGES if smoke else STAGES
        cases = {name: (lambda s=s: _grid_calls(op, *s, dtype)) for name, s in stages.items()}
    for name, make in cases.items():
        for backward, phase in ((False, "fwd"), (True, "fwd+bwd")):
            calls = {impl: _call(fn, tensors, backward) for impl, (fn, tensors) in make().items()}
            t = interleaved_medians(calls, min_seconds)
            lines.append(f"| {name} | {phase} | {t['ours'] * 1e3:.2f} | {t['grid_sample'] * 1e3:.2f} | "
                         f"{t['floor'] * 1e3:.2f} | {t['grid_sample'] / t['ours']:.2f}x | "
                         f"{t['ours'] / t['floor']:.2f}x |")
            print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"
