"""Helpers for the loader tests: run Python in a child process with a chosen cache and environment, a compiler
that builds in seconds, and the check of the CUDA kernels' ptxas report."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

import deform_conv

ROOT = Path(__file__).resolve().parents[2]  # the repository


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


def fast_compiler(directory: Path) -> Path:
    """A C++ compiler for tests that only need the loader to run (ninja, the link, the key, the publishing): each
    object it is asked to compile is copied from the entry this test session loaded, built from the same sources
    (for this CPU's instruction set, whatever the flags asked for: the tests using it run no kernel of such a
    library); everything else (the link, --version) goes to the real compiler. A build takes seconds, not a
    minute. ``directory`` receives the wrapper and a readable copy of the objects (other users may run it)."""
    objects = directory / "objects"
    objects.mkdir(parents=True, exist_ok=True)
    for obj in deform_conv.libraries[0].entry.glob("*.o"):
        shutil.copy(obj, objects / obj.name)
    real = shutil.which(os.environ.get("CXX", "c++"))
    assert real is not None, "the tests need a C++ compiler"
    wrapper = directory / "fast-c++"
    wrapper.write_text(f"""#!/bin/sh
src=""; out=""; prev=""
for arg in "$@"; do
  case "$prev" in -c) src="$arg" ;; -o) out="$arg" ;; esac
  prev="$arg"
done
name=$(basename "$src"); object="{objects}/${{name%.*}}.o"
if [ -n "$src" ] && [ -n "$out" ] && [ -f "$object" ]; then
  cp "$object" "$out" && printf '%s: %s\\n' "$out" "$src" > "$out.d"
  exit $?
fi
exec "{real}" "$@"
""")
    for path in (directory, objects, *objects.iterdir(), wrapper):
        path.chmod(0o755 if path.is_dir() or path == wrapper else 0o644)
    return wrapper


def read_only_command(cache: Path, code: str) -> list:
    """A command that runs `python -c code` with ``cache`` read-only. Permissions do not bind root, so as root
    the directory is bind-mounted read-only in a private mount namespace instead."""
    if os.geteuid() != 0:
        for path in [cache, *cache.rglob("*")]:
            path.chmod(path.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        return [sys.executable, "-c", code]
    if shutil.which("unshare") is None:
        pytest.skip("running as root without unshare: cannot make a directory read-only")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"running as root and unshare -m is not permitted: {probe.stderr.decode().strip()}")
    script = f'mount --bind -o ro "{cache}" "{cache}" && exec "{sys.executable}" -c "$0"'
    return ["unshare", "-m", "sh", "-c", script, code]


KERNELS = ("fill_columns_kernel", "coordinate_grads_kernel", "input_grad_atomic_kernel", "entry_keys_kernel",
           "input_grad_gather_kernel", "depthwise_forward_kernel", "depthwise_weight_partials_kernel",
           # multi-scale deformable attention
           "attention_forward_kernel", "attention_backward_kernel", "attention_entry_keys_kernel",
           "attention_value_grad_gather_kernel")


def check_no_local_memory(log: str) -> None:
    """ptxas -v (NVCC_FLAGS) prints, for each function it compiles, "Compiling entry function '<mangled>'" and
    then "<n> bytes stack frame, <n> bytes spill stores, <n> bytes spill loads"."""
    entries = re.findall(r"Compiling entry function '(\w+)' for 'sm_\w+'", log)
    for kernel in KERNELS:
        assert any(kernel in name for name in entries), f"ptxas compiled no {kernel}"
    usage = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(usage) >= len(entries), "ptxas did not report every kernel's stack frame"
    offending = [line for line in log.splitlines()
                 if re.search(r"bytes stack frame", line) and not re.search(r"\b0 bytes stack frame, 0 bytes spill "
                                                                            r"stores, 0 bytes spill loads", line)]
    assert not offending, "kernels with local memory:\n" + "\n".join(offending)
