"""Test facilities: the CUDA simulation.

:func:`load_cuda_simulation` builds (once, into a cache entry of its own) and loads the CUDA kernels' own source
compiled by the host compiler against a small execution layer (``csrc/cuda_simulation/``): blocks and threads,
warp shuffles with one fiber per lane, atomics, CUDA's launch limits. It registers the CUDA backend (deform_conv2d's
driven by the shared driver in its GPU GEMM mode), on CPU tensors, as ``torch.ops.deform_conv_sim.deform_conv2d``,
``deform_conv2d_backward``, ``ms_deform_attn`` and ``ms_deform_attn_backward``, with the schemas of
``torch.ops.deform_conv.*``. (The CUDA backend does not read ``spatial_shapes`` on the host, so neither does the
simulation: its levels are checked by the kernels, as on a GPU.) It is
slow (one fiber per simulated thread) and exists so that the CUDA kernels run in every test run, GPU or not;
``import deform_conv`` never loads it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._jit import loader as _loader, settings as _settings
from .._jit.variant import Variant

_loaded: Optional[_loader.LoadedLibrary] = None

# The GPU's threshold (csrc/cuda/host.cpp, int32_index_limit): the 32-bit index path below 2^30 elements.
GPU_INT32_LIMIT = 2**30


class SimulationStatistics(NamedTuple):
    """What the simulation has run since it was loaded."""

    launches: int
    blocks: int
    threads: int
    shuffles: int          # warp shuffles completed (each by all 32 lanes of a warp)
    int32_launches: int    # passes launched with 32-bit index arithmetic
    int64_launches: int    # ... with 64-bit


def load_cuda_simulation(int32_limit: Optional[int] = None, shuffle_blocks: bool = False, seed: int = 0,
                         budget_bytes: Optional[int] = None, max_blocks: Optional[int] = None,
                         level_checks: bool = True) -> _loader.LoadedLibrary:
    """Loads the CUDA simulation (building it the first time) and sets how it runs.

    Args:
        int32_limit: the number of elements below which the kernels take the 32-bit index path (None: the GPU's,
            2^30); 1 sends every call down the 64-bit path.
        shuffle_blocks: run the blocks of each launch, and the warps within each block, in a random order drawn
            drawn from ``seed`` and the number of launches since this call, instead of in index order.
        seed: see ``shuffle_blocks``.
        budget_bytes: the memory budget of one chunk of images (None: the GPU's, 256 MiB); a small one makes small
            tests take many chunks (at least one image each).
        max_blocks: at most this many blocks a launch (None: as on the GPU, enough for every item), so that the
            kernels' grid-stride loops run more than once.
        level_checks: whether the host code checks the levels' values on the device (as on a GPU: an inconsistent
            call raises); False lets the tests reach the kernels' own guard (a level that does not fit samples NaN).

    Instrumented with the sanitizers when $DEFORM_CONV_SANITIZE asks for them, as the CPU library is.
    """
    global _loaded
    limit = GPU_INT32_LIMIT if int32_limit is None else int32_limit
    if not _is_int_at_least(limit, 1) or limit > GPU_INT32_LIMIT:
        raise ValueError(f"int32_limit must be an int in [1, 2**30] or None, got {int32_limit!r}")
    if not _is_int_at_least(seed, 0):
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    for name, value in (("budget_bytes", budget_bytes), ("max_blocks", max_blocks)):
        if value is not None and not _is_int_at_least(value, 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if _loaded is None:
        _loaded = _loader.load(Variant("cuda_simulation", sanitize=_settings.sanitizers()))
    torch.ops.deform_conv_sim.configure(limit, bool(shuffle_blocks), seed, budget_bytes or 0, max_blocks or 0,
                                        bool(level_checks))
    return _loaded


def _is_int_at_least(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def simulation_statistics() -> SimulationStatistics:
    """Counts of what the simulation ran (after :func:`load_cuda_simulation`)."""
    return SimulationStatistics(*torch.ops.deform_conv_sim.statistics())
