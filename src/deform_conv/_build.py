"""Builds each kernel library once per machine and loads it: cache key, entries, lock, build, errors.

A library has no Python bindings (no pybind11, no ``Python.h``): it only registers ops with the dispatcher,
so it is loaded with ``torch.ops.load_library`` and does not depend on the Python version.

Cache layout under :func:`cache_root`::

    <tag>-torch<version>-<environment hash>-<toolchain hash>/   one complete entry: key.json, the library, build.log
    .build-<entry>-XXXX/                                         a build in progress (private; renamed when done)
    .locks/<entry>.lock                                          OS-level lock (released by the kernel if its holder dies)
    logs/<entry>.log                                             the log of a failed build
    toolchains.json                                              compiler versions, so warm imports never run them

Warm path: a stat of the compiler, a hash check of the library, ``torch.ops.load_library``; no compiler,
ninja or cpp_extension. Build path: lock, re-check, compile in a private directory (in a child process, so
the parent loads only the published library), write key.json last, rename into place.

Sanitizer mode, for tests: ``DEFORM_CONV_SANITIZE=1`` (= ``address,undefined``, or a list of those) builds the
CPU library with ``-fsanitize=...`` at ``-O1 -g`` into an entry of its own (tag ``cpu-sanitize_...``, sanitize
in the key), so a plain import never loads it and vice versa. The CUDA library is never instrumented. An ASan
library loads only into a process started with the ASan runtime preloaded (:func:`check_sanitizer_runtime`
says how; scripts/sanitize-tests does it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import re
import tempfile
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple, Union

import torch

from . import _sources, _toolchain
from ._progress import Elapsed, say
from ._version import __version__

PACKAGE_DIR = Path(__file__).resolve().parent
CSRC = PACKAGE_DIR / _sources.CSRC_DIR
PREBUILT = PACKAGE_DIR / "_prebuilt"  # libraries built at install time with DEFORM_CONV_AOT=1 (setup.py)
KEY_FILE = "key.json"


class BuildError(RuntimeError):
    """The kernels could not be built; the message carries the compiler's last lines, the log and a remedy."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One library: the CPU one (every schema + CPU kernels) or the CUDA one for a list of GPU archs."""

    kind: str                          # "cpu" or "cuda"
    cuda_archs: Tuple[str, ...] = ()   # TORCH_CUDA_ARCH_LIST entries, e.g. ("8.0", "9.0+PTX")
    sanitize: Tuple[str, ...] = ()     # CPU only: -fsanitize= names from $DEFORM_CONV_SANITIZE, e.g. ("address",)

    @property
    def sources(self) -> Tuple[str, ...]:
        return _sources.CPU_SOURCES if self.kind == "cpu" else _sources.CUDA_SOURCES

    @property
    def cxx_flags(self) -> Tuple[str, ...]:
        """The one place flags are chosen (the key records what this returns). Sanitized: -O1 instead of -O3,
        as ASan's docs advise: usable speed, with reports whose frames and lines match the source."""
        if not self.sanitize:
            return _sources.CXX_FLAGS
        plain = tuple(f for f in _sources.CXX_FLAGS if not f.startswith("-O"))
        return plain + ("-fsanitize=" + ",".join(self.sanitize),) + _sources.SANITIZE_CXX_FLAGS

    @property
    def ld_flags(self) -> Tuple[str, ...]:
        return _sources.LD_FLAGS + (("-fsanitize=" + ",".join(self.sanitize),) if self.sanitize else ())

    @property
    def label(self) -> str:
        if self.kind == "cpu":
            return "CPU kernels" + (f" (-fsanitize={','.join(self.sanitize)})" if self.sanitize else "")
        return "CUDA kernels for " + ", ".join("sm_" + a.replace(".", "") for a in self.cuda_archs)

    @property
    def tag(self) -> str:
        if self.kind == "cpu":
            return "cpu" + ("-sanitize_" + "_".join(self.sanitize) if self.sanitize else "")
        return "cuda-" + "_".join("sm" + a.replace(".", "").replace("+PTX", "ptx") for a in self.cuda_archs)


