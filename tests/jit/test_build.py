"""The loader in one process: cache keys, entry naming, prerequisites, CUDA selection, the wheel, the CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import deform_conv
from deform_conv._jit import cache as _cache, compile as _compile, loader as _loader, progress as _progress
from deform_conv._jit import build as _build, toolchain as _toolchain, variant as _variant

from helpers.loader import ROOT, child_env, compile_lines, fast_compiler


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_entry_name_changes_with_every_key_input(kind):
    variant = _variant.Variant(kind, ("9.0",) if kind == "cuda" else ())
    environment = _variant.environment_inputs(variant)
    tools = {"cxx": "c++ (Debian 12.2.0) 12.2.0", **({"nvcc": "nvcc 13.0.88"} if kind == "cuda" else {})}
    changed_environment = {
        "variant": "other",
        "package_version": "9.9.9",
        "sources_sha256": "0" * 64,
        "units": {"all": ["ops.cpp"]},
        "cxx_flags": ["-O2"],
        "gcc_cxx_flags": [],
        "ld_flags": [],
        "torch_version": "2.99.0",
        "torch_cxx11_abi": not environment["torch_cxx11_abi"],
        "torch_cuda": "99.9",
        "platform": "plan9-mips",
    }
    if kind == "cuda":
        changed_environment.update(nvcc_flags=["-G"], cuda_archs=["8.0", "9.0"])
    assert set(changed_environment) == set(environment), "every key input must be covered by this test"
    changed_tools = {"cxx": "clang version 18.1.0", **({"nvcc": "nvcc 13.1.0"} if kind == "cuda" else {})}

    names = {_variant.entry_name(variant, environment, tools)}
    for key, value in changed_environment.items():
        names.add(_variant.entry_name(variant, {**environment, key: value}, tools))
    for key, value in changed_tools.items():
        names.add(_variant.entry_name(variant, environment, {**tools, key: value}))
    assert len(names) == 1 + len(changed_environment) + len(changed_tools)


@pytest.mark.parametrize("version_line, gcc", [
    ("c++ (Debian 12.2.0-14) 12.2.0", True), ("x86_64-linux-gnu-g++-12 (Ubuntu 12.3.0) 12.3.0", True),
    ("Ubuntu clang version 18.1.3", False), ("icpc (ICC) 2021.10.0 20230609", False),
    ("Intel(R) oneAPI DPC++/C++ Compiler 2024.0.0", False), ("nvc++ 24.3-0 64-bit target on x86-64 Linux", False),
])
def test_gcc_only_flags_reach_gcc_only(version_line, gcc):
    """--param and the like would stop another compiler at its first unit."""
    flags = _compile.compiler_flags(_variant.Variant("cpu"), version_line)
    assert flags[:len(_variant.Variant("cpu").cxx_flags)] == list(_variant.Variant("cpu").cxx_flags)
    assert ("--param=vect-epilogues-nomask=0" in flags) == gcc


def test_this_process_writes_a_host_librarys_ninja_file(tmp_path):
    """A CPU build's ninja file is written by the importing process with cpp_extension's own (internal)
    functions, so that the build's child runs ninja at once instead of importing torch first (seconds of every
    cold build): they are still what compile.write_build_file calls them as."""
    source = tmp_path / "unit.cpp"
    args = dict(name="deform_conv_cpu", sources=[str(source)], extra_cflags=["-O3", "-ffp-contract=off"],
                extra_ldflags=["-Wl,--as-needed"], build_directory=str(tmp_path))
    assert _compile.write_build_file(args)
    ninja = (tmp_path / "build.ninja").read_text()
    assert f"build unit.o: compile {source}" in ninja and "-ffp-contract=off" in ninja
    assert "-Wl,--as-needed" in ninja and "-ltorch_cpu" in ninja and "build deform_conv_cpu.so: link unit.o" in ninja


def test_source_and_header_edits_change_the_key(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(_variant.CSRC, csrc)
    monkeypatch.setattr(_variant, "CSRC", csrc)
    before = _variant.sources_sha256()
    with open(csrc / "sampling.h", "a") as f:
        f.write("// an edit\n")
    after_header = _variant.sources_sha256()
    with open(csrc / "ms_deform_attn" / "cpu" / "ms_deform_attn_cpu.cpp", "a") as f:  # a file two levels down
        f.write("// an edit\n")
    after_source = _variant.sources_sha256()
    assert len({before, after_header, after_source}) == 3


def test_entry_records_its_key_inputs_readably():
    entry = deform_conv.libraries[0].entry
    key = _cache.inspect_entry(entry).key
    assert key is not None
    assert key["environment"] == _variant.environment_inputs(deform_conv.libraries[0].variant)
    assert key["toolchain"]["cxx"] == _toolchain.identify(_toolchain.find_cxx(), None)
    assert (entry / key["library"]).is_file() and (entry / "build.log").is_file()


def test_cache_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("DEFORM_CONV_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _loader.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("DEFORM_CONV_CACHE_DIR")
    assert _loader.cache_root() == tmp_path / "xdg" / "deform_conv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _loader.cache_root() == tmp_path / "home" / ".cache" / "deform_conv"


def test_compiler_version_is_remembered_per_binary(tmp_path):
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\necho 'fake-cxx 1.0'\n")
    fake.chmod(0o755)
    memo = tmp_path / "toolchains.json"
    assert _toolchain.identify(str(fake), memo) == "fake-cxx 1.0"
    fake.write_text("#!/bin/sh\nexit 1\n")  # same size would keep the memo; a new mtime and size do not
    fake.write_text("#!/bin/sh\necho 'fake-cxx 2.0 (upgraded)'\n")
    assert _toolchain.identify(str(fake), memo) == "fake-cxx 2.0 (upgraded)"


def test_missing_tools_are_diagnosed_before_compiling(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(_loader.BuildError, match=r"(?s)no C\+\+ compiler found .*Remedy: install one"):
        _toolchain.check_prerequisites(_variant.Variant("cpu"))


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_cuda_home_missing_and_nvcc_mismatch_are_diagnosed(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    with pytest.raises(_loader.BuildError, match=r"(?s)CUDA_HOME not found.*Remedy: install the CUDA toolkit"):
        _toolchain.check_prerequisites(_variant.Variant("cuda", ("9.0",)))
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 11.8, V11.8.89'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("DEFORM_CONV_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(_loader.BuildError, match=r"nvcc's CUDA \(nvcc 11.8.89 .*differs in major version"):
        _toolchain.check_prerequisites(_variant.Variant("cuda", ("9.0",)))


def test_cuda_library_selection(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0;8.0 8.0")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert _variant.requested_cuda_archs() == ("8.0", "9.0")
    assert _variant.requested_cuda_archs("8.6") == ("8.6",)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert _variant.requested_cuda_archs() == ()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(9, 0), (8, 6)][i])
    assert _variant.requested_cuda_archs() == ("8.6", "9.0")
    monkeypatch.setenv("DEFORM_CONV_CUDA", "0")  # the opt-out, for GPU machines without the CUDA toolkit
    assert _variant.requested_cuda_archs() == ()
    assert _variant.requested_cuda_archs("9.0") == ("9.0",)  # an explicit --cuda-arch still builds
    monkeypatch.setattr(torch.version, "cuda", None)
    assert _variant.requested_cuda_archs("9.0") == ()


@pytest.mark.parametrize("value, expected", [
    ("", ()), ("0", ()), ("1", ("address", "undefined")), ("undefined", ("undefined",)),
    (" undefined,address", ("address", "undefined")),
])
def test_sanitize_setting(monkeypatch, value, expected):
    monkeypatch.setenv("DEFORM_CONV_SANITIZE", value)
    assert _variant.cpu_variant().sanitize == expected


def test_sanitize_setting_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv("DEFORM_CONV_SANITIZE", "adress")
    with pytest.raises(_loader.BuildError, match=r"DEFORM_CONV_SANITIZE must be `1` \(= `address,undefined`\) or a "
                                                 r"comma-separated list of `address`, `undefined`.*; got 'adress'"):
        _variant.wanted_variants()


def test_sanitized_library_has_an_entry_of_its_own():
    plain, sanitized = _variant.Variant("cpu"), _variant.Variant("cpu", sanitize=("address", "undefined"))
    assert sanitized.cxx_flags[-5:] == ("-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                                        "-fno-omit-frame-pointer", "-g", "-O1")
    assert "-O3" not in sanitized.cxx_flags and sanitized.ld_flags[-1] == "-fsanitize=address,undefined"
    tools = {"cxx": "c++ (Debian 12.2.0) 12.2.0"}
    plain_name = _variant.entry_name(plain, _variant.environment_inputs(plain), tools)
    sanitized_name = _variant.entry_name(sanitized, _variant.environment_inputs(sanitized), tools)
    assert plain_name.startswith("cpu-torch") and sanitized_name.startswith("cpu-sanitize_address_undefined-torch")
    assert "sanitize" not in _variant.environment_inputs(plain)  # plain keys, and their entries, stay as they were


def test_asan_build_without_the_preloaded_runtime_is_refused_before_compiling(monkeypatch, tmp_path):
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("this process has the ASan runtime (scripts/sanitize-tests)")
    monkeypatch.setenv("DEFORM_CONV_SANITIZE", "1")
    remedy = r'LD_PRELOAD="\$\(\S+ -print-file-name=libasan.so\) \$\(\S+ -print-file-name=libstdc\+\+.so\)"'
    with pytest.raises(_loader.BuildError, match=r"(?s)AddressSanitizer runtime preloaded.*Remedy: run with " + remedy):
        _build.build(_variant.cpu_variant(), tmp_path)
    assert not (tmp_path / "logs").exists()  # nothing compiled


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the machine without a GPU")
def test_without_gpu_or_arch_list_only_the_cpu_library_loads_and_cuda_stays_uninitialised(tmp_path):
    code = "import torch, deform_conv; print([l.variant.kind for l in deform_conv.libraries], torch.cuda.is_initialized())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=child_env(deform_conv.libraries[0].entry.parent), check=True)
    assert result.stdout.split() == ["['cpu']", "False"]


def test_build_jobs_honour_max_jobs_and_the_machine(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "3")
    assert _compile._build_environment(_variant.Variant("cpu"))["MAX_JOBS"] == "3"
    monkeypatch.delenv("MAX_JOBS")
    jobs = int(_compile._build_environment(_variant.Variant("cpu"))["MAX_JOBS"])
    assert 1 <= jobs <= len(__import__("os").sched_getaffinity(0))


def test_progress_reports_elapsed_time(capsys):
    with _progress.Elapsed("compiling something", period=0.05) as timer:
        __import__("time").sleep(0.3)
    err = capsys.readouterr().err
    assert err.count("compiling something") >= 2 and timer.seconds >= 0.3


def test_wheel_is_pure_python_and_ships_the_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name.startswith("torch_deform_conv-") and wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = {str(p.relative_to(_variant.CSRC.parent.parent)) for p in _variant.CSRC.rglob("*") if p.is_file()}
    assert sources <= set(names), sources - set(names)
    assert not [n for n in names if n.endswith((".so", ".o", ".pyd"))], "pip wheel must not compile anything"


def test_doctor_and_clean(tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(deform_conv.libraries[0].entry, cache / deform_conv.libraries[0].entry.name)
    stale = cache / "cpu-torch1.0-000000000000-00000000"
    stale.mkdir()
    dangling = cache / "cpu-torch1.0-000000000000-00000001"
    dangling.symlink_to(tmp_path / "gone")
    plain_file = cache / "cpu-torch1.0-000000000000-00000002"
    plain_file.write_text("not an entry")
    (cache / "logs").mkdir()
    (cache / "toolchains.json").write_text("[]")
    (cache / ".toolchains.json.abc123").write_text("{}")
    users_own = cache / "notes.txt"
    users_own.write_text("the user's, not the package's")
    users_log = cache / "logs" / "training.txt"  # a `logs` directory keeps what is not a build log of ours
    users_log.write_text("the user's too")
    env = child_env(cache)
    doctor = subprocess.run([sys.executable, "-m", "deform_conv", "doctor"], capture_output=True, text=True, env=env)
    assert f"cpu          built: {deform_conv.libraries[0].entry.name}" in doctor.stdout, doctor.stdout + doctor.stderr
    assert f"{stale.name}  NOT LOADABLE: {stale} is incomplete" in doctor.stdout
    assert f"{dangling.name}  NOT LOADABLE: {dangling} is a symlink (dangling) to {tmp_path / 'gone'}" in doctor.stdout
    assert f"{plain_file.name}  NOT LOADABLE: {plain_file} is not a directory" in doctor.stdout
    # The symlink and the file are problems (the loader skips them); an unfinished build is not.
    assert doctor.returncode == 1 and doctor.stdout.count("`deform-conv clean` removes it") == 2, doctor.stdout
    clean = subprocess.run([sys.executable, "-m", "deform_conv", "clean", "--stale"], capture_output=True, text=True,
                           env=env, check=True)
    assert not any(os.path.lexists(p) for p in (stale, dangling, plain_file)), clean.stdout
    assert (cache / deform_conv.libraries[0].entry.name).is_dir() and (cache / "toolchains.json").exists()
    subprocess.run([sys.executable, "-m", "deform_conv", "clean"], capture_output=True, env=env, check=True)
    assert sorted(p.name for p in cache.iterdir()) == ["logs", "notes.txt"]  # all of ours, nothing of the user's
    assert users_own.read_text() == "the user's, not the package's" and users_log.read_text() == "the user's too"
    assert [p.name for p in (cache / "logs").iterdir()] == ["training.txt"]


def test_main_job_builds_into_an_empty_cache_then_reuses_it(tmp_path):
    """`python -m deform_conv`: one line saying what is built, where and that it happens once; the versions,
    the cache and the check; the second run loads from the cache, silently."""
    env = child_env(tmp_path, CXX=str(fast_compiler(tmp_path.parent / f"{tmp_path.name}-tools")))
    first = subprocess.run([sys.executable, "-m", "deform_conv"], capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    (line,) = compile_lines(first.stderr)
    assert str(tmp_path) in line and "once" in line and torch.__version__ in line
    assert "compiled the CPU kernels in" in first.stderr
    for expected in (f"torch      {torch.__version__}", "compiler   ", f"cache      {tmp_path}", "built now in",
                     "PASS vs reference", "forward+backward"):
        assert expected in first.stdout, expected
    assert first.stdout.rstrip().endswith("OK") and "FAIL" not in first.stdout

    second = subprocess.run([sys.executable, "-m", "deform_conv"], capture_output=True, text=True, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "loaded from the cache" in second.stdout and second.stderr == ""
