"""Loads each kernel library, building it once per machine: the bundled library, else a trusted cache entry,
else a build under a lock.

A library has no Python bindings (no pybind11, no ``Python.h``): it only registers ops with the dispatcher,
so it is loaded with ``torch.ops.load_library`` and does not depend on the Python version.

Warm path: a stat of the compiler, the trust checks and a hash of the library (``_cache.inspect_entry``),
``torch.ops.load_library``; no compiler, ninja or cpp_extension. Build path: lock, the same check again, compile
in a private directory (``_compile``), write key.json last, rename into place.

Sanitizer mode, for tests: ``DEFORM_CONV_SANITIZE=1`` (= ``address,undefined``, or a list of those) builds the
CPU library with ``-fsanitize=...`` at ``-O1 -g`` into an entry of its own (tag ``cpu-sanitize_...``, sanitize
in the key), so a plain import never loads it and vice versa. The CUDA library is never instrumented. An ASan
library loads only into a process started with the ASan runtime preloaded (:func:`_toolchain.check_sanitizer_runtime`
says how; scripts/sanitize-tests does it).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from . import cache as _cache, settings as _settings, toolchain as _toolchain, variant as _variant
from .cache import EntryState
from .errors import BuildError
from .progress import Elapsed, say
from .variant import PACKAGE_DIR, Variant, entry_name, entry_prefix, environment_inputs

PREBUILT = PACKAGE_DIR / "_prebuilt"  # libraries built at install time with DEFORM_CONV_AOT=1 (setup.py)


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
    """``$DEFORM_CONV_CACHE_DIR``, else ``$XDG_CACHE_HOME/deform_conv``, else ``~/.cache/deform_conv``; absolute."""
    return _settings.cache_dir()


def _tool_paths(variant: Variant) -> Optional[Dict[str, str]]:
    """Where the compiler (and for CUDA, nvcc) is; None when one is missing."""
    paths = {"cxx": _toolchain.find_cxx()}
    if variant.kind == "cuda":
        paths["nvcc"] = _toolchain.find_nvcc()
    return None if None in paths.values() else paths  # type: ignore[return-value]


def _recorded_versions(root: Path, prefix: str) -> Dict[str, str]:
    """fingerprint -> version of the tools that built this environment's trusted entries (their keys say)."""
    known: Dict[str, str] = {}
    for directory in root.glob(f"{prefix}-*"):
        key = _cache.inspect_entry(directory, hash_library=False).key
        if key is not None:
            known.update({fp: key["toolchain"][name] for name, fp in key["toolchain_fingerprints"].items()
                          if name in key["toolchain"]})
    return known


def toolchain_inputs(variant: Variant, root: Path, environment: Dict[str, object]) -> Optional[Dict[str, str]]:
    """The compiler's (and for CUDA, nvcc's) id and version; None when a tool is missing. A binary that built
    one of this environment's entries, or was asked before, is recognised by a stat: the warm path runs no tool
    then (only a compiler never seen here is asked its version, once)."""
    paths = _tool_paths(variant)
    if paths is None:
        return None
    known = _recorded_versions(root, entry_prefix(variant, environment))
    memo = root / _cache.TOOLCHAINS_FILE
    return {name: _toolchain.identify(path, memo, known) for name, path in paths.items()}


def _load(variant: Variant, state: EntryState, build_seconds: Optional[float] = None) -> LoadedLibrary:
    _toolchain.check_sanitizer_runtime(variant)
    assert state.key is not None
    library = state.path / state.key["library"]
    timer = Elapsed("loading", quiet=True)
    try:
        with timer:
            torch.ops.load_library(str(library))
    except OSError as exc:  # e.g. an entry copied from a machine with another C library
        causes = []  # torch >= 2.6 re-raises as "Could not load this library": the loader's own words are below
        cause: Optional[BaseException] = exc
        while cause is not None:
            causes.append(str(cause))
            cause = cause.__cause__ or cause.__context__
        raise BuildError(
            f"loading {library} failed: {causes[-1]}\nRemedy: delete {state.path} (or run `deform-conv clean`) so "
            "that it is rebuilt here, or copy an entry built on a machine like this one (the dynamic loader's "
            "message above names what it could not find)."
        ) from exc
    return LoadedLibrary(variant, library, state.path, build_seconds is None, build_seconds or 0.0, timer.seconds)