@dataclasses.dataclass(frozen=True)
class LoadedLibrary:
    """What ``import deform_conv`` loaded, for the self-check, ``doctor`` and bug reports."""

    variant: Variant
    path: Path
    entry: Path             # its cache entry (or the bundled _prebuilt directory)
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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sources_sha256() -> str:
    """One hash over every source and header under csrc/ (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.suffix in {".h", ".cuh", ".cpp", ".cu"}):
        digest.update(path.relative_to(CSRC).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment_inputs(variant: Variant) -> Dict[str, object]:
    """The key inputs known without running any tool: what the library is built from and for."""
    inputs: Dict[str, object] = {
        "variant": variant.kind,
        "package_version": __version__,
        "sources_sha256": sources_sha256(),
        "cxx_flags": list(variant.cxx_flags),
        "ld_flags": list(variant.ld_flags),
        "torch_version": torch.__version__,
        "torch_cxx11_abi": torch.compiled_with_cxx11_abi(),
        "torch_cuda": torch.version.cuda,
        "platform": f"{sys.platform}-{platform.machine()}",
    }
    if variant.kind == "cuda":
        inputs["nvcc_flags"] = list(_sources.NVCC_FLAGS)
        inputs["cuda_archs"] = list(variant.cuda_archs)
    if variant.sanitize:  # only when set: the key of a plain build (and its existing entries) stays as it was
        inputs["sanitize"] = list(variant.sanitize)
    return inputs


def _tool_paths(variant: Variant) -> Optional[Dict[str, str]]:
    """Where the compiler (and for CUDA, nvcc) is; None when one is missing."""
    paths = {"cxx": _toolchain.find_cxx()}
    if variant.kind == "cuda":
        paths["nvcc"] = _toolchain.find_nvcc()
    return None if None in paths.values() else paths  # type: ignore[return-value]


def _recorded_versions(root: Path, prefix: str) -> Dict[str, str]:
    """fingerprint -> version of the tools that built this environment's entries (recorded in their keys)."""
    known: Dict[str, str] = {}
    for key_file in root.glob(f"{prefix}-*/{KEY_FILE}"):
        try:
            key = json.loads(key_file.read_text())
            for name, fp in key.get("toolchain_fingerprints", {}).items():
                known[fp] = key["toolchain"][name]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return known


def toolchain_inputs(variant: Variant, root: Path, environment: Dict[str, object]) -> Optional[Dict[str, str]]:
    """The compiler's (and for CUDA, nvcc's) id and version; None when a tool is missing. A binary that built
    one of this environment's entries, or was asked before, is recognised by a stat: the warm path runs no tool
    then (only a compiler never seen here is asked its version, once)."""
    paths = _tool_paths(variant)
    if paths is None:
        return None
    known = _recorded_versions(root, entry_prefix(variant, environment))
    return {name: _toolchain.identify(path, root / "toolchains.json", known) for name, path in paths.items()}


def _hash_of(inputs: Dict[str, object]) -> str:
    return _sha256(json.dumps(inputs, sort_keys=True).encode())


def entry_prefix(variant: Variant, environment: Dict[str, object]) -> str:
    torch_tag = str(environment["torch_version"]).replace("+", "_")
    return f"{variant.tag}-torch{torch_tag}-{_hash_of(environment)[:12]}"


def entry_name(variant: Variant, environment: Dict[str, object], tools: Dict[str, str]) -> str:
    """Readable prefix, then a hash of the environment inputs and one of the toolchain."""
    return f"{entry_prefix(variant, environment)}-{_hash_of(tools)[:8]}"


