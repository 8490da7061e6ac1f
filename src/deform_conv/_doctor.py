"""`deform-conv doctor`: what a build would use and find, what the cache holds, and a remedy per problem."""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import List, Tuple

import torch

from . import _build, _toolchain
from ._version import __version__


def _size(path: Path) -> str:
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return f"{total / 2**20:.1f} MiB"


def entries(root: Path) -> List[Tuple[Path, dict]]:
    """Every published entry under ``root`` with its key (an empty dict when incomplete or corrupted)."""
    if not root.is_dir():
        return []
    found = []
    for directory in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "logs"))):
        found.append((directory, _build.read_key(directory) or {}))
    return found


def doctor() -> int:
    problems: List[str] = []
    print(f"deform_conv {__version__} doctor")
    print(f"  python       {platform.python_version()} ({sys.executable})")
    print(f"  torch        {torch.__version__} (C++11 ABI {torch.compiled_with_cxx11_abi()}, "
          f"CUDA build: {torch.version.cuda or 'no'})")
    root = _build.cache_root()
    cpu = _build.cpu_variant()  # a bad DEFORM_CONV_SANITIZE raises BuildError here: the CLI prints it
    print(f"  sanitize     {'-fsanitize=' + ','.join(cpu.sanitize) + ' (CPU library only)' if cpu.sanitize else 'off'}"
          " (DEFORM_CONV_SANITIZE)")
    try:
        _build.check_sanitizer_runtime(cpu)
    except _build.BuildError as error:
        problems.append(str(error).replace("\n", " "))

    cxx = _toolchain.find_cxx()
    if cxx:
        print(f"  compiler     {cxx}: {_toolchain.identify(cxx, None)}")
    else:
        print(f"  compiler     not found ({_toolchain.cxx_name()!r})")
        problems.append("no C++ compiler: install g++ (`apt-get install g++`) or set $CXX; needed only to build")
    ninja = _toolchain.ensure_ninja_on_path()
    print(f"  ninja        {ninja or 'not found'}")
    if not ninja:
        problems.append("no ninja: `pip install ninja`; needed only to build")

    if torch.version.cuda:
        nvcc = _toolchain.find_nvcc()
        if nvcc:
            version = _toolchain.identify(nvcc, None)
            release = _toolchain.nvcc_release(version) or "?"
            matches = release.split(".")[0] == _toolchain.torch_cuda_major()
            print(f"  nvcc         {nvcc}: {version} ({'matches' if matches else 'DIFFERS FROM'} torch's CUDA "
                  f"{torch.version.cuda})")
            if not matches:
                problems.append(f"nvcc {release} differs in major version from torch's CUDA {torch.version.cuda}: "
                                "point CUDA_HOME at a matching toolkit")
        else:
            print("  nvcc         not found (CUDA_HOME unset, no /usr/local/cuda)")
        count = torch.cuda.device_count()
        gpus = [f"{i}: {torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                for i in range(count)]
        print(f"  GPUs         {'; '.join(gpus) if gpus else 'none visible'}")
        archs = _build.requested_cuda_archs()
        source = "TORCH_CUDA_ARCH_LIST" if os.environ.get("TORCH_CUDA_ARCH_LIST") else "the visible GPUs"
        print(f"  CUDA archs   {', '.join(archs) + ' (from ' + source + ')' if archs else 'none: CPU library only'}")
        if archs and not nvcc:
            problems.append("a CUDA library is wanted but nvcc is missing: install the CUDA toolkit matching "
                            f"torch's CUDA {torch.version.cuda} and set CUDA_HOME")

    writable = os.access(root, os.W_OK) if root.exists() else os.access(root.parent if root.parent.exists() else Path.home(), os.W_OK)
    print(f"  cache root   {root} ({'writable' if writable else 'read-only: complete entries load, nothing can be built'})")
    listed = entries(root)
    for directory, key in listed:
        state = "complete" if key else "incomplete or corrupted"
        print(f"    {directory.name}  {state}, {_size(directory)}")
    if not listed:
        print("    (no entries)")

    for variant in _build.wanted_variants():
        found = _build.find_complete_entry(variant, root)
        prebuilt = _build.read_key(_build.PREBUILT, _build.prebuilt_key_file(variant))
        if prebuilt and prebuilt.get("environment") == _build.environment_inputs(variant):
            print(f"  {variant.kind:12s} bundled at install time ({_build.PREBUILT})")
        elif found:
            print(f"  {variant.kind:12s} built: {found[0].name}")
        else:
            print(f"  {variant.kind:12s} not built for the current key: the next import builds it "
                  "(or run `deform-conv build`)")
            if not cxx or not ninja:
                problems.append(f"the {variant.label} are not built and cannot be built here: copy an entry built "
                                "on a machine with the same torch/CUDA/arch (see the README)")
    if problems:
        print("Problems:")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print("No problems found.")
    return 0


def clean(stale_only: bool) -> int:
    """Removes cache entries (only those the current torch/sources/flags would not load, with stale_only),
    plus leftovers of killed builds and failed-build logs."""
    root = _build.cache_root()
    keep = set()
    if stale_only:
        for variant in _build.wanted_variants():
            found = _build.find_complete_entry(variant, root)
            if found:
                keep.add(found[0])
    removed = 0
    for directory, _key in entries(root):
        if directory not in keep:
            shutil.rmtree(directory)
            removed += 1
            print(f"removed {directory}")
    for leftover in list(root.glob(".build-*")) + list(root.glob(".trash-*")) + ([root / "logs"] if not stale_only else []):
        shutil.rmtree(leftover, ignore_errors=True)
    print(f"{removed} entr{'y' if removed == 1 else 'ies'} removed from {root}")
    return 0
