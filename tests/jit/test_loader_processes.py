"""The loader across processes: concurrency, corruption, read-only caches, no toolchain, a broken
compiler, the fallback switch, and the ahead-of-time build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


from deform_conv._jit import cache as _cache

from helpers.loader import (IMPORT_AND_REPORT, ROOT, child_env, compile_lines, copy_current_cpu_entry, fast_compiler,
                            read_only_command, run_python)


def test_four_processes_importing_at_once_compile_once(tmp_path):
    env = child_env(tmp_path / "cache", CXX=str(fast_compiler(tmp_path / "tools")))
    tmp_path = tmp_path / "cache"
    children = [subprocess.Popen([sys.executable, "-c", IMPORT_AND_REPORT], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for _ in range(4)]
    outputs = [child.communicate(timeout=600) for child in children]
    assert [child.returncode for child in children] == [0, 0, 0, 0], outputs
    stderr = "".join(err for _, err in outputs)
    assert len(compile_lines(stderr)) == 1, stderr
    entries = {out.split()[1] for out, _ in outputs}
    assert len(entries) == 1
    builds = [p for p in tmp_path.iterdir() if p.name.startswith("cpu-")]
    assert len(builds) == 1 and not list(tmp_path.glob(".build-*"))
    # The others either waited for the build (and said so) or arrived after it and found it.
    waited = stderr.count("waiting for another process that is compiling")
    assert waited <= 3


def test_corrupted_library_is_detected_and_rebuilt(tmp_path):
    entry = copy_current_cpu_entry(tmp_path)
    key = _cache.inspect_entry(entry).key
    library = entry / key["library"]
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])  # a truncated copy
    result = run_python(IMPORT_AND_REPORT, child_env(tmp_path, CXX=str(fast_compiler(tmp_path / "tools"))))
    assert result.returncode == 0, result.stderr
    assert len(compile_lines(result.stderr)) == 1
    assert _cache.inspect_entry(entry).usable  # whole again


def test_read_only_complete_entry_loads(tmp_path):
    cache = tmp_path / "cache"
    copy_current_cpu_entry(cache)
    code = IMPORT_AND_REPORT + "; open(deform_conv.cache_root() / 'probe', 'w')"
    result = subprocess.run(read_only_command(cache, code), capture_output=True, text=True, env=child_env(cache))
    # The import succeeded from the cache; the write that follows proves the directory was read-only.
    assert result.stdout.split()[0] == "True", result.stderr
    assert result.returncode != 0 and "Read-only file system" in result.stderr or "Permission denied" in result.stderr


def test_warm_path_needs_no_compiler_ninja_or_cpp_extension(tmp_path):
    """A deployment box: the entry copied from a build machine, no compiler and no ninja on PATH."""
    copy_current_cpu_entry(tmp_path)
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = child_env(tmp_path, PATH=str(empty_bin), CXX=str(tmp_path / "no-compiler"))
    result = run_python(IMPORT_AND_REPORT + "; import shutil; print(shutil.which('ninja'), shutil.which('c++'))", env)
    assert result.returncode == 0, result.stderr
    from_cache, _entry, imported_cpp_extension, ninja, cxx = result.stdout.split()
    assert (from_cache, imported_cpp_extension, ninja, cxx) == ("True", "False", "None", "None")
    assert result.stderr == ""


def test_warm_path_runs_no_tool_even_without_the_version_memo(tmp_path):
    """An entry copied without toolchains.json: the compiler is recognised from the fingerprint its key records,
    so loading starts no process at all (any attempt raises in this child)."""
    copy_current_cpu_entry(tmp_path)
    assert not (tmp_path / "toolchains.json").exists()
    code = (
        "import subprocess, torch\n"  # torch itself may start processes while it imports
        "def refuse(*args, **kwargs):\n"
        "    raise AssertionError(f'the warm path started a process: {args}')\n"
        "subprocess.run = subprocess.Popen = refuse\n" + IMPORT_AND_REPORT
    )
    result = run_python(code, child_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "True"


def test_broken_compiler_raises_build_error_with_log(tmp_path):
    broken = tmp_path / "broken-c++"
    broken.write_text(  # answers --version like a compiler, fails every compilation
        '#!/bin/sh\nif [ "$1" = --version ]; then echo "broken-c++ 1.0"; exit 0; fi\n'
        "echo 'broken-c++: internal compiler error: out of luck' >&2\nexit 1\n"
    )
    broken.chmod(0o755)
    result = run_python("import deform_conv", child_env(tmp_path / "cache", CXX=str(broken)))
    assert result.returncode != 0
    assert "deform_conv._jit.errors.BuildError: compiling deform_conv's CPU kernels failed" in result.stderr
    assert "internal compiler error: out of luck" in result.stderr
    log = next(line.split("Full log: ", 1)[1] for line in result.stderr.splitlines() if line.startswith("Full log: "))
    assert Path(log).is_file() and "out of luck" in Path(log).read_text()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("cpu-")], "no entry may be published"


def test_fallback_switch_runs_the_reference_with_a_warning(tmp_path):
    code = (
        "import warnings, torch\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import deform_conv\n"
        "print(deform_conv.libraries, any('DEFORM_CONV_FALLBACK=reference' in str(w.message) for w in caught))\n"
        "x, w, off = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3), torch.randn(1, 18, 3, 3)\n"
        "print(torch.equal(deform_conv.deform_conv2d(x, off, w), deform_conv.deform_conv2d_reference(x, off, w)))\n"
    )
    no_compiler = str(tmp_path / "no-compiler")
    result = run_python(code, child_env(tmp_path, CXX=no_compiler, DEFORM_CONV_FALLBACK="reference"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["()", "True", "True"]
    without = run_python("import deform_conv", child_env(tmp_path, CXX=no_compiler))
    assert without.returncode != 0 and "no C++ compiler found" in without.stderr


def test_ahead_of_time_build_is_bundled_and_preferred(tmp_path):
    """`DEFORM_CONV_AOT=1 pip install --no-build-isolation .` compiles at install time; the import then loads
    the bundled library and compiles nothing."""
    target = tmp_path / "site"
    # The install compiles the same units from the same sources as this session's entry (the portable library's
    # flags): the compiler wrapper copies those objects (the build, link and bundling run for real).
    compiler = str(fast_compiler(tmp_path / "tools"))
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(ROOT)],
        capture_output=True, text=True, env={**os.environ, "DEFORM_CONV_AOT": "1", "CXX": compiler}, timeout=900,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    assert (target / "deform_conv" / "_prebuilt" / "cpu.json").is_file()
    env = child_env(tmp_path / "empty-cache", PYTHONPATH=str(target))
    result = run_python(IMPORT_AND_REPORT + "; print(deform_conv.__file__)", env, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    from_cache, entry, _, module = result.stdout.split()
    assert from_cache == "True" and entry == str(target / "deform_conv" / "_prebuilt")
    assert module.startswith(str(target)) and result.stderr == ""
    assert not (tmp_path / "empty-cache").exists()
