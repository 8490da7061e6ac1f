"""What bounds multi-scale deformable attention's forward on Deformable DETR's encoder shape, on this CPU: our
forward against two floors measured in the same run, the calls taking turns.

- **The gather floor**: ATen's `embedding_bag` (mode "sum" with per-sample weights; FBGEMM's kernel on x86) over
  the very rows our forward reads -- the four corners of every sampling point, as rows of `value` [N * S * M, D] --
  with the indices and the weights (bilinear weight times attention weight) computed beforehand, outside the
  timing. It moves the same bytes our forward moves and does its multiply-adds, and none of its index arithmetic.
- **The streaming floor**: the bytes any forward must move at least once (value, sampling_locations and
  attention_weights read, the output written) at the copy bandwidth of this machine (`dst.copy_(src)` on tensors
  far larger than the caches; the bandwidth counts the bytes read and written).

fp32 only: the encoder's targets are set in fp32.

    python benchmarks/encoder_floor.py --threads 2 --out benchmarks/results/ms_deform_attn_cpu_floor.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ms_deform_attn_speed as speed  # noqa: E402  (the encoder's inputs and the timing, shared)

COPY_BYTES = 256 << 20  # per tensor: well beyond any cache of the machines this runs on


def corner_bags(t: Dict[str, torch.Tensor]):
    """The forward as embedding_bag's arguments: for each (image, query, head) a bag of L * P * 4 rows of value
    viewed as [N * S * M, D], with weights bilinear weight x attention weight; a corner outside its level gets
    weight 0 (and row 0). Deformable DETR's sampling: pixel = location * size - 0.5, zero outside the level."""
    value, locations, weights = t["value"], t["sampling_locations"], t["attention_weights"]
    n, s, m, _ = value.shape
    lq, levels = locations.shape[1], locations.shape[3]
    rows, factors = [], []
    for level, ((height, width), start) in enumerate(zip(speed.LEVELS, t["level_start_index"].tolist())):
        loc = locations[:, :, :, level].double()  # [N, Lq, M, P, 2]
        x, y = loc[..., 0] * width - 0.5, loc[..., 1] * height - 0.5
        x0, y0 = x.floor(), y.floor()
        lx, ly = x - x0, y - y0
        for dy, dx, w in ((0, 0, (1 - ly) * (1 - lx)), (0, 1, (1 - ly) * lx), (1, 0, ly * (1 - lx)), (1, 1, ly * lx)):
            cy, cx = (y0 + dy).long(), (x0 + dx).long()
            inside = (cy >= 0) & (cy < height) & (cx >= 0) & (cx < width)
            pixel = start + cy.clamp(0, height - 1) * width + cx.clamp(0, width - 1)  # [N, Lq, M, P]
            image = torch.arange(n).view(n, 1, 1, 1)
            head = torch.arange(m).view(1, 1, m, 1)
            rows.append(torch.where(inside, (image * s + pixel) * m + head, 0))
            factors.append(torch.where(inside, w * weights[:, :, :, level].double(), 0.0))
    # [N, Lq, M, L * P * 4]: each (image, query, head) one bag
    index = torch.stack(rows, -1).reshape(n * lq * m, -1)
    per_sample = torch.stack(factors, -1).reshape(n * lq * m, -1).float()
    return value.reshape(n * s * m, -1), index.reshape(-1), per_sample.reshape(-1), index.shape[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--min-seconds", type=float, default=2.0, help="time spent per measurement")
    parser.add_argument("--out", type=Path, help="also write the table, with its header, to this markdown file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    speed.steady_malloc()  # as the other benchmarks: no time depends on what the call before freed

    t = speed.make_inputs(speed.Config("encoder", "fp32", "fwd"))
    table, index, per_sample, bag = corner_bags(t)
    offsets = torch.arange(0, index.numel(), bag)
    out = speed.forward("ours", t)
    gathered = F.embedding_bag(index, table, offsets, mode="sum", per_sample_weights=per_sample)
    # The floor computes the forward: the same sums, up to their order and the weights' rounding (a check that it
    # does the same work, not a test of either).
    torch.testing.assert_close(gathered.view_as(out), out, rtol=1e-4, atol=1e-4)

    source, target = torch.empty(COPY_BYTES // 4), torch.empty(COPY_BYTES // 4)
    source.normal_()

    def ours() -> None:
        speed.forward("ours", t)

    def gather() -> None:
        F.embedding_bag(index, table, offsets, mode="sum", per_sample_weights=per_sample)

    def copy() -> None:
        target.copy_(source)

    with torch.no_grad():
        times = speed.medians({"ours": ours, "gather": gather, "copy": copy}, args.threads, args.min_seconds)
    bandwidth = 2 * COPY_BYTES / times["copy"]  # bytes read and written per second
    compulsory = sum(t[name].nbytes for name in ("value", "sampling_locations", "attention_weights")) + out.nbytes
    streaming = compulsory / bandwidth
    points = t["attention_weights"].numel()
    corner_bytes = 4 * table.shape[1] * table.element_size()

    command = "python benchmarks/encoder_floor.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# Multi-scale deformable attention, CPU: the encoder's forward against its floors", "",
        f"Command: `{command.strip()}`", "",
        speed.environment("cpu", args.threads), "",
        f"Deformable DETR's encoder (batch {speed.BATCH}, S = Lq = {speed.PIXELS}, {speed.HEADS} heads x "
        f"{speed.CHANNELS} channels, {len(speed.LEVELS)} levels x {speed.POINTS} points): {points / 1e6:.2f} M "
        f"sampling points a call, each reading 4 corners of {table.shape[1]} channels ({corner_bytes} bytes; "
        f"{points * corner_bytes / 1e9:.2f} GB a call, mostly from the caches); {compulsory / 1e6:.0f} MB that "
        f"must cross memory at least once ({compulsory / points:.0f} bytes a point). Medians, the three calls "
        "taking turns (torch.utils.benchmark).", "",
        "| measurement | ms | ours / it |",
        "|---|---:|---:|",
        f"| ours, forward (fp32) | {times['ours'] * 1e3:.1f} | 1.00 |",
        f"| gather floor: embedding_bag over the same corner rows, indices and weights given | "
        f"{times['gather'] * 1e3:.1f} | {times['ours'] / times['gather']:.2f} |",
        f"| streaming floor: {compulsory / 1e6:.0f} MB at the copy bandwidth ({bandwidth / 1e9:.1f} GB/s read + "
        f"written) | {streaming * 1e3:.1f} | {times['ours'] / streaming:.2f} |",
        "",
        f"Load average (1 min): {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores.", "",
    ]
    print("\n".join(lines))
    speed.write_table(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
