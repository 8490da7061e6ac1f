"""One DDP rank for tests/integration/test_ddp.py, and the model, data and training loop that test shares with it.

``python ddp_worker.py RANK WORLD_SIZE OUT_DIR`` (MASTER_ADDR/MASTER_PORT and DEFORM_CONV_CACHE_DIR in the
environment) trains its slice of the global batch under DistributedDataParallel and saves its final
state_dict and what its ``import deform_conv`` did to OUT_DIR/rank{RANK}.pt.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Tuple

import torch
from torch import nn

GLOBAL_BATCH = 4
STEPS = 3
LR = 0.1
DTYPE = torch.float64  # see the tolerance in test_ddp.py


class ChannelsLast(nn.Module):
    """A channels-last layer (InternImage's DCNv3) inside a channels-first model."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def build_model() -> nn.Module:
    import deform_conv  # imported here: a rank imports it only after the rendezvous (see main)

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the layers' own initialisation
    model = nn.Sequential(
        deform_conv.ModulatedDeformConv2dPack(3, 4, 3, padding=1, deform_groups=1),
        nn.Tanh(),
        ChannelsLast(deform_conv.nn.DCNv3(4, kernel_size=3, group=2)),
        nn.Conv2d(4, 2, 1),
    ).to(DTYPE)
    with torch.no_grad():  # the offsets start at zero; perturb them so offsets and masks are not trivial
        for layer in (model[0].conv_offset, model[2].layer.offset, model[2].layer.mask):
            layer.weight.copy_(0.5 * torch.randn(layer.weight.shape, dtype=DTYPE, generator=g))
            layer.bias.copy_(0.5 * torch.randn(layer.bias.shape, dtype=DTYPE, generator=g))
    return model


def global_batch() -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 3, 7, 6, dtype=DTYPE, generator=g)   # [B, C_in, H, W]
    y = torch.randn(GLOBAL_BATCH, 2, 7, 6, dtype=DTYPE, generator=g)   # [B, C_out, H, W]
    return x, y


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Plain SGD on the mean loss over the batch given: under DDP (which averages gradients over ranks) equal
    slices give the gradient of the mean over the global batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()


def main(rank: int, world_size: int, out_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    # Import after the rendezvous so the ranks reach the loader at the same moment: one compiles, the other
    # waits on the cache lock (a train.py that imports at the top behaves the same, with less certain timing).
    import deform_conv

    model = torch.nn.parallel.DistributedDataParallel(build_model())
    x, y = global_batch()
    per_rank = GLOBAL_BATCH // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    train(model, x[mine], y[mine])
    lib = deform_conv.libraries[0]
    torch.save({"state_dict": model.module.state_dict(), "from_cache": lib.from_cache, "entry": str(lib.entry)},
               out_dir / f"rank{rank}.pt")
    # Drop the DDP model (and with it the last reference to the process group) while the interpreter is fully
    # alive, so that destroy_process_group joins gloo's worker threads here. Left to the interpreter's exit, the
    # process group was freed by its final garbage collection while a gloo thread was still destroying a finished
    # allreduce whose captured thread-local state held a Python object: that thread blocked on the GIL of a
    # finalizing interpreter and std::terminate ended the rank ("terminate called without an active exception"),
    # after it had saved its results, in about 1 run of 12 with a DCNv3 layer in the model.
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