def prebuilt_key_file(variant: Variant) -> str:
    return f"{variant.kind}.json"


def write_prebuilt_key(variant: Variant, library: Path) -> None:
    """Records the key of a library built at install time (setup.py, DEFORM_CONV_AOT=1) beside it."""
    environment = environment_inputs(variant)
    tools = toolchain_inputs(variant, cache_root(), environment)
    key = {"environment": environment, "toolchain": tools, "library": library.name,
           "library_sha256": _cache.file_sha256(library)}
    (library.parent / prebuilt_key_file(variant)).write_text(json.dumps(key, indent=2, sort_keys=True) + "\n")


def matching_prebuilt(variant: Variant, environment: Dict[str, object]) -> EntryState:
    """The library bundled at install time (DEFORM_CONV_AOT=1) if it was built for exactly this environment."""
    return _cache.inspect_entry(PREBUILT, environment, prebuilt_key_file(variant), bundled=True)


def _warn_untrusted(state: EntryState) -> None:
    warnings.warn(f"deform_conv: not loading {state.path}: {state.problem}", RuntimeWarning, stacklevel=4)


def find_entry(variant: Variant, root: Path, environment: Dict[str, object], any_toolchain: bool,
               warn: bool = True) -> Tuple[Optional[EntryState], List[EntryState]]:
    """The usable entry for this variant, and the untrusted ones skipped on the way (each with a warning): the
    entry built by the compiler on PATH, or, with ``any_toolchain`` (no compiler, or a cache that cannot be
    written: the compiler matters only when building), any trusted entry built for exactly this environment, the
    newest first. Never is an entry preferred for how its name sorts."""
    if not root.is_dir():
        return None, []
    tools = toolchain_inputs(variant, root, environment)
    exact = root / entry_name(variant, environment, tools) if tools is not None else None
    others = [p for p in root.glob(entry_prefix(variant, environment) + "-*") if p != exact] if any_toolchain else []
    skipped = []
    for directory in ([exact] if exact is not None else []) + sorted(others, key=_key_mtime, reverse=True):
        state = _cache.inspect_entry(directory, environment)
        if state.usable:
            return state, skipped
        if state.untrusted:
            skipped.append(state)
            if warn:
                _warn_untrusted(state)
    return None, skipped


def _key_mtime(directory: Path) -> float:
    try:
        return os.lstat(directory / _cache.KEY_FILE).st_mtime
    except OSError:
        return 0.0


def can_build(variant: Variant, root: Path) -> bool:
    """Whether an import would build ``variant`` here (its tools are on PATH and ``root`` can be written); where
    it would not, any trusted entry for this environment loads, whichever compiler built it."""
    return _tool_paths(variant) is not None and _cache.can_write(root)


def untrusted_root_error(root: Path, problem: str) -> BuildError:
    return BuildError(
        f"the kernel cache {root} may not be trusted: {problem}. Libraries found there could have been written by "
        "another user, and a library runs with your rights.\nRemedy: set DEFORM_CONV_CACHE_DIR to a directory of "
        f"your own (it is created 0700), or make {root} and its parents yours and writable only by you "
        "(`chmod go-w`); see the README's section on the trust model."
    )


