"""How a library is compiled: ninja, on the build file torch.utils.cpp_extension writes, in a child process that
cannot outlive its importer, its log, and an error whose remedy matches the cause.

For a host-compiled library (the CPU library, the CUDA simulation) this process writes the build file with
cpp_extension's own functions and the child only runs ninja; for the CUDA library the child runs
cpp_extension.load, which sets nvcc up from the child's environment. The child runs in a session of its own, with
ninja under it (ninja puts each compile in a process group of its own and passes SIGTERM on to them). A watchdog
thread in the child reads a pipe whose only writer is the importing process: when the importer dies, even by
SIGKILL, the pipe reaches end-of-file and the watchdog stops the build (SIGTERM to its group, then SIGKILL). When
the importer is interrupted (SIGINT, a notebook's "interrupt kernel"), it stops the build the same way and
re-raises the KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Set

import torch

from . import cache as _cache, settings as _settings, sources as _sources, toolchain as _toolchain
from .errors import BuildError
from .progress import Elapsed
from .variant import CSRC, Variant, unit_of

# The child's watchdog: stops the build when the importer is gone.
_WATCHDOG = """
import json, os, signal, subprocess, sys, threading, time

def stop_the_build():
    # SIGTERM first: ninja runs each compile in a process group of its own and, on SIGTERM, passes it to them.
    group, me = os.getpgid(0), os.getpid()
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) == group:
                    os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError, IndexError):
            pass
    time.sleep(3)
    os.killpg(0, signal.SIGKILL)  # whatever is left of the group, this process included

def watch(fd):
    while os.read(fd, 1):
        pass
    stop_the_build()  # end of file: the importer is gone

threading.Thread(target=watch, args=(int(sys.argv[2]),), daemon=True).start()
"""

# The child of a build whose ninja file this process wrote (write_build_file): ninja, without importing torch
# (which would cost the child seconds before its first compile).
_CHILD_RUNS_NINJA = _WATCHDOG + """
sys.stdout.flush()
try:
    returncode = subprocess.run(json.loads(sys.argv[1])).returncode
except OSError as exc:
    print(f"deform_conv build: ninja did not start: {exc}")
    sys.exit(1)
sys.exit(128 - returncode if returncode < 0 else returncode)  # killed by a signal: 128 + its number, as a shell
"""

# The child of a CUDA build: cpp_extension.load, which sets up nvcc from the child's environment (CUDA_HOME,
# TORCH_CUDA_ARCH_LIST) as it imports. It always loads what it built, and the importer must load only the
# published library (and a CLI prebuild for other GPU archs must not load at all): so, in a child.
_CHILD_LOADS = _WATCHDOG + """
from torch.utils import cpp_extension
try:
    cpp_extension.load(**json.loads(sys.argv[1]))
except Exception as exc:
    print(f"deform_conv build: {type(exc).__name__}: {exc}".splitlines()[0])
    sys.exit(1)
"""

LOG_FILE = "build.log"
NINJA_LOG = ".ninja_log"


def library_name(variant: Variant) -> str:
    """The library's name in its build: the same for every build of a kind, so that the compile commands (which
    carry it) stay the same and an incremental build recompiles only what changed."""
    return f"deform_conv_{variant.kind}"


def _build_environment(variant: Variant) -> Dict[str, str]:
    env = dict(os.environ)
    jobs = _settings.max_jobs()
    if jobs is None:
        jobs = _toolchain.default_max_jobs(gib_per_job=3.0 if variant.kind == "cuda" else 1.5)
    env["MAX_JOBS"] = str(jobs)
    if variant.kind == "cuda":
        env["TORCH_CUDA_ARCH_LIST"] = ";".join(variant.cuda_archs)
        env["CUDA_HOME"] = str(_toolchain.cuda_home())  # the toolkit check_prerequisites checked
    return env


def compiler_flags(variant: Variant, cxx_version: str) -> List[str]:
    """The key's compile flags plus GCC's own where the compiler is GCC (the key records both, and the
    compiler)."""
    return list(variant.cxx_flags) + (list(_sources.GCC_CXX_FLAGS) if _toolchain.is_gcc(cxx_version) else [])


def link_flags(variant: Variant, cxx_version: str) -> List[str]:
    """The key's link flags plus the OpenMP runtime torch itself loaded, named by path so that our parallel
    regions and torch's share one runtime and one thread count (on aarch64, PyPI's torch ships libgomp under a
    renamed file that -fopenmp would not find: it would link the system's, a second runtime). The path is not
    part of the key: what the library records is the runtime's soname, the same for one torch build."""
    runtime = _toolchain.torch_openmp_runtime()
    flags = list(variant.ld_flags)
    if runtime is not None and _toolchain.is_gcc(cxx_version):
        flags = [f for f in flags if f != "-fopenmp"] + [str(runtime)]
    return flags


