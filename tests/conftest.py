"""Hooks and fixtures for every test folder: the sanitizer-run marker and the ``dtype`` fixture. The code the tests
share lives in helpers/ (imported as ``helpers.<module>``), never in a conftest."""

from __future__ import annotations

import os

import pytest
import torch

import deform_conv  # noqa: F401  (the kernels are loaded, built once if needed, before any test module)


def pytest_configure(config):
    # `pytest -n N` (pytest-xdist) runs N workers, each with torch's threads: more threads than cores. OpenMP's
    # threads spin while they wait for the next parallel region, so a spinning worker starved the other's small ops
    # (a float64 gradcheck took 66 s instead of 1.3 s). Passive waiting lets them sleep instead; results do not
    # change. Set here, in the process that starts the workers, which inherit it.
    if getattr(config.option, "numprocesses", None):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    config.addinivalue_line(
        "markers", "repeats_under_sanitizers: a variation whose addressing other tests already cover; "
        "scripts/sanitize-tests leaves it out (-m 'not repeats_under_sanitizers') to keep the instrumented run short")


@pytest.fixture(params=[torch.float64, torch.float32], ids=["fp64", "fp32"])
def dtype(request) -> torch.dtype:
    return request.param
