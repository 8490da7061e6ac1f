"""Hooks and fixtures for every test folder: the sanitizer-run marker and the ``dtype`` fixture. The code the tests
share lives in helpers/ (imported as ``helpers.<module>``), never in a conftest."""

from __future__ import annotations

import pytest
import torch

import deform_conv  # noqa: F401  (the kernels are loaded, built once if needed, before any test module)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "repeats_under_sanitizers: a variation whose addressing other tests already cover; "
        "scripts/sanitize-tests leaves it out (-m 'not repeats_under_sanitizers') to keep the instrumented run short")


@pytest.fixture(params=[torch.float64, torch.float32], ids=["fp64", "fp32"])
def dtype(request) -> torch.dtype:
    return request.param