def run(variant: Variant, directory: Path, tools: Dict[str, str], show_progress: bool = True) -> None:
    """Compiles ``variant`` into ``directory`` (a private directory of ours, possibly seeded with an earlier build's
    objects: ninja then recompiles only the units whose sources changed) with the compiler whose version line is
    ``tools["cxx"]``; the compiler's output goes to ``directory/build.log`` (and to the terminal with
    DEFORM_CONV_VERBOSE=1). Raises CompileFailed when the compile fails (:func:`failure` makes the message)."""
    verbose = _settings.verbose()
    args = dict(
        name=library_name(variant),
        # In a directory of their own beside the entries: the compile commands name them, so their paths must not
        # change from one build to the next (an incremental build recompiles a unit whose command changed).
        sources=_sources.write_units(variant.kind, str(CSRC), str(_cache.own_directory(directory.parent,
                                                                                        _cache.UNITS_DIR))),
        extra_cflags=compiler_flags(variant, tools["cxx"]),
        extra_ldflags=link_flags(variant, tools["cxx"]),
        build_directory=str(directory),
        is_python_module=False,
        verbose=True,  # ninja's output goes to the log either way
        with_cuda=variant.kind == "cuda",
    )
    if variant.kind == "cuda":
        args["extra_cuda_cflags"] = list(_sources.NVCC_FLAGS)
    env = _build_environment(variant)
    if variant.kind != "cuda" and write_build_file(args):
        script = [_CHILD_RUNS_NINJA, json.dumps(["ninja", "-v", "-j", env["MAX_JOBS"]])]
    else:
        script = [_CHILD_LOADS, json.dumps(args)]
    log_fd = os.open(directory / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    # The watchdog's pipe. A process this one forks while the build runs holds a copy of the write end, so the
    # watchdog then sees only the death of both; the interrupt path below does not depend on it.
    watchdog_read, watchdog_write = os.pipe()
    command = [sys.executable, "-c", *script, str(watchdog_read)]
    with os.fdopen(log_fd, "w") as log, Elapsed(f"compiling the {variant.label}", quiet=verbose or not show_progress):
        try:
            try:
                child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         errors="replace", env=env, cwd=directory, start_new_session=True,
                                         pass_fds=(watchdog_read,))
            finally:
                os.close(watchdog_read)
            _running.add(child)
            try:
                assert child.stdout is not None
                for line in child.stdout:
                    log.write(line)
                    if verbose:
                        sys.stdout.write(line)
                returncode = child.wait()
            except BaseException:  # KeyboardInterrupt above all: the compile must not run on without us
                _kill_group(child)
                raise
            finally:
                _running.discard(child)
        finally:
            os.close(watchdog_write)
    if returncode != 0:
        raise CompileFailed(returncode, int(env["MAX_JOBS"]))


def write_build_file(args: Dict) -> bool:
    """Writes the ninja file that ``cpp_extension.load(**args)`` would write for a host-compiled library, with
    cpp_extension's own functions, in this process (which has imported torch already). False where that fails,
    for whatever reason (the functions are internal: another torch may have renamed them; no ninja): the child
    then runs cpp_extension.load itself, which builds or reports the failure in the build's log, as it always did."""
    # Its import warns where it finds no CUDA runtime, which a CPU build does not use (torch's logger; older
    # torch prints to stderr): the warning went to the build log while the child imported it.
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from torch.utils import cpp_extension
    except Exception:
        return False
    finally:
        logger.setLevel(level)

    def call(function, **kwargs):
        accepted = inspect.signature(function).parameters
        return function(**{name: value for name, value in kwargs.items() if name in accepted})

    common = dict(with_cuda=False, with_sycl=False, is_standalone=False)
    try:
        cpp_extension.verify_ninja_availability()
        ldflags = call(cpp_extension._prepare_ldflags, extra_ldflags=list(args["extra_ldflags"]), verbose=False,
                       **common)
        call(cpp_extension._write_ninja_file_to_build_library,
             path=os.path.join(args["build_directory"], "build.ninja"), name=args["name"], sources=args["sources"],
             extra_cflags=args["extra_cflags"], extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=ldflags,
             extra_include_paths=[], **common)
    except Exception:
        return False
    return True


