"""Loads each kernel library, building it once per machine: the bundled library, else a trusted cache entry,
else a build under a lock.

A library has no Python bindings (no pybind11, no ``Python.h``): it only registers ops with the dispatcher,
so it is loaded with ``torch.ops.load_library`` and does not depend on the Python version.

Warm path: a stat of the compiler, the trust checks and a hash of the library (``_cache.inspect_entry``),
``torch.ops.load_library``; no compiler, ninja or cpp_extension. Build path (``build``): lock, the same check
again, compile in a private directory (``compile``), write key.json last, rename into place.

Sanitizer mode, for tests: ``DEFORM_CONV_SANITIZE=1`` (= ``address,undefined``, or a list of those) builds the
CPU library with ``-fsanitize=...`` at ``-O1 -g`` into an entry of its own (tag ``cpu-<isa>-sanitize_...``, sanitize
in the key), so a plain import never loads it and vice versa. The CUDA library is never instrumented. An ASan
library loads only into a process started with the ASan runtime preloaded (:func:`_toolchain.check_sanitizer_runtime`
says how; scripts/sanitize-tests does it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from . import cache as _cache, settings as _settings, toolchain as _toolchain
from .cache import EntryState
from .errors import BuildError
from .progress import Elapsed
from .variant import PACKAGE_DIR, Variant, entry_name, entry_prefix, environment_inputs, sources_sha256

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
               warn: bool = True, hash_library: bool = True) -> Tuple[Optional[EntryState], List[EntryState]]:
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
        state = _cache.inspect_entry(directory, environment, hash_library=hash_library)
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


def _root_problem(root: Path) -> Optional[str]:
    return _cache.root_problem(root) if os.path.lexists(root) else None


def find_loadable(variant: Variant, root: Path, buildable: bool, warn: bool = True,
                  hash_library: bool = True) -> Tuple[Variant, Optional[EntryState], List[EntryState]]:
    """What an import loads without building, as (the variant it is, its state or None, the untrusted entries
    skipped on the way): for ``variant`` and then each of its stand-ins (Variant.stand_ins), the library bundled
    at install time if its key matches; else their trusted cache entries (any compiler's where nothing can be
    built here: ``buildable`` False), unless ``root`` itself may not be trusted."""
    candidates = (variant,) + variant.stand_ins(buildable)
    sources = sources_sha256()  # once for all the candidates

    @functools.lru_cache(maxsize=None)
    def environment(candidate: Variant) -> Dict[str, object]:
        return environment_inputs(candidate, sources)

    skipped = []
    for candidate in candidates if os.path.lexists(PREBUILT) else ():
        prebuilt = matching_prebuilt(candidate, environment(candidate))
        if prebuilt.usable:
            return candidate, prebuilt, skipped
        if prebuilt.untrusted:
            skipped.append(prebuilt)
            if warn:
                _warn_untrusted(prebuilt)
    if _root_problem(root) is not None:
        return variant, None, skipped  # nothing in it is loaded
    for candidate in candidates:
        found, untrusted = find_entry(candidate, root, environment(candidate), any_toolchain=not buildable, warn=warn,
                                      hash_library=hash_library)
        skipped += untrusted
        if found is not None:
            return candidate, found, skipped
    return variant, None, skipped


def load(variant: Variant) -> LoadedLibrary:
    """Loads ``variant``'s library (or a stand-in's: :func:`find_loadable`), building it first if this machine
    has none (or, where nothing can be built, raising BuildError)."""
    root = cache_root()
    buildable = can_build(variant, root)
    loadable, found, skipped = find_loadable(variant, root, buildable)
    if found is not None:
        return _load(loadable, found)
    problem = _root_problem(root)
    if problem is not None:
        raise untrusted_root_error(root, problem)
    try:
        if not buildable and _tool_paths(variant) is not None:
            raise BuildError(
                f"the {variant.label} are not built for this torch/source/flags in {root}, which cannot be written, "
                "so they cannot be built there.\nRemedy: set DEFORM_CONV_CACHE_DIR to a writable directory of "
                "yours, or build them where the cache is writable (`deform-conv build`)."
            )
        from . import build as _build  # the build path's modules load only when it runs: the warm import stays short

        loaded = _build.build(variant, root)
    except BuildError as error:
        copied = not buildable and bool(variant.stand_ins(buildable))  # an entry from elsewhere is the way out
        if not skipped and not copied:
            raise
        hint = (f"\nAn entry built on another machine loads here if it was built with `deform-conv build --portable` "
                f"(or for this CPU's instruction set, {variant.cpu_isa}, or a narrower one)." if copied else "")
        untrusted = "".join(f"\n  {s.path}: {s.problem}" for s in skipped)
        untrusted = f"\nSkipped as untrusted (remove them, or rebuild as their owner):{untrusted}" if skipped else ""
        raise BuildError(f"{error}{hint}{untrusted}") from None
    assert isinstance(loaded, LoadedLibrary)
    return loaded