def load(variant: Variant) -> LoadedLibrary:
    """Loads ``variant``'s library: the bundled one if its key matches, else the trusted cache entry, building it
    first if this machine has none (or, where nothing can be built, any trusted entry for this environment)."""
    environment = environment_inputs(variant)
    prebuilt = matching_prebuilt(variant, environment)
    if prebuilt.usable:
        return _load(variant, prebuilt)
    if prebuilt.untrusted:
        _warn_untrusted(prebuilt)
    root = cache_root()
    if os.path.lexists(root):
        problem = _cache.root_problem(root)
        if problem is not None:
            raise untrusted_root_error(root, problem)
    buildable = can_build(variant, root)
    found, skipped = find_entry(variant, root, environment, any_toolchain=not buildable)
    if found is not None:
        return _load(variant, found)
    try:
        if not buildable and _tool_paths(variant) is not None:
            raise BuildError(
                f"the {variant.label} are not built for this torch/source/flags in {root}, which cannot be written, "
                "so they cannot be built there.\nRemedy: set DEFORM_CONV_CACHE_DIR to a writable directory of "
                "yours, or build them where the cache is writable (`deform-conv build`)."
            )
        loaded = build(variant, root)
    except BuildError as error:
        if not skipped:
            raise
        untrusted = "".join(f"\n  {s.path}: {s.problem}" for s in skipped)
        raise BuildError(f"{error}\nSkipped as untrusted (remove them, or rebuild as their owner):{untrusted}") from None
    assert isinstance(loaded, LoadedLibrary)
    return loaded


def _needs_build(variant: Variant) -> bool:
    """Whether :func:`load` would compile ``variant`` now: nothing bundled or cached serves it, and it can be built
    here. False wherever load would raise instead (it then raises, with its message)."""
    environment = environment_inputs(variant)
    if matching_prebuilt(variant, environment).usable:
        return False
    root = cache_root()
    if os.path.lexists(root) and _cache.root_problem(root) is not None:
        return False
    if not can_build(variant, root):
        return False
    found, _skipped = find_entry(variant, root, environment, any_toolchain=False, warn=False)
    return found is None


def build_concurrently(variants: Tuple[Variant, ...]) -> Dict[Variant, BuildError]:
    """Compiles at once every library of ``variants`` that :func:`load` would compile, when there are several
    (the CPU and the CUDA library on a GPU machine's first import: their compiles overlap, the CUDA one, longer,
    started first), with one elapsed-time line for all. Loads nothing: :func:`load` then finds the entries.
    Returns the failures by variant, for load's caller to raise in order."""
    try:
        missing = [v for v in variants if _needs_build(v)]
    except (BuildError, OSError):
        return {}  # load() meets the same problem and says it
    if len(missing) < 2:
        return {}
    import concurrent.futures

    missing.sort(key=lambda v: v.kind != "cuda")
    root = cache_root()
    labels = " and the ".join(v.label for v in missing)
    failures: Dict[Variant, BuildError] = {}
    with Elapsed(f"compiling the {labels}", quiet=_settings.verbose()), \
            concurrent.futures.ThreadPoolExecutor(max_workers=len(missing)) as pool:
        futures = {v: pool.submit(build, v, root, load=False, show_progress=False) for v in missing}
        try:
            for variant, future in futures.items():
                try:
                    future.result()
                except BuildError as error:
                    failures[variant] = error
        except BaseException:  # KeyboardInterrupt: the compiles must not run on without us
            from . import compile as _compile

            _compile.stop_all()
            raise
    return failures


# ----------------------------------------------------------------------------------------------- build path

