"""The build as a process: it cannot outlive its importer, an interrupt reaches the user as one, concurrent
builds without a working lock each publish a correct entry, and each failure names its true cause."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import deform_conv
from deform_conv._jit import build as _build, cache as _cache, compile as _compile, loader as _loader
from deform_conv._jit import variant as _variant

from helpers.loader import IMPORT_AND_REPORT, child_env, compile_lines, fast_compiler, run_python


def slow_compiler(directory: Path) -> Path:
    """A compiler whose every compile records its pid in ``directory/pids`` and then sleeps for ten minutes: the
    build is certainly running when the test acts, and any compile left running is visible by its pid."""
    pids = directory / "pids"
    pids.mkdir(parents=True)
    real = fast_compiler(directory)
    wrapper = directory / "slow-c++"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo $$ > "{pids}/$$"; exec sleep 600 ;; esac\n'
                       f'exec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def wait_for_compiles(directory: Path, timeout: float = 120) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(p.name) for p in (directory / "pids").iterdir()]
        if pids:
            time.sleep(0.5)  # let ninja start the others it runs in parallel
            return [int(p.name) for p in (directory / "pids").iterdir()]
        time.sleep(0.1)
    raise AssertionError("the compile never started")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waits only for its parent to reap it: it runs nothing
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def assert_all_end(pids: list, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "compiles outlived their importer"


def start_import(cache: Path, cxx: Path) -> subprocess.Popen:
    # start_new_session: the test signals the importer alone, as a notebook's "interrupt kernel" does.
    return subprocess.Popen([sys.executable, "-c", IMPORT_AND_REPORT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env(cache, CXX=str(cxx)), start_new_session=True)


def test_killing_the_importer_stops_its_compile_and_the_next_import_builds(tmp_path):
    tools = tmp_path / "tools"
    importer = start_import(tmp_path / "cache", slow_compiler(tools))
    compiles = wait_for_compiles(tools)
    importer.kill()  # SIGKILL: no handler runs in the importer
    importer.communicate()
    assert_all_end(compiles)
    result = run_python(IMPORT_AND_REPORT, child_env(tmp_path / "cache", CXX=str(fast_compiler(tmp_path / "fast"))))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "False" and "waiting for another process" not in result.stderr


INTERRUPTIBLE_IMPORT = """
import sys
try:
    import deform_conv
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
    sys.stdin.readline()  # lives on after the interrupt, as a notebook kernel does, until the test lets it go
"""


def test_interrupting_the_importer_stops_its_compile_and_raises_keyboard_interrupt(tmp_path):
    tools = tmp_path / "tools"
    # SIGINT back to its default in the importer, so that Python installs its handler there even where this test
    # runs with SIGINT ignored (a background job of a shell without job control inherits that).
    importer = subprocess.Popen([sys.executable, "-c", INTERRUPTIBLE_IMPORT], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env=child_env(tmp_path / "cache", CXX=str(slow_compiler(tools))),
                                start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        compiles = wait_for_compiles(tools)
        importer.send_signal(signal.SIGINT)  # to the importer alone, as "interrupt kernel" does
        assert importer.stdout.readline().strip() == "KeyboardInterrupt"
        assert_all_end(compiles)
        assert not list((tmp_path / "cache").glob(".build-*")), "the interrupted build left its directory behind"
        # The lock was released while the importer lives on: the next import does not wait for it.
        fast = fast_compiler(tmp_path / "fast")
        result = run_python(IMPORT_AND_REPORT, child_env(tmp_path / "cache", CXX=str(fast)))
        assert result.returncode == 0 and "waiting for another process" not in result.stderr, result.stderr
        assert importer.poll() is None
    finally:
        importer.communicate("\n", timeout=60)


def test_leftovers_of_killed_builds_are_removed_by_age_only(tmp_path):
    """A private build directory is another build's until it is old: where the lock does not exclude, a young
    one may belong to a build still running. Old ones go when the next build runs."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    name = deform_conv.libraries[0].entry.name
    young, old = cache / f".build-{name}-young", cache / f".build-{name}-old"
    for leftover in (young, old):
        (leftover / "obj").mkdir(parents=True)
    past = time.time() - _cache.STALE_BUILD_SECONDS - 60
    for path in (old, old / "obj"):
        os.utime(path, (past, past))
    result = run_python(IMPORT_AND_REPORT, child_env(cache, CXX=str(fast_compiler(tmp_path / "fast"))))
    assert result.returncode == 0, result.stderr
    assert young.is_dir() and not old.exists()