def read_key(directory: Path, key_file: str = KEY_FILE) -> Optional[dict]:
    """The entry's key file if the entry is complete and its library intact, else None."""
    try:
        key = json.loads((directory / key_file).read_text())
        library = directory / key["library"]
        if _file_sha256(library) != key["library_sha256"]:
            return None  # truncated or overwritten: rebuilt below
        return key
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _load(variant: Variant, directory: Path, key: dict, build_seconds: Optional[float] = None) -> LoadedLibrary:
    check_sanitizer_runtime(variant)
    library = directory / key["library"]
    timer = Elapsed("loading", quiet=True)
    try:
        with timer:
            torch.ops.load_library(str(library))
    except OSError as exc:  # e.g. an entry copied from a machine with another C library
        raise BuildError(
            f"loading {library} failed: {exc}\nRemedy: delete {directory} (or run `deform-conv clean`) so that it "
            "is rebuilt here, or copy an entry built on a machine like this one."
        ) from exc
    return LoadedLibrary(variant, library, directory, build_seconds is None, build_seconds or 0.0, timer.seconds)


def prebuilt_key_file(variant: Variant) -> str:
    return f"{variant.kind}.json"


def write_prebuilt_key(variant: Variant, library: Path) -> None:
    """Records the key of a library built at install time (setup.py, DEFORM_CONV_AOT=1) beside it."""
    environment = environment_inputs(variant)
    tools = toolchain_inputs(variant, cache_root(), environment)
    key = {
        "environment": environment,
        "toolchain": tools,
        "library": library.name,
        "library_sha256": _file_sha256(library),
    }
    (library.parent / prebuilt_key_file(variant)).write_text(json.dumps(key, indent=2, sort_keys=True) + "\n")


def _matching_prebuilt(variant: Variant, environment: Dict[str, object]) -> Optional[dict]:
    """The key of the library bundled at install time (DEFORM_CONV_AOT=1) if it was built for exactly this
    environment, else None."""
    key = read_key(PREBUILT, prebuilt_key_file(variant))
    return key if key is not None and key.get("environment") == environment else None


def find_complete_entry(variant: Variant, root: Path, environment: Optional[Dict[str, object]] = None
                        ) -> Optional[Tuple[Path, dict]]:
    """The complete cache entry for this variant, or None (see toolchain_inputs for when a tool runs): with no
    compiler on PATH (a deployment box), any entry built for exactly this environment by any compiler will do."""
    environment = environment if environment is not None else environment_inputs(variant)
    tools = toolchain_inputs(variant, root, environment)
    if tools is not None:
        candidates: Iterable[Path] = [root / entry_name(variant, environment, tools)]
    else:
        candidates = sorted(root.glob(entry_prefix(variant, environment) + "-*"), reverse=True)
    for directory in candidates:
        key = read_key(directory)
        if key is not None and key.get("environment") == environment:
            return directory, key
    return None


def load(variant: Variant) -> LoadedLibrary:
    """Loads ``variant``'s library: the bundled one if its key matches, else the cache entry, building it
    first if this machine has none."""
    environment = environment_inputs(variant)
    prebuilt = _matching_prebuilt(variant, environment)
    if prebuilt is not None:
        return _load(variant, PREBUILT, prebuilt)
    root = cache_root()
    found = find_complete_entry(variant, root, environment)
    if found is not None:
        return _load(variant, *found)
    loaded = build(variant, root)
    assert isinstance(loaded, LoadedLibrary)
    return loaded


def requested_cuda_archs(explicit: Optional[str] = None) -> Tuple[str, ...]:
    """GPU archs to build the CUDA library for: ``explicit`` (the CLI's --cuda-arch) or $TORCH_CUDA_ARCH_LIST
    when given, else the archs of the visible GPUs, else none. Without a CUDA build of torch, none; without
    a list and without a GPU, CUDA is not initialised (device_count does not create a context); with a GPU,
    reading its compute capability initialises CUDA in this process. DEFORM_CONV_CUDA=0 asks for none."""
    if torch.version.cuda is None:
        return ()
    if explicit is None and os.environ.get("DEFORM_CONV_CUDA", "") == "0":
        return ()  # the user's opt-out: CPU kernels only, e.g. on a GPU machine without the CUDA toolkit
    spec = explicit if explicit is not None else os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if spec.strip():
        return tuple(sorted({a for a in re.split(r"[;,\s]+", spec.strip()) if a}))
    count = torch.cuda.device_count()
    return tuple(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(count)}))