def build(variant: Variant, root: Path, load: bool = True, show_progress: bool = True) -> Union[LoadedLibrary, Path]:
    """Builds ``variant`` into its cache entry under ``root`` (or waits for another process that is
    building it), then loads it; with ``load=False`` only builds it and returns the entry. ``show_progress``: the
    elapsed-time line (off while several builds run at once: :func:`build_concurrently` shows one for all)."""
    _toolchain.check_prerequisites(variant)
    try:
        _cache.make_root(root)
    except OSError as exc:
        raise BuildError(
            f"cannot create the cache {root} ({exc.strerror}) to build deform_conv's {variant.label}.\n"
            "Remedy: set DEFORM_CONV_CACHE_DIR to a writable directory."
        ) from exc
    problem = _cache.root_problem(root)
    if problem is not None:
        raise untrusted_root_error(root, problem)
    try:
        return _build_locked(variant, root, load, show_progress)
    except OSError as exc:
        if exc.errno == errno.ENOLCK:
            raise BuildError(
                f"the file system of the cache {root} does not support file locks (ENOLCK), which keep concurrent "
                "builds apart.\nRemedy: put the cache on a local disk: set DEFORM_CONV_CACHE_DIR to a directory "
                "there (e.g. under /tmp or ~/.cache)."
            ) from exc
        remedy = ("free space on that disk, or set DEFORM_CONV_CACHE_DIR to a directory on another one"
                  if exc.errno in (errno.ENOSPC, errno.EDQUOT) else
                  "make the cache writable, or set DEFORM_CONV_CACHE_DIR to a writable directory")
        raise BuildError(f"building deform_conv's {variant.label} in {root} failed: {exc}\nRemedy: {remedy}.") from exc


def _check_locks_work(lock_file: Path) -> None:
    """Raises OSError(ENOLCK) where the file system has no locks. filelock itself would take such an error for
    "held by another process" (some releases) and wait for ever, or raise NotImplementedError (ENOSYS)."""
    import fcntl

    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK)) from exc
        # EWOULDBLOCK: another process holds it exclusively, which shows that locks work
    finally:
        os.close(fd)


def _acquire(lock, variant: Variant, entry: Path) -> None:
    from filelock import Timeout

    _check_locks_work(Path(lock.lock_file))
    try:
        lock.acquire(timeout=0)
        return
    except Timeout:
        pass
    say(f"waiting for another process that is compiling the {variant.label} into {entry}")
    waited = 0
    while True:  # say so every minute: a stopped holder must not look like a silent hang
        try:
            lock.acquire(timeout=60)
            return
        except Timeout:
            waited += 60
            say(f"still waiting ({waited} s) for the lock {lock.lock_file}, held by another process")


def _build_locked(variant: Variant, root: Path, load: bool, show_progress: bool) -> Union[LoadedLibrary, Path]:
    from filelock import FileLock

    environment = environment_inputs(variant)
    tools = toolchain_inputs(variant, root, environment)
    assert tools is not None  # check_prerequisites found every tool
    entry = root / entry_name(variant, environment, tools)
    lock = FileLock(str(_cache.own_directory(root, ".locks") / f"{entry.name}.lock"))
    _acquire(lock, variant, entry)
    try:
        state = _cache.inspect_entry(entry, environment)  # the warm path's judgement, again
        if state.usable:  # built by the process we waited for
            return _load(variant, state) if load else entry
        for stale in _cache.stale_builds(root, entry.name):
            _cache.discard(stale, root)
        import tempfile  # the build path's modules are imported only when it runs: the warm import stays short

        private = Path(tempfile.mkdtemp(prefix=f".build-{entry.name}-", dir=root))
        try:
            reused = _seed_from_earlier_build(variant, environment, entry, private, root)
            seconds = _compile_into(variant, environment, tools, entry, private, reused, show_progress)
            published = _publish(private, entry, environment, root)
        finally:
            if private.exists():
                _cache.discard(private, root)
        say(f"compiled the {variant.label} in {seconds:.1f} s")
        return _load(variant, published, build_seconds=seconds) if load else entry
    finally:
        lock.release()


# What may differ between two builds whose objects one may reuse from the other (unit by unit, by unit_sha256).
_SOURCE_INPUTS = ("package_version", "sources_sha256", "units")


