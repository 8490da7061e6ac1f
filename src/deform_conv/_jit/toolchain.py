"""The build tools: which compiler, ninja and nvcc a build would use, their versions, and what is missing.

Identifying a tool normally means running ``TOOL --version``. The warm import path must not run the
compiler, so versions are remembered per binary (path, size, modification time) in ``toolchains.json`` under
the cache root: a stat is enough to know the compiler has not changed since it was last asked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    from .variant import Variant

import torch

from . import cache as _cache, settings as _settings
from .errors import BuildError


def cxx_name() -> str:
    """The C++ compiler torch.utils.cpp_extension will call: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "c++")


def find_cxx() -> Optional[str]:
    return shutil.which(cxx_name())


def ensure_ninja_on_path() -> Optional[str]:
    """Path of ninja; puts the `ninja` Python package's binary on PATH when only that is there (a virtual
    environment used without activating it)."""
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package we depend on
    except ImportError:
        return None
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja")


def cuda_home() -> Optional[Path]:
    """The CUDA toolkit: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, or the toolkit around nvcc on PATH. Unlike
    cpp_extension's guess, an nvcc on PATH counts only if headers sit beside it: a wrapper script in
    /usr/local/bin would otherwise make /usr/local look like the toolkit."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return Path(os.environ[var])
    default = Path("/usr/local/cuda")
    if (default / "bin" / "nvcc").is_file():
        return default
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = Path(nvcc).resolve().parent.parent
        if (home / "include" / "cuda_runtime.h").is_file():
            return home
    return None


def find_nvcc() -> Optional[str]:
    home = cuda_home()
    if home is not None and (home / "bin" / "nvcc").is_file():
        return str(home / "bin" / "nvcc")
    return None


def _probe(executable: str) -> str:
    try:
        out = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unusable ({exc})"
    text = (out.stdout or out.stderr).strip()
    if executable.endswith("nvcc"):
        match = re.search(r"release \S+, V([\d.]+)", text)
        return f"nvcc {match.group(1)}" if match else text.splitlines()[-1] if text else "nvcc ?"
    return text.splitlines()[0] if text else f"{executable} (no version)"


def fingerprint(executable: str) -> str:
    """Path, size and modification time of the binary: a stat, which tells a changed compiler without running it."""
    resolved = os.path.realpath(executable)
    st = os.stat(resolved)
    return f"{resolved}|{st.st_size}|{st.st_mtime_ns}"


def read_memo(memo_file: Path) -> Dict[str, str]:
    """The memo's fingerprint -> version map; empty unless the file is trusted and exactly such a map."""
    memo = _cache.read_trusted_json(memo_file)
    if not isinstance(memo, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in memo.items()):
        return {}
    return memo


def identify(executable: str, memo_file: Optional[Path], known: Optional[Dict[str, str]] = None) -> str:
    """Version line of ``executable``: from ``known`` or the memo (fingerprint -> version) when the binary is
    unchanged, else by running it (and remembering the answer in the memo when its directory is ours)."""
    fingerprint_now = fingerprint(executable)
    memo: Dict[str, str] = dict(known or {})
    if memo_file is not None:
        memo.update(read_memo(memo_file))
    if fingerprint_now in memo:
        return memo[fingerprint_now]
    version = _probe(executable)
    memo[fingerprint_now] = version
    if memo_file is not None and memo_file.parent.is_dir() and _cache.root_problem(memo_file.parent) is None:
        try:  # a read-only cache simply does not remember
            _cache.replace_file(memo_file, json.dumps(memo, indent=1, sort_keys=True).encode())
        except OSError:
            pass
    return version


def is_gcc(version_line: str) -> bool:
    """Whether ``c++ --version``'s first line is GCC's. GCC's reads "NAME (PKGVERSION) VERSION" with whatever name
    it was called by (c++, g++, x86_64-linux-gnu-g++-12); Clang, Intel's and NVIDIA's (PGI's) compilers name
    themselves."""
    line = version_line.lower()
    others = ("clang", "intel", "(icc)", "icpc", "nvc++", "pgc++", "unusable", "no version")
    return not any(other in line for other in others)


_OPENMP_RUNTIME = re.compile(r"^lib(gomp|omp|iomp5)([-.].*)?\.so(\.[\d.]+)?$")


