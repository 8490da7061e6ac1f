"""Helpers for the loader tests: run Python in a child process with a chosen cache and environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import deform_conv

ROOT = Path(__file__).resolve().parents[1]


def child_env(cache: Path, **extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["DEFORM_CONV_CACHE_DIR"] = str(cache)
    for key in ("DEFORM_CONV_FALLBACK", "DEFORM_CONV_VERBOSE", "TORCH_CUDA_ARCH_LIST"):
        env.pop(key, None)
    env.update(extra)
    return env


def run_python(code: str, env: Dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, **kwargs)


def copy_current_cpu_entry(cache: Path) -> Path:
    """Copies the CPU entry this test session loaded into another cache root, as a deployment would."""
    entry = deform_conv.libraries[0].entry
    target = cache / entry.name
    shutil.copytree(entry, target)
    return target


def compile_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("deform_conv: compiling the CPU kernels for")]


IMPORT_AND_REPORT = (
    "import sys, deform_conv; lib = deform_conv.libraries[0]; "
    "print(lib.from_cache, lib.entry, 'torch.utils.cpp_extension' in sys.modules)"
)
