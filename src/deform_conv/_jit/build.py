"""How a library is built: under an OS-level lock, re-checked with the warm path's own test, compiled in a private
directory (``compile``) that starts from the unchanged units of an earlier build, its key written last, renamed into
place; and, on a first import that needs several libraries, their compiles at once. Imported only when a build
runs (``loader.load``, the command line), never by a warm import.
"""

from __future__ import annotations

# Everything the build path needs is imported here, by the thread that imports the package, never lazily inside
# a build: build_concurrently's threads run while `import deform_conv` is still executing the package's __init__,
# and a thread that imported one of the package's modules then could wait for ever on the import lock.
import concurrent.futures
import errno
import fcntl
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple, Union

import torch

from filelock import FileLock, Timeout

from . import cache as _cache, compile as _compile, settings as _settings, toolchain as _toolchain
from . import variant as _variant
from .cache import EntryState
from .errors import BuildError
from .loader import (LoadedLibrary, _key_mtime, _load, _tool_paths, can_build, cache_root, find_entry, find_loadable,
                     toolchain_inputs, untrusted_root_error)
from .progress import Elapsed, say
from .variant import Variant, entry_name, environment_inputs


def _needs_build(variant: Variant) -> bool:
    """Whether :func:`load` would compile ``variant`` now: nothing bundled or cached serves it, and it can be built
    here. False wherever load would raise instead (it then raises, with its message)."""
    root = cache_root()
    if os.path.lexists(root) and _cache.root_problem(root) is not None:
        return False
    if not can_build(variant, root):
        return False
    # Without hashing the library: load() hashes it once more anyway (and rebuilds it, on its own, if damaged).
    _loadable, found, _skipped = find_loadable(variant, root, buildable=True, warn=False, hash_library=False)
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
            _compile.stop_all()
            raise
    return failures


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
        private = Path(tempfile.mkdtemp(prefix=f".build-{entry.name}-", dir=root))
        try:
            # Hashed once, before anything is compiled: a source saved while the compile runs must make the next
            # build compile its unit again, not reuse an object built from what was there before.
            hashes = _variant.unit_sha256(variant)
            reused = _seed_from_earlier_build(variant, environment, hashes, entry, private, root)
            seconds = _compile_into(variant, environment, tools, hashes, entry, private, reused, show_progress)
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


def _seed_from_earlier_build(variant: Variant, environment: Dict[str, object], hashes: Dict[str, str], entry: Path,
                             private: Path, root: Path) -> List[str]:
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
    unchanged = [_variant.unit_file_name(variant, unit) for unit, digest in hashes.items()
                 if their_hashes.get(unit) == digest]
    try:
        return [_variant.unit_of(f) for f in _cache.seed_build(directory, private, unchanged)]
    except OSError:  # the earlier entry went away meanwhile (another process's `clean`): compile everything
        return []


def _compile_into(variant: Variant, environment: Dict[str, object], tools: Dict[str, str], hashes: Dict[str, str],
                  entry: Path, private: Path, reused: List[str], show_progress: bool) -> float:
    """Compiles into ``private`` (where the objects of the units ``reused`` already lie) and writes its key.json
    last; returns the compile's duration."""
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
        "unit_sha256": hashes,
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