NO_LOCK = """
import filelock
class NoLock:  # a file system whose flock does not exclude (node-local locks on a shared file system)
    def __init__(self, path): self.lock_file = path
    def acquire(self, timeout=None): pass
    def release(self): pass
filelock.FileLock = NoLock
"""


def test_concurrent_builds_without_a_working_lock_each_publish_a_correct_entry(tmp_path):
    tools = tmp_path / "tools"
    fast = fast_compiler(tools)
    slowish = tools / "slowish-c++"  # so that the two builds overlap
    slowish.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) sleep 2 ;; esac\nexec "{fast}" "$@"\n')
    slowish.chmod(0o755)
    env = child_env(tmp_path / "cache", CXX=str(slowish))
    children = [subprocess.Popen([sys.executable, "-c", NO_LOCK + IMPORT_AND_REPORT], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outputs = [child.communicate(timeout=600) for child in children]
    assert [child.returncode for child in children] == [0, 0], outputs
    assert len(compile_lines("".join(err for _, err in outputs))) == 2, "both should have built"
    (entry,) = {out.split()[1] for out, _ in outputs}
    assert _cache.inspect_entry(Path(entry)).usable
    assert not list((tmp_path / "cache").glob(".build-*")) and not list((tmp_path / "cache").glob(".trash-*"))


@pytest.mark.parametrize("error", [errno.ENOLCK, errno.ENOSYS])
def test_a_file_system_without_locks_gets_its_own_remedy(tmp_path, monkeypatch, error):
    """flock as it fails on such file systems: some filelock releases would take ENOLCK for a held lock and wait
    for ever, and turn ENOSYS into NotImplementedError."""
    import fcntl

    def no_locks(*args, **kwargs):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(_loader.BuildError, match=r"(?s)does not support file locks \(ENOLCK\).*Remedy: put the "
                                                 r"cache on a local disk"):
        _build.build(_variant.Variant("cpu"), tmp_path / "cache", load=False)


def failed(returncode: int = 1, jobs: int = 4) -> _compile.CompileFailed:
    return _compile.CompileFailed(returncode, jobs)


@pytest.mark.parametrize("log, returncode", [
    ("c++: fatal error: Killed signal terminated program cc1plus\ncompilation terminated.\n", 1),
    ("[3/10] c++ ... -c sampling_passes.cpp\nKilled\n", 1),
    ("", -signal.SIGKILL),
])
def test_a_compiler_killed_by_the_oom_killer_gets_the_memory_remedy(tmp_path, log, returncode):
    (tmp_path / "log").write_text(log)
    message = str(_compile.failure(_variant.Variant("cpu"), failed(returncode, jobs=4), tmp_path / "log"))
    assert "most likely by the out-of-memory killer: this build ran 4 jobs at once. Set MAX_JOBS to fewer " \
           "(e.g. MAX_JOBS=2)" in message


@pytest.mark.parametrize("log", [
    "x.cpp:3:10: fatal error: omp.h: No such file or directory\n",
    "x.cpp:3:10: fatal error: 'omp.h' file not found\n",
])
def test_missing_openmp_headers_get_the_package_to_install(tmp_path, log):
    (tmp_path / "log").write_text(log)
    message = str(_compile.failure(_variant.Variant("cpu"), failed(), tmp_path / "log"))
    assert "the compiler has no OpenMP headers (omp.h)" in message and "apt-get install libomp-dev" in message
    assert "dnf install libomp-devel" in message and "older than GCC 9" not in message


def test_a_compiler_killed_midway_is_reported_as_out_of_memory_end_to_end(tmp_path):
    """A compiler that dies as the OOM killer leaves GCC's driver: the import's error says what to do."""
    killed = tmp_path / "killed-c++"
    real = fast_compiler(tmp_path / "tools")
    killed.write_text('#!/bin/sh\ncase " $* " in *" -c "*) '
                      'echo "c++: fatal error: Killed signal terminated program cc1plus" >&2; exit 1 ;; esac\n'
                      f'exec "{real}" "$@"\n')
    killed.chmod(0o755)
    result = run_python("import deform_conv", child_env(tmp_path / "cache", CXX=str(killed), MAX_JOBS="2"))
    assert result.returncode != 0
    assert "most likely by the out-of-memory killer: this build ran 2 jobs at once" in result.stderr
