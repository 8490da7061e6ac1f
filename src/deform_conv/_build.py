"""Builds the kernel library once per machine and loads it: sources, flags, cache key and errors live here.

The library has no Python bindings (no pybind11, no ``Python.h``): it only registers ops with the
dispatcher, so it is loaded with ``torch.ops.load_library`` and does not depend on the Python version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from ._version import __version__

CSRC = Path(__file__).resolve().parent / "csrc"

# Sources compiled into the CPU library, relative to csrc/. Every header under csrc/ enters the cache key too.
CPU_SOURCES = ("ops.cpp", "conv_params.cpp", "cpu/sampling_passes.cpp", "cpu/deform_conv_cpu.cpp")

# -fopenmp makes at::parallel_for use threads (its OpenMP backend is header code compiled into this library);
# the linked libgomp.so.1 resolves to the one torch has already loaded.
CXX_FLAGS = ("-O3", "-fopenmp")
LD_FLAGS = ("-fopenmp",)


class BuildError(RuntimeError):
    """The kernels could not be compiled; the message carries the compiler's output and a remedy."""


@dataclasses.dataclass(frozen=True)
class LoadedLibrary:
    """What ``import deform_conv`` loaded, for the self-check and for bug reports."""

    path: Path              # the shared library
    entry: Path             # its cache entry (a directory)
    from_cache: bool        # False when this process compiled it
    build_seconds: float    # 0.0 when loaded from the cache
    load_seconds: float


def cache_root() -> Path:
    """``$DEFORM_CONV_CACHE_DIR``, else ``$XDG_CACHE_HOME/deform_conv``, else ``~/.cache/deform_conv``."""
    if os.environ.get("DEFORM_CONV_CACHE_DIR"):
        return Path(os.environ["DEFORM_CONV_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "deform_conv"


def compiler_version() -> str:
    """First line of ``$CXX --version`` (the compiler torch.utils.cpp_extension will call)."""
    compiler = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{compiler}: not usable ({exc})"
    return (out.stdout or out.stderr).splitlines()[0].strip() if (out.stdout or out.stderr) else compiler


def key_inputs() -> dict:
    """Everything the built library depends on; a change in any of them selects another cache entry."""
    sources = sorted(p for p in CSRC.rglob("*") if p.suffix in {".h", ".cuh", ".cpp", ".cu"})
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.relative_to(CSRC).as_posix().encode())
        digest.update(path.read_bytes())
    return {
        "package_version": __version__,
        "sources_sha256": digest.hexdigest(),
        "cxx_flags": list(CXX_FLAGS),
        "ld_flags": list(LD_FLAGS),
        "torch_version": torch.__version__,
        "torch_cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "torch_cuda": torch.version.cuda,
        "platform": f"{sys.platform}-{platform.machine()}",
    }


def entry_name(inputs: dict) -> str:
    """Directory name of the cache entry: readable prefix, hash of every key input."""
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    torch_tag = inputs["torch_version"].replace("+", "_")
    return f"cpu-torch{torch_tag}-{digest}"


def _say(message: str) -> None:
    print(f"deform_conv: {message}", file=sys.stderr, flush=True)


def _compile(name: str, entry: Path) -> Path:
    from torch.utils import cpp_extension  # imported only when a build is needed

    verbose = os.environ.get("DEFORM_CONV_VERBOSE", "") == "1"
    try:
        cpp_extension.load(
            name=name,
            sources=[str(CSRC / s) for s in CPU_SOURCES],
            extra_cflags=list(CXX_FLAGS),
            extra_ldflags=list(LD_FLAGS),
            build_directory=str(entry),
            is_python_module=False,
            with_cuda=False,
            verbose=verbose,
        )
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        output = str(exc).strip().splitlines()
        tail = "\n".join(output[-40:])
        raise BuildError(
            f"compiling deform_conv's CPU kernels in {entry} failed:\n{tail}\n\n"
            "Remedy: install a C++17 compiler (e.g. `apt-get install g++`) and ninja (`pip install ninja`), "
            "then import again; set DEFORM_CONV_VERBOSE=1 to see every compiler command."
        ) from exc
    return entry / f"{name}.so"


def load() -> LoadedLibrary:
    """Loads the CPU library from the cache, compiling it first if this machine has no entry for it yet."""
    inputs = key_inputs()
    entry = cache_root() / entry_name(inputs)
    name = "deform_conv_" + entry.name.rsplit("-", 1)[1]
    library = entry / f"{name}.so"
    complete = entry / "key.json"  # written last: its presence means the library is whole

    build_seconds = 0.0
    from_cache = library.is_file() and complete.is_file()
    if not from_cache:
        entry.mkdir(parents=True, exist_ok=True)
        _say(f"compiling the CPU kernels for torch {torch.__version__} into {entry} (once; later imports load it)")
        start = time.perf_counter()
        library = _compile(name, entry)
        build_seconds = time.perf_counter() - start
        complete.write_text(json.dumps(inputs, indent=2, sort_keys=True) + "\n")
        _say(f"built in {build_seconds:.1f} s")
        load_seconds = 0.0  # cpp_extension.load has already loaded it
    else:
        start = time.perf_counter()
        torch.ops.load_library(str(library))
        load_seconds = time.perf_counter() - start
    return LoadedLibrary(library, entry, from_cache, build_seconds, load_seconds)