SANITIZERS = ("address", "undefined")  # what DEFORM_CONV_SANITIZE=1 means, and all it accepts


def requested_sanitizers() -> Tuple[str, ...]:
    """$DEFORM_CONV_SANITIZE as sorted -fsanitize= names: unset, empty or 0 is none, 1 is both of SANITIZERS."""
    spec = os.environ.get("DEFORM_CONV_SANITIZE", "").strip()
    if spec in ("", "0"):
        return ()
    if spec == "1":
        return SANITIZERS
    names = tuple(sorted({n.strip() for n in spec.split(",") if n.strip()}))
    if not names or any(n not in SANITIZERS for n in names):
        raise BuildError(f"DEFORM_CONV_SANITIZE must be 0, 1 or a comma-separated list of {', '.join(SANITIZERS)}, "
                         f"got {spec!r}")
    return names


def cpu_variant() -> Variant:
    return Variant("cpu", sanitize=requested_sanitizers())


def check_sanitizer_runtime(variant: Variant) -> None:
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
    cxx = _toolchain.cxx_name()
    missing = "libstdc++ preloaded with it" if asan else "the AddressSanitizer runtime preloaded"
    raise BuildError(
        f"DEFORM_CONV_SANITIZE={os.environ.get('DEFORM_CONV_SANITIZE', '')} asks for the {variant.label}, which need "
        f"python started with {missing}.\n"
        f'Remedy: run with LD_PRELOAD="$({cxx} -print-file-name=libasan.so) $({cxx} -print-file-name=libstdc++.so)" '
        "ASAN_OPTIONS=detect_leaks=0 (python itself leaks by design), as scripts/sanitize-tests does; or unset "
        "DEFORM_CONV_SANITIZE."
    )


def wanted_variants() -> Tuple[Variant, ...]:
    """The CPU library (instrumented if $DEFORM_CONV_SANITIZE says so), then the CUDA library when
    :func:`requested_cuda_archs` asks for one."""
    archs = requested_cuda_archs()
    return (cpu_variant(),) + ((Variant("cuda", archs),) if archs else ())


# ----------------------------------------------------------------------------------------------- build path

# Runs in a child process: cpp_extension.load always loads what it built, and this process must load only
# the published library (and a CLI prebuild for other GPU archs must not load at all).
_CHILD = """
import json, sys
from torch.utils import cpp_extension
try:
    cpp_extension.load(**json.loads(sys.argv[1]))
except Exception as exc:
    print(f"deform_conv build: {type(exc).__name__}: {exc}".splitlines()[0])
    sys.exit(1)
"""


