"""DistributedDataParallel training with the deformable layers: two gloo ranks on an empty cache compile the
kernels once between them, and train exactly as one process does on the whole batch."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch

from helpers import ddp_worker
from helpers.loader import child_env, compile_lines, fast_compiler

WORLD_SIZE = 2
WORKER = Path(ddp_worker.__file__).resolve()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ddp_ranks_compile_once_and_train_like_one_process(tmp_path):
    cache = tmp_path / "cache"  # empty: one of the ranks must compile
    # The ranks train on the CPU (gloo); DEFORM_CONV_CUDA=0 keeps a GPU machine from also compiling CUDA kernels.
    # What is tested is that the ranks compile once between them and then train alike, not the compiler: the
    # compile reuses this session's objects (fast_compiler), the rest of the build (ninja, link, key, publishing
    # under the lock) runs as for a user.
    env = child_env(cache, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
                    DEFORM_CONV_CUDA="0", CXX=str(fast_compiler(tmp_path / "tools")))
    ranks = [
        subprocess.Popen([sys.executable, str(WORKER), str(rank), str(WORLD_SIZE), str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        for rank in range(WORLD_SIZE)
    ]
    outputs = []
    try:
        for rank in ranks:
            outputs.append(rank.communicate(timeout=600))
    except subprocess.TimeoutExpired:  # e.g. a rank waiting on a dead peer: kill both, keep what they said
        for rank in ranks:  # with their process groups, so no orphaned compiler keeps running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rank.pid, signal.SIGKILL)
        outputs += [rank.communicate() for rank in ranks[len(outputs):]]
    report = "\n".join(f"--- rank {r} (exit {p.returncode}) stderr:\n{err}" for r, (p, (_, err)) in
                       enumerate(zip(ranks, outputs)))
    assert [p.returncode for p in ranks] == [0] * WORLD_SIZE, report

    stderr = "".join(err for _, err in outputs)
    assert len(compile_lines(stderr)) == 1, report
    assert "waiting for another process that is compiling" in stderr, report  # they did import at once
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD_SIZE)]
    assert sorted(r["from_cache"] for r in results) == [False, True], report
    assert len({r["entry"] for r in results}) == 1

    states = [r["state_dict"] for r in results]
    assert states[0].keys() == states[1].keys()
    for name in states[0]:  # all-reduced gradients are the same bits on every rank, so are the parameters
        assert torch.equal(states[0][name], states[1][name]), name

    model = ddp_worker.build_model()
    initial = {name: p.detach().clone() for name, p in model.state_dict().items()}
    ddp_worker.train(model, *ddp_worker.global_batch())
    # float64: one process sums the batch-4 gradient in its kernels, DDP sums two batch-2 halves and averages
    # them over the ranks, so the two differ only by summation order, ~1e-16 relative per step. 1e-10 leaves
    # ample room for that, while an unsynchronised or wrongly averaged gradient is off by ~1e-2.
    for name, expected in model.state_dict().items():
        torch.testing.assert_close(states[0][name], expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    # The offset/mask branch trained too (its gradient goes through the kernels' offset and mask backward).
    for name in ("0.conv_offset.weight", "2.layer.offset.weight", "2.layer.mask.weight"):
        assert not torch.equal(initial[name], states[0][name]), name
