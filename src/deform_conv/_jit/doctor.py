"""`deform-conv doctor`: what a build would use and find, what the cache holds, and a remedy per problem."""

from __future__ import annotations

import os
import platform
import re
import sys
from pathlib import Path
from typing import List

import torch

from . import cache as _cache, loader as _loader, toolchain as _toolchain, variant as _variant
from .._version import __version__


def _size(path: Path) -> str:
    total = sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return f"{total / 2**20:.1f} MiB"


def batch_reduce_gemm() -> str:
    """Which GEMMs float32 layers run on, as the loaded CPU library says (torch.ops.deform_conv.brgemm_available),
    and what decides it: the tiled paths' speed, and sums that do not depend on the thread count, need it."""
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    here = (f"torch {torch.__version__}, {platform.machine()}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, oneDNN {'on' if onednn else 'off'}")
    if torch.ops.deform_conv.brgemm_available():
        return f"the batch-reduce GEMM, oneDNN's microkernels ({here})"
    return (f"the driver's path ({here}): the batch-reduce GEMM needs torch >= 2.9 on x86-64 with AVX2 and oneDNN "
            "on; as exact, but slower, and float32 sums depend on the thread count")


def half_precision_paths() -> str:
    """The path bfloat16 and float16 forwards take here, as the loaded CPU library says
    (torch.ops.deform_conv.cpu_half_path): native where the CPU has AMX (AMX-FP16 for float16) or, for bfloat16,
    AVX512-BF16 on AMD's cores, and oneDNN runs it; float32 otherwise."""
    return "; ".join(torch.ops.deform_conv.cpu_half_path(dtype) for dtype in (torch.bfloat16, torch.float16))


def describe_cpu_isa(variant: _variant.Variant) -> str:
    """The instruction set the CPU library's kernels run with here, and why."""
    host = _variant.host_cpu_isa()
    if variant.cpu_isa == _variant.PORTABLE:
        if host == _variant.PORTABLE:
            return "one build for every CPU of this architecture"
        return f"portable (copies for x86-64, avx2 and avx512f): this CPU runs the {_variant.portable_copy(host)} copy"
    if variant.cpu_isa == host:
        return f"{host}, this CPU's widest"
    return (f"{variant.cpu_isa}, narrower than this CPU's {host}: an entry built elsewhere, loaded because nothing "
            "can be built here")


