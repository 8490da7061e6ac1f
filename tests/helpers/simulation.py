"""The CUDA simulation's settings for a block of calls (deform_conv.testing.load_cuda_simulation's keywords), and
torch's deterministic-algorithms switch likewise: shared by both ops' simulation tests."""

from __future__ import annotations

import contextlib

import torch

from deform_conv import testing


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


@contextlib.contextmanager
def simulation_options(**options):
    """The simulation configured with ``options`` (load_cuda_simulation's keywords), then its defaults again."""
    testing.load_cuda_simulation(**options)
    try:
        yield
    finally:
        testing.load_cuda_simulation()