def unit_seconds(directory: Path, since: float) -> Dict[str, float]:
    """{unit or library file: seconds} of what the build in ``directory`` that started at ``since`` (time.time())
    compiled and linked, slowest first, from ninja's log (start and end in ms, one line per output, the last one
    winning). Outputs older than ``since`` came from an earlier build and are left out."""
    took: Dict[str, float] = {}
    try:
        lines = (directory / NINJA_LOG).read_text().splitlines()
    except OSError:
        return took
    for line in lines:
        fields = line.split("\t")
        if line.startswith("#") or len(fields) < 4 or not fields[0].isdigit() or not fields[1].isdigit():
            continue
        try:
            fresh = os.lstat(directory / fields[3]).st_mtime >= since - 1.0  # (file systems' coarse clocks)
        except OSError:
            continue
        if fresh:
            name = unit_of(fields[3]) if fields[3].endswith(".o") else fields[3]
            took[name] = (int(fields[1]) - int(fields[0])) / 1000.0
    return dict(sorted(took.items(), key=lambda item: -item[1]))


# The compiles running now, in any thread (build.build_concurrently runs two at once).
_running: Set[subprocess.Popen] = set()


def stop_all() -> None:
    """Stops every compile this process runs: an interrupt reaches only the main thread, while the compiles that
    build_concurrently runs are watched by other threads (which then see them fail)."""
    for child in list(_running):
        _kill_group(child)


def _kill_group(child: subprocess.Popen) -> None:
    """SIGTERM to the child's group (ninja passes it on to the compiles, each in a group of its own), then SIGKILL
    to what is left of it."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            break
        try:
            child.wait(timeout=grace)
            if sig == signal.SIGTERM:
                time.sleep(0.5)  # ninja forwarded the signal before exiting; let its compiles take it
        except subprocess.TimeoutExpired:
            continue
    child.wait()


class CompileFailed(Exception):
    """The child exited with ``returncode``; :func:`failure` turns it into the user's BuildError."""

    def __init__(self, returncode: int, jobs: int) -> None:
        super().__init__(returncode)
        self.returncode, self.jobs = returncode, jobs


def _log_excerpt(lines: List[str], first_lines: int = 15, last_lines: int = 10) -> str:
    """The compiler's first error with the lines after it (later errors are often consequences), then the
    log's last lines."""
    first_error = next((i for i, line in enumerate(lines) if re.search(r"\berror\b", line)), None)
    if first_error is None or first_error >= len(lines) - last_lines:
        return "The compiler's last lines:\n" + "\n".join(lines[-(first_lines + last_lines):])
    return ("The compiler's first error:\n" + "\n".join(lines[first_error:first_error + first_lines])
            + "\n...\nThe log's last lines:\n" + "\n".join(lines[-last_lines:]))


# How a compiler killed by SIGKILL (the OOM killer) shows in a log: GCC's driver, collect2 for the linker, nvcc,
# a shell's job report, an exit status of 128 + 9.
_KILLED = re.compile(r"Killed signal terminated program|terminated with signal 9|died due to signal 9|"
                     r"(^|\d+ )Killed\b|exit status 137", re.MULTILINE)


def _remedy(failed: CompileFailed, log: str) -> str:
    """The remedy that matches what the log shows."""
    if failed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) or _KILLED.search(log):
        return (f"a compiler was killed (SIGKILL), most likely by the out-of-memory killer: this build ran "
                f"{failed.jobs} jobs at once. Set MAX_JOBS to fewer (e.g. MAX_JOBS={max(1, failed.jobs // 2)}), or "
                "free memory, and import again.")
    if re.search(r"omp\.h['’]?:? (No such file|file not found)|'omp\.h' file not found", log):
        return ("the compiler has no OpenMP headers (omp.h). Install its OpenMP development package: for GCC, "
                "Debian/Ubuntu `apt-get install libgomp1 g++` (Fedora: `dnf install libgomp gcc-c++`); for Clang, "
                "Debian/Ubuntu `apt-get install libomp-dev` (Fedora: `dnf install libomp-devel`). Or point $CXX at "
                "a compiler that has them.")
    return (f"read the first error in the log. A compiler older than GCC 9 or Clang 10 cannot build torch "
            f"{torch.__version__}'s headers: point $CXX at a newer one. Set DEFORM_CONV_VERBOSE=1 to see every "
            "command, or DEFORM_CONV_FALLBACK=reference to run the slow pure-PyTorch implementation.")


def failure(variant: Variant, failed: CompileFailed, log_path: Path) -> BuildError:
    """The BuildError for a failed compile whose log now lies at ``log_path``."""
    try:
        log = log_path.read_text(errors="replace").rstrip()
    except OSError:
        log = ""
    return BuildError(
        f"compiling deform_conv's {variant.label} failed (exit code {failed.returncode}).\n"
        f"{_log_excerpt(log.splitlines())}\n\nFull log: {log_path}\nRemedy: {_remedy(failed, log)}"
    )