def _seed_from_earlier_build(variant: Variant, environment: Dict[str, object], entry: Path, private: Path,
                             root: Path) -> List[str]:
    """Starts the build in ``private`` from the newest trusted entry built for the same variant, flags, torch and
    toolchain from other sources (a source edited during development, a package upgrade): the objects of its units
    whose sources and headers are unchanged are copied over, so that only the others are compiled. Returns the
    units reused."""
    same = {k: v for k, v in environment.items() if k not in _SOURCE_INPUTS}
    toolchain_hash = entry.name.rsplit("-", 1)[1]
    earlier = []
    for directory in root.glob(f"{variant.tag}-torch*-{toolchain_hash}"):
        state = _cache.inspect_entry(directory, hash_library=False)
        key = state.key
        if directory == entry or key is None or not isinstance(key.get("unit_sha256"), dict):
            continue
        if {k: v for k, v in key["environment"].items() if k not in _SOURCE_INPUTS} == same:
            earlier.append((_key_mtime(directory), directory, key["unit_sha256"]))
    if not earlier:
        return []
    _mtime, directory, their_hashes = max(earlier, key=lambda found: found[0])
    ours = _variant.unit_sha256(variant)
    unchanged = [_variant.unit_file_name(variant, unit) for unit, digest in ours.items()
                 if their_hashes.get(unit) == digest]
    return [_variant.unit_of(f) for f in _cache.seed_build(directory, private, unchanged)]


def _compile_into(variant: Variant, environment: Dict[str, object], tools: Dict[str, str], entry: Path,
                  private: Path, reused: List[str], show_progress: bool) -> float:
    """Compiles into ``private`` (where the objects of the units ``reused`` already lie) and writes its key.json
    last; returns the compile's duration."""
    import time

    from . import compile as _compile

    cuda = f" / CUDA {torch.version.cuda}" if variant.kind == "cuda" else ""
    again = f", reusing {len(reused)} of {len(variant.units)} units of an earlier build" if reused else ""
    say(f"compiling the {variant.label} for torch {torch.__version__}{cuda} into {entry} "
        f"(once; later imports load it{again})")
    name = _compile.library_name(variant)
    timer = Elapsed("build", quiet=True)
    started = time.time()
    try:
        with timer:
            _compile.run(variant, private, tools, show_progress)
    except _compile.CompileFailed as failed:
        log = _cache.own_directory(private.parent, "logs") / f"{entry.name}.log"
        os.replace(private / _compile.LOG_FILE, log)  # a rename: replaces whatever lies at that name
        raise _compile.failure(variant, failed, log) from None
    _cache.harden(private)
    library = f"{name}.so"
    key = {
        "environment": environment,
        "toolchain": tools,
        "toolchain_fingerprints": {n: _toolchain.fingerprint(p) for n, p in (_tool_paths(variant) or {}).items()},
        "library": library,
        "library_sha256": _cache.file_sha256(private / library),
        "build_seconds": round(timer.seconds, 1),
        # What this build compiled and linked, slowest first (doctor and the self-check show them), what it reused.
        "unit_seconds": {n: round(s, 1) for n, s in _compile.unit_seconds(private, started).items()},
        "reused_units": sorted(reused),
        "unit_sha256": _variant.unit_sha256(variant),
    }
    _cache.write_new_file(private / _cache.KEY_FILE, (json.dumps(key, indent=2, sort_keys=True) + "\n").encode())
    return timer.seconds


def _publish(private: Path, entry: Path, environment: Dict[str, object], root: Path) -> EntryState:
    """Renames the finished build into place. Whatever lies at the entry's name and cannot be used (incomplete,
    untrusted, a dangling symlink, a file) is moved away first; a usable entry there (another build won a race the
    lock did not prevent, on a file system whose locks do not exclude) is kept, and this build is discarded."""
    for _attempt in range(3):
        state = _cache.inspect_entry(entry, environment)
        if state.usable:
            return state
        if os.path.lexists(entry):
            _cache.discard(entry, root)
        try:
            os.rename(private, entry)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise
            continue  # something appeared at the name meanwhile: judge it again
        state = _cache.inspect_entry(entry, environment)
        if state.usable:
            return state
        raise BuildError(f"the entry just built at {entry} cannot be used: {state.problem}")
    raise BuildError(f"could not publish the build into {entry}: another process keeps putting unusable "
                     "entries at that name.\nRemedy: run `deform-conv clean`, then import again.")