def build_summary(key: dict, with_total: bool = True, slowest: int = 3) -> str:
    """How long the entry's build took and its slowest units, from its key (what the build measured with ninja's
    log), e.g. "built in 17.3 s; slowest units: deform_conv2d_cpu_sampling 9.8 s, attention_cpu 6.1 s, ..."."""
    units = sorted(((name, seconds) for name, seconds in key.get("unit_seconds", {}).items()
                    if not name.endswith(".so")), key=lambda unit: -unit[1])
    parts = [f"built in {key['build_seconds']:.1f} s"] if with_total else []
    if key.get("reused_units"):
        parts.append(f"reusing {len(key['reused_units'])} units of an earlier build")
    if units:
        parts.append("slowest units: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in units[:slowest]))
    return "; ".join(parts)


def doctor() -> int:
    problems: List[str] = []
    print(f"deform_conv {__version__} doctor")
    print(f"  python       {platform.python_version()} ({sys.executable})")
    print(f"  torch        {torch.__version__} (C++11 ABI {torch.compiled_with_cxx11_abi()}, "
          f"CUDA build: {torch.version.cuda or 'no'})")
    root = _loader.cache_root()
    cpu = _variant.cpu_variant()  # a bad DEFORM_CONV_SANITIZE raises BuildError here: the CLI prints it
    print(f"  sanitize     {'-fsanitize=' + ','.join(cpu.sanitize) + ' (CPU library only)' if cpu.sanitize else 'off'}"
          " (DEFORM_CONV_SANITIZE)")
    try:
        _toolchain.check_sanitizer_runtime(cpu)
    except _loader.BuildError as error:
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
        archs = _variant.requested_cuda_archs()
        source = "TORCH_CUDA_ARCH_LIST" if os.environ.get("TORCH_CUDA_ARCH_LIST") else "the visible GPUs"
        print(f"  CUDA archs   {', '.join(archs) + ' (from ' + source + ')' if archs else 'none: CPU library only'}")
        if archs and not nvcc:
            problems.append("a CUDA library is wanted but nvcc is missing: install the CUDA toolkit matching "
                            f"torch's CUDA {torch.version.cuda} and set CUDA_HOME")

    writable = _cache.can_write(root)
    trust = _cache.root_problem(root) if os.path.lexists(root) else None
    print(f"  cache root   {root} ({'writable' if writable else 'read-only: complete entries load, nothing can be built'}"
          f"{'; NOT TRUSTED' if trust else ''})")
    if trust:
        problems.append(f"{trust}: nothing in it is loaded. " + str(_loader.untrusted_root_error(root, trust))
                        .split("Remedy: ", 1)[1])
    listed = _cache.entries(root)
    for path in listed:
        state = _cache.inspect_entry(path)
        print(f"    {path.name}  {f'complete, {_size(path)}' if state.usable else f'NOT LOADABLE: {state.problem}'}")
        if state.untrusted:
            problems.append(f"{state.problem}: it is skipped; `deform-conv clean` removes it")
    if not listed:
        print("    (no entries)")

    for variant in _variant.wanted_variants():
        loadable, found, _skipped = _loader.find_loadable(variant, root, _loader.can_build(variant, root), warn=False)
        if found is not None and found.path == _loader.PREBUILT:
            print(f"  {variant.kind:12s} bundled at install time ({_loader.PREBUILT})")
        elif found:
            assert found.key is not None
            print(f"  {variant.kind:12s} built: {found.path.name} ({build_summary(found.key)})")
        if variant.kind == "cpu" and found:
            print(f"  {'cpu isa':12s} {describe_cpu_isa(loadable)}")
            try:  # the library itself knows what it was compiled with; loading it runs no compiler
                _loader._load(loadable, found)
                print(f"  {'cpu GEMMs':12s} {batch_reduce_gemm()}")
                print(f"  {'cpu half':12s} {half_precision_paths()}")
            except _loader.BuildError as error:
                if str(error).replace("\n", " ") not in problems:
                    problems.append(str(error).replace("\n", " "))
        if not found:
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


_UNIT_FILE = re.compile(r"^(\w+-[0-9a-f]{12}\.(cpp|cu)|\.unit-\w+)$")  # _sources.write_units' names


def _ours(root: Path, stale_only: bool) -> List[Path]:
    """What the package keeps in ``root`` besides its entries: leftovers of killed builds and of removals, and
    (not with --stale) the failed-build logs, the lock files and the compiler-version memo. Only names the package
    gives: a `logs` or `.locks` directory keeps whatever else someone put there."""
    found = list(root.glob(".build-*")) + list(root.glob(".trash-*"))
    if not stale_only:
        found += [p for p in root.glob("logs/*.log") if _variant.ENTRY_NAME.match(p.stem)]
        found += [p for p in root.glob(".locks/*.lock") if _variant.ENTRY_NAME.match(p.stem)]
        found += [root / _cache.TOOLCHAINS_FILE, *root.glob(f".{_cache.TOOLCHAINS_FILE}.*")]
        found += [p for p in root.glob(f"{_cache.UNITS_DIR}/*") if _UNIT_FILE.match(p.name)]
    return [p for p in found if os.path.lexists(p)]


def clean(stale_only: bool) -> int:
    """Removes what the package keeps in the cache root, and nothing else: entries (with --stale, only those the
    current setup would not load) and :func:`_ours`. Says what it could not remove (a read-only cache, another
    user's entry) and exits 1 then."""
    root = _loader.cache_root()
    keep = set()
    if stale_only:
        for variant in _variant.wanted_variants():
            _loadable, found, _skipped = _loader.find_loadable(variant, root, _loader.can_build(variant, root),
                                                               warn=False)
            if found:
                keep.add(found.path)
    removed, failed = 0, 0
    for path in [p for p in _cache.entries(root) if p not in keep] + _ours(root, stale_only):
        try:
            _cache.discard(path, root)
        except OSError as exc:
            failed += 1
            print(f"could not remove {path}: {exc.strerror}", file=sys.stderr)
            continue
        if _variant.ENTRY_NAME.match(path.name):
            removed += 1
            print(f"removed {path}")
    for directory in (root / "logs", root / ".locks", root / _cache.UNITS_DIR):
        if not stale_only and directory.is_dir() and not directory.is_symlink():
            try:
                directory.rmdir()  # only if empty: anything else in it is not ours
            except OSError:
                pass
    print(f"{removed} entr{'y' if removed == 1 else 'ies'} removed from {root}")
    return 1 if failed else 0