def torch_openmp_runtime() -> Optional[Path]:
    """The OpenMP runtime this process loaded for torch (from /proc/self/maps), or None (no OpenMP, or not
    Linux). PyPI's x86-64 wheels load torch/lib/libgomp.so.1, the aarch64 ones torch.libs/libgomp-<hash>.so.1.0.0
    (auditwheel's renamed copy); should another runtime be loaded too, torch's own is the one returned."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
    except OSError:
        return None
    found = sorted(Path(p) for p in paths if p.startswith("/") and _OPENMP_RUNTIME.match(Path(p).name))
    package = Path(torch.__file__).resolve().parent
    torchs_own = {package / "lib", package.parent / "torch.libs"}
    found.sort(key=lambda p: p.parent not in torchs_own)  # stable: otherwise in path order
    return found[0] if found else None


def nvcc_release(version_line: str) -> Optional[str]:
    """'nvcc 13.0.88' -> '13.0'."""
    match = re.search(r"(\d+)\.(\d+)", version_line)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def default_max_jobs(gib_per_job: float) -> int:
    """Parallel compile jobs that the cores and the available memory allow (a torch translation unit takes
    about 1.5 GiB in g++, more in nvcc)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    available_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available_gib = int(line.split()[1]) / 2**20
                    break
    except OSError:
        pass
    by_memory = int(available_gib // gib_per_job) if available_gib is not None else cores
    return max(1, min(cores, by_memory))


def torch_cuda_major() -> Optional[str]:
    return torch.version.cuda.split(".")[0] if torch.version.cuda else None


def check_sanitizer_runtime(variant: "Variant") -> None:
    """Raises BuildError with the remedy when ``variant`` is built with ASan and this process was not started
    with ASan's runtime and libstdc++ preloaded. Without libasan, the library would load it as a dependency, too
    late: the runtime aborts with "ASan runtime does not come first in initial library list". Without libstdc++
    at start-up (python does not link it), ASan's __cxa_throw interceptor finds no real one, and the first C++
    exception aborts with "CHECK failed: asan_interceptors.cpp ... real___cxa_throw". (UBSan's runtime loads
    fine as a dependency.)"""
    if "address" not in variant.sanitize:
        return
    import ctypes

    asan = hasattr(ctypes.CDLL(None), "__asan_init")  # preloaded: its symbols are in the global scope
    if asan and "libstdc++" in os.environ.get("LD_PRELOAD", ""):
        return
    cxx = cxx_name()
    missing = "libstdc++ preloaded with it" if asan else "the AddressSanitizer runtime preloaded"
    raise BuildError(
        f"DEFORM_CONV_SANITIZE={os.environ.get('DEFORM_CONV_SANITIZE', '')} asks for the {variant.label}, which need "
        f"python started with {missing}.\n"
        f'Remedy: run with LD_PRELOAD="$({cxx} -print-file-name=libasan.so) $({cxx} -print-file-name=libstdc++.so)" '
        "ASAN_OPTIONS=detect_leaks=0 (python itself leaks by design), as scripts/sanitize-tests does; or unset "
        "DEFORM_CONV_SANITIZE."
    )


def check_prerequisites(variant: "Variant") -> None:
    """Raises BuildError with a remedy for each tool a build needs and does not find, before compiling."""
    check_sanitizer_runtime(variant)  # the build's child process loads what it built
    if find_cxx() is None:
        raise BuildError(
            f"no C++ compiler found (looked for {cxx_name()!r} on PATH) to build deform_conv's "
            f"{variant.label}.\nRemedy: install one (Debian/Ubuntu: `apt-get install g++`; conda: "
            "`conda install gxx`) or point $CXX at it; or copy a prebuilt cache entry here (see the README), or "
            "set DEFORM_CONV_FALLBACK=reference to run the slow pure-PyTorch implementation."
        )
    if ensure_ninja_on_path() is None:
        raise BuildError("ninja not found, which the build needs.\nRemedy: `pip install ninja`.")
    if variant.kind != "cuda":
        return
    if find_nvcc() is None:
        raise BuildError(
            f"CUDA_HOME not found (or without bin/nvcc): no nvcc for deform_conv's {variant.label}.\nRemedy: install "
            f"the CUDA toolkit matching torch's CUDA {torch.version.cuda} and set CUDA_HOME to it (nvcc is "
            "$CUDA_HOME/bin/nvcc); or set DEFORM_CONV_CUDA=0 to use the CPU kernels only."
        )
    nvcc = identify(find_nvcc(), _settings.cache_dir() / _cache.TOOLCHAINS_FILE)
    release = nvcc_release(nvcc)
    if release is None or release.split(".")[0] != torch_cuda_major():
        raise BuildError(
            f"nvcc's CUDA ({nvcc} at {find_nvcc()}) differs in major version from the CUDA torch was "
            f"built with ({torch.version.cuda}); the library would not load.\nRemedy: point CUDA_HOME at a CUDA "
            f"{torch_cuda_major()}.x toolkit, or install the torch build for CUDA {release}."
        )