def check_prerequisites(variant: Variant) -> None:
    """Raises BuildError with a remedy for each tool a build needs and does not find, before compiling."""
    check_sanitizer_runtime(variant)  # the build's child process loads what it built
    if _toolchain.find_cxx() is None:
        raise BuildError(
            f"no C++ compiler found (looked for {_toolchain.cxx_name()!r} on PATH) to build deform_conv's "
            f"{variant.label}.\nRemedy: install one (Debian/Ubuntu: `apt-get install g++`; conda: "
            "`conda install gxx`) or point $CXX at it; or copy a prebuilt cache entry here (see the README), or "
            "set DEFORM_CONV_FALLBACK=reference to run the slow pure-PyTorch implementation."
        )
    if _toolchain.ensure_ninja_on_path() is None:
        raise BuildError("ninja not found, which the build needs.\nRemedy: `pip install ninja`.")
    if variant.kind != "cuda":
        return
    if _toolchain.find_nvcc() is None:
        raise BuildError(
            f"CUDA_HOME not found (or without bin/nvcc): no nvcc for deform_conv's {variant.label}.\nRemedy: install "
            f"the CUDA toolkit matching torch's CUDA {torch.version.cuda} and set CUDA_HOME to it (nvcc is "
            "$CUDA_HOME/bin/nvcc); or set DEFORM_CONV_CUDA=0 to use the CPU kernels only."
        )
    nvcc = _toolchain.identify(_toolchain.find_nvcc(), cache_root() / "toolchains.json")
    release = _toolchain.nvcc_release(nvcc)
    if release is None or release.split(".")[0] != _toolchain.torch_cuda_major():
        raise BuildError(
            f"nvcc's CUDA ({nvcc} at {_toolchain.find_nvcc()}) differs in major version from the CUDA torch was "
            f"built with ({torch.version.cuda}); the library would not load.\nRemedy: point CUDA_HOME at a CUDA "
            f"{_toolchain.torch_cuda_major()}.x toolkit, or install the torch build for CUDA {release}."
        )


def _build_environment(variant: Variant) -> Dict[str, str]:
    env = dict(os.environ)
    if not env.get("MAX_JOBS"):
        env["MAX_JOBS"] = str(_toolchain.default_max_jobs(gib_per_job=3.0 if variant.kind == "cuda" else 1.5))
    if variant.kind == "cuda":
        env["TORCH_CUDA_ARCH_LIST"] = ";".join(variant.cuda_archs)
        env["CUDA_HOME"] = str(_toolchain.cuda_home())  # the toolkit check_prerequisites checked
    return env


def _log_excerpt(log_path: Path, first_lines: int = 15, last_lines: int = 10) -> str:
    """The compiler's first error with the lines after it (later errors are often consequences), then the
    log's last lines."""
    lines = log_path.read_text(errors="replace").rstrip().splitlines()
    first_error = next((i for i, line in enumerate(lines) if re.search(r"\berror\b", line)), None)
    if first_error is None or first_error >= len(lines) - last_lines:
        return "The compiler's last lines:\n" + "\n".join(lines[-(first_lines + last_lines):])
    return ("The compiler's first error:\n" + "\n".join(lines[first_error:first_error + first_lines])
            + "\n...\nThe log's last lines:\n" + "\n".join(lines[-last_lines:]))


def _compile(variant: Variant, name: str, directory: Path, log_path: Path) -> None:
    """Compiles into ``directory`` in a child process; its output goes to ``log_path`` (and to the terminal
    with DEFORM_CONV_VERBOSE=1). Raises BuildError with the last lines of the log."""
    verbose = os.environ.get("DEFORM_CONV_VERBOSE", "") == "1"
    args = dict(
        name=name,
        sources=[str(CSRC / s) for s in variant.sources],
        extra_cflags=list(variant.cxx_flags),
        extra_ldflags=list(variant.ld_flags),
        build_directory=str(directory),
        is_python_module=False,
        verbose=True,  # ninja's output goes to the log either way
        with_cuda=variant.kind == "cuda",
    )
    if variant.kind == "cuda":
        args["extra_cuda_cflags"] = list(_sources.NVCC_FLAGS)
    command = [sys.executable, "-c", _CHILD, json.dumps(args)]
    with open(log_path, "w") as log, Elapsed(f"compiling the {variant.label}", quiet=verbose):
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 errors="replace", env=_build_environment(variant), cwd=directory)
        assert child.stdout is not None
        for line in child.stdout:
            log.write(line)
            if verbose:
                sys.stdout.write(line)
        returncode = child.wait()
    if returncode != 0:
        raise BuildError(
            f"compiling deform_conv's {variant.label} failed (exit code {returncode}).\n{_log_excerpt(log_path)}\n\n"
            f"Full log: {log_path}\n"
            f"Remedy: read the first error in the log. A compiler older than GCC 9 or Clang 10 cannot build "
            f"torch {torch.__version__}'s headers: point $CXX at a newer one. Set DEFORM_CONV_VERBOSE=1 to see "
            f"every command, or DEFORM_CONV_FALLBACK=reference to run the slow pure-PyTorch implementation."
        )


def build(variant: Variant, root: Path, load: bool = True) -> Union[LoadedLibrary, Path]:
    """Builds ``variant`` into its cache entry under ``root`` (or waits for another process that is
    building it), then loads it; with ``load=False`` only builds it and returns the entry."""
    try:
        return _build_locked(variant, root, load)
    except OSError as exc:
        raise BuildError(
            f"building deform_conv's {variant.label} in {root} failed: {exc}\n"
            "Remedy: make the cache writable, or set DEFORM_CONV_CACHE_DIR to a writable directory."
        ) from exc


def _build_locked(variant: Variant, root: Path, load: bool) -> Union[LoadedLibrary, Path]:
    from filelock import FileLock, Timeout

    check_prerequisites(variant)
    environment = environment_inputs(variant)
    tools = toolchain_inputs(variant, root, environment)
    assert tools is not None  # check_prerequisites found every tool
    entry = root / entry_name(variant, environment, tools)
    try:
        (root / ".locks").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(
            f"cannot write to the cache {root} ({exc}) to build deform_conv's {variant.label}.\n"
            "Remedy: set DEFORM_CONV_CACHE_DIR to a writable directory."
        ) from exc
    lock = FileLock(str(root / ".locks" / f"{entry.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        say(f"waiting for another process that is compiling the {variant.label} into {entry}")
        waited = 0
        while True:  # say so every minute: a stopped holder must not look like a silent hang
            try:
                lock.acquire(timeout=60)
                break
            except Timeout:
                waited += 60
                say(f"still waiting ({waited} s) for the lock {lock.lock_file}, held by another process")
    try:
        key = read_key(entry)
        if key is not None:  # built by the process we waited for
            return _load(variant, entry, key) if load else entry
        for stale in root.glob(f".build-{entry.name}-*"):  # left by a killed build: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        private = Path(tempfile.mkdtemp(prefix=f".build-{entry.name}-", dir=root))
        cuda = f" / CUDA {torch.version.cuda}" if variant.kind == "cuda" else ""
        say(f"compiling the {variant.label} for torch {torch.__version__}{cuda} into {entry} "
            "(once; later imports load it)")
        name = "deform_conv_" + variant.kind + "_" + entry.name.rsplit("-", 2)[1]
        (root / "logs").mkdir(exist_ok=True)
        log_path = root / "logs" / f"{entry.name}.log"  # stays here if the build fails; moves into the entry if not
        timer = Elapsed("build", quiet=True)
        try:
            with timer:
                _compile(variant, name, private, log_path)
        except BuildError:
            shutil.rmtree(private, ignore_errors=True)
            raise
        shutil.move(str(log_path), str(private / "build.log"))
        library = f"{name}.so"
        paths = _tool_paths(variant) or {}
        key = {
            "environment": environment,
            "toolchain": tools,
            "toolchain_fingerprints": {name: _toolchain.fingerprint(path) for name, path in paths.items()},
            "library": library,
            "library_sha256": _file_sha256(private / library),
            "build_seconds": round(timer.seconds, 1),
        }
        (private / KEY_FILE).write_text(json.dumps(key, indent=2, sort_keys=True) + "\n")  # last: marks it whole
        if entry.exists():  # an incomplete or corrupted entry: move it out of the way, then delete it
            trash = Path(tempfile.mkdtemp(prefix=f".trash-{entry.name}-", dir=root))
            os.rename(entry, trash / "old")
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(private, entry)
        say(f"compiled the {variant.label} in {timer.seconds:.1f} s")
        return _load(variant, entry, key, build_seconds=timer.seconds) if load else entry
    finally:
        lock.release()
