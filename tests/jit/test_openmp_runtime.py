"""One OpenMP runtime: the CPU library's parallel regions run on the runtime torch loaded, with torch's thread count.

_compile.link_flags names torch's runtime by path instead of linking -fopenmp's libgomp: on PyPI's aarch64 wheels
torch ships libgomp renamed (torch.libs/libgomp-<hash>.so.1.0.0, its soname the same), and -fopenmp would make the
library NEED the system's libgomp.so.1, a second runtime with threads and a thread count of its own.

- the library this session loaded NEEDs exactly torch's runtime (x86-64, where it is built here);
- in a fresh process the kernels start no thread of their own: with one thread none at all, with two only
  torch's pool, and only torch's runtime is mapped;
- cross-compiled for aarch64 against torch's aarch64 wheel, the library NEEDs the wheel's renamed libgomp, and
  the same objects linked with plain -fopenmp (the control) NEED libgomp.so.1 instead.

The cross-compile test needs aarch64-linux-gnu-g++ and an aarch64 torch wheel: $AARCH64_TORCH_WHEEL, else the
newest /tmp/aarch64-torch/torch-*-manylinux_2_28_aarch64.whl (scripts/ci-test-prerequisites provides both).
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import List, Optional, Tuple

import pytest
import torch

import deform_conv
from deform_conv._jit import compile as _compile, sources as _sources, toolchain as _toolchain, variant as _variant

# The names OpenMP runtimes go by: GNU (libgomp.so.1, renamed libgomp-<hash>.so.1.0.0), LLVM (libomp.so.5) and
# Intel's (libiomp5.so).
OPENMP_RUNTIME = re.compile(r"^lib(gomp|omp|iomp5)([-.].*)?\.so(\.[\d.]+)?$")

needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and ELF files (Linux)")


# --- ELF dynamic sections -------------------------------------------------------------------------------------


def dynamic_section(path: Path) -> Tuple[List[str], Optional[str]]:
    """(NEEDED entries, SONAME or None) of the ELF file ``path``, by readelf -d, else objdump -p; skips the test
    when neither exists."""
    readelf = shutil.which("readelf")
    if readelf is not None:
        out = subprocess.run([readelf, "-d", "-W", str(path)], capture_output=True, text=True, check=True).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
        soname = re.findall(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", out)
    else:
        objdump = shutil.which("objdump")
        if objdump is None:
            pytest.skip("neither readelf nor objdump (binutils) is installed: cannot read ELF dynamic sections")
        out = subprocess.run([objdump, "-p", str(path)], capture_output=True, text=True, check=True).stdout
        needed = re.findall(r"^\s*NEEDED\s+(\S+)", out, re.MULTILINE)
        soname = re.findall(r"^\s*SONAME\s+(\S+)", out, re.MULTILINE)
    assert needed, f"no NEEDED entries read from {path}:\n{out}"
    return needed, soname[0] if soname else None


def soname_of(path: Path) -> str:
    """The name a library is recorded under in the NEEDED entries of what links it: its SONAME, else its name."""
    return dynamic_section(path)[1] or path.name


def elf_machine(path: Path) -> int:
    """e_machine of an ELF file (62: x86-64, 183: AArch64)."""
    with open(path, "rb") as f:
        header = f.read(20)
    assert header[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return int.from_bytes(header[18:20], "little" if header[5] == 1 else "big")


EM_AARCH64 = 183


def assert_needs_only_runtime(library: Path, runtime_soname: str) -> List[str]:
    needed, _ = dynamic_section(library)
    runtimes = [name for name in needed if OPENMP_RUNTIME.match(name)]
    assert runtimes == [runtime_soname], (
        f"{library.name} must NEED exactly torch's OpenMP runtime {runtime_soname}; its OpenMP NEEDED entries are "
        f"{runtimes} (all NEEDED: {needed})"
    )
    return needed


# --- 1. the library this session loaded -----------------------------------------------------------------------


@pytest.mark.skipif(platform.machine() != "x86_64" or not sys.platform.startswith("linux"),
                    reason="checks the library built here on x86-64 Linux (aarch64: see the cross-compile test)")
def test_loaded_library_needs_torchs_openmp_runtime_only():
    runtime = _toolchain.torch_openmp_runtime()
    if runtime is None:
        pytest.skip(f"torch {torch.__version__} loaded no OpenMP runtime (built without OpenMP?)")
    assert_needs_only_runtime(deform_conv.libraries[0].path, soname_of(runtime))


# --- 2. threads actually used ---------------------------------------------------------------------------------

# Runs in a fresh interpreter: argv[1] threads. Baseline: the threads after importing deform_conv and after torch's
# own parallel regions (elementwise, reduction, matmul, autograd) have started torch's pool for that many
# threads. Then our forward and backward several times; every OS thread is counted after each call. A second
# OpenMP runtime starts a pool of its own (as big as OMP_NUM_THREADS, set by the test) the first time one of our
# regions enters it, and its threads stay: they show as new tasks in /proc/self/task.
THREAD_PROBE = r"""
import json, os, re, sys, time
import torch

threads = int(sys.argv[1])
torch.set_num_threads(threads)
import deform_conv

def tasks():
    cpu = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # ended meanwhile
            continue
        cpu[int(tid)] = int(fields[11]) + int(fields[12])  # utime + stime, clock ticks
    return cpu

def openmp_runtimes():
    pattern = re.compile(r"^lib(gomp|omp|iomp5)([-.].*)?\.so(\.[\d.]+)?$")
    with open("/proc/self/maps") as maps:
        paths = {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
    return sorted(p for p in paths if p.startswith("/") and pattern.match(os.path.basename(p)))

before_torch = set(tasks())
x = torch.randn(1 << 22)
a = torch.randn(384, 384)
for _ in range(3):
    (x * 2 + 1).sum()
    a @ a
leaf = torch.randn(1 << 20, requires_grad=True)
(leaf * 2).sum().backward()
time.sleep(0.3)  # torch's workers stop spinning: their CPU time below is what our calls gave them
baseline = tasks()

g = torch.Generator().manual_seed(0)
B, C, O, H, W, K, OG = 2, 32, 32, 48, 48, 3, 4
input = torch.randn(B, C, H, W, generator=g).requires_grad_()
offset = (2 * torch.randn(B, 2 * OG * K * K, H, W, generator=g)).requires_grad_()
mask = torch.rand(B, OG * K * K, H, W, generator=g).requires_grad_()
weight = torch.randn(O, C, K, K, generator=g).requires_grad_()
bias = torch.randn(O, generator=g).requires_grad_()
most = len(baseline)
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(16):
    out = deform_conv.deform_conv2d(input, offset, weight, bias, 1, 1, 1, mask)
    most = max(most, len(os.listdir("/proc/self/task")))
    out.backward(torch.ones_like(out))
    most = max(most, len(os.listdir("/proc/self/task")))
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
after = tasks()
main = os.getpid()
workers = set(baseline) - before_torch - {main}  # the threads torch's own regions started
print(json.dumps(dict(
    num_threads=torch.get_num_threads(), baseline=len(baseline), most=most, after=len(after),
    new_threads=sorted(set(after) - set(baseline)), wall=wall, cpu=cpu,
    torch_workers=len(workers), torch_workers_ticks=sum(after.get(t, 0) - baseline[t] for t in workers),
    main_ticks=after[main] - baseline[main], openmp_runtimes=openmp_runtimes(),
    torch_runtime=str(deform_conv._jit.toolchain.torch_openmp_runtime() or "") or None,
)))
"""


def probe_threads(threads: int) -> dict:
    # OMP_NUM_THREADS=4: a second runtime's pool would have 3 workers whatever the machine's cores, while torch's
    # thread count is set by torch.set_num_threads in the probe.
    env = dict(os.environ, OMP_NUM_THREADS="4")
    child = subprocess.run([sys.executable, "-c", THREAD_PROBE, str(threads)], capture_output=True, text=True,
                           env=env, timeout=600)
    assert child.returncode == 0, f"the probe failed:\n{child.stdout}\n{child.stderr}"
    return json.loads(child.stdout.strip().splitlines()[-1])


def assert_one_runtime(report: dict) -> None:
    assert report["torch_runtime"] is not None, f"torch's OpenMP runtime is not mapped: {report}"
    assert report["openmp_runtimes"] == [report["torch_runtime"]], (
        f"the process must map only torch's OpenMP runtime {report['torch_runtime']}; it maps "
        f"{report['openmp_runtimes']}"
    )


@needs_linux
def test_one_thread_after_set_num_threads_1():
    """torch.set_num_threads(1): our loops start no thread, and the process spends no more CPU time than wall
    time (with a second thread at work, it would spend up to twice as much)."""
    report = probe_threads(1)
    assert report["num_threads"] == 1, report
    assert report["new_threads"] == [] and report["most"] == report["baseline"], (
        f"our calls started threads with torch.set_num_threads(1): {report}")
    assert report["wall"] > 0.2, f"too short a run to judge: {report}"
    # A single thread's CPU time cannot exceed the wall time; 1.2 leaves room for clock granularity only.
    assert report["cpu"] <= 1.2 * report["wall"], f"more CPU than wall time on one thread: {report}"
    if torch.backends.openmp.is_available():
        assert_one_runtime(report)


@needs_linux
def test_parallel_regions_run_on_torchs_thread_pool():
    """torch.set_num_threads(2): our regions run on the pool torch's own regions started (no new thread,
    however many cores), and only torch's runtime is mapped. This is the check a second runtime fails: with
    one thread at::parallel_for runs inline and never enters any runtime, so the test above cannot tell."""
    if not torch.backends.openmp.is_available():
        pytest.skip(f"torch {torch.__version__} is built without OpenMP: its pool is not an OpenMP runtime's")
    report = probe_threads(2)
    assert report["num_threads"] == 2, report
    assert report["torch_workers"] >= 1, f"torch's own regions started no worker thread: {report}"
    assert report["new_threads"] == [] and report["most"] == report["baseline"], (
        f"our calls started threads of their own (a second OpenMP runtime's pool?): {report}")
    assert_one_runtime(report)


# --- 3. cross-compiled for aarch64 ------------------------------------------------------------------------------

CROSS_CXX = "aarch64-linux-gnu-g++"
WHEEL_VARIABLE = "AARCH64_TORCH_WHEEL"
DEFAULT_WHEELS = "/tmp/aarch64-torch/torch-*-manylinux_2_28_aarch64.whl"


def _version_of_wheel(path: Path) -> Tuple[int, ...]:
    match = re.match(r"torch-(\d+)\.(\d+)\.(\d+)", path.name)
    return tuple(int(part) for part in match.groups()) if match else (0,)


def aarch64_wheel() -> Path:
    given = os.environ.get(WHEEL_VARIABLE)
    if given:
        if not Path(given).is_file():
            pytest.fail(f"${WHEEL_VARIABLE}={given} is not a file")
        return Path(given)
    found = sorted((Path(p) for p in glob.glob(DEFAULT_WHEELS)), key=_version_of_wheel)
    if not found:
        pytest.skip(f"no aarch64 torch wheel: set ${WHEEL_VARIABLE} or put one at {DEFAULT_WHEELS} "
                    "(scripts/ci-test-prerequisites downloads it)")
    return found[-1]


def _wanted(name: str) -> bool:
    """The wheel's headers and shared libraries (torch/lib, and torch.libs where auditwheel put the renamed
    libgomp and the other vendored libraries)."""
    if name.endswith("/"):
        return False
    if name.startswith("torch/include/"):
        return True
    folder, _, base = name.rpartition("/")
    return folder in ("torch/lib", "torch.libs") and ".so" in base


def extracted_wheel(wheel: Path) -> Path:
    """The wheel's headers and libraries, extracted once per wheel (name and size) under the temp directory."""
    stat = wheel.stat()
    base = Path(tempfile.gettempdir()) / f"deform_conv-test-aarch64-{os.getuid()}"
    target = base / f"{wheel.name[:-len('.whl')]}-{stat.st_size}"
    if (target / ".complete").is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=base, prefix=".partial-"))
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if _wanted(name):
                archive.extract(name, partial)
        (partial / "torch" / "version.py").write_bytes(archive.read("torch/version.py"))
    (partial / ".complete").write_text(str(wheel) + "\n")
    try:
        partial.rename(target)
    except OSError:  # another run finished first
        shutil.rmtree(partial, ignore_errors=True)
        assert (target / ".complete").is_file()
    return target


def wheel_torch_version(root: Path) -> Tuple[int, int]:
    text = (root / "torch" / "version.py").read_text()
    major, minor = re.search(r"__version__\s*=\s*['\"](\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def wheel_cxx11_abi(root: Path) -> int:
    """1 when the wheel's libc10 was built with the C++11 ABI (its std::string symbols are std::__cxx11's)."""
    return int(b"St7__cxx1112basic_string" in (root / "torch" / "lib" / "libc10.so").read_bytes())


def wheel_openmp_runtime(root: Path) -> Path:
    """The OpenMP runtime the wheel's libtorch_cpu.so NEEDs, as a file of the wheel."""
    needed, _ = dynamic_section(root / "torch" / "lib" / "libtorch_cpu.so")
    names = [name for name in needed if OPENMP_RUNTIME.match(name)]
    assert len(names) == 1, f"the wheel's libtorch_cpu.so NEEDs {names} as OpenMP runtime (all: {needed})"
    candidates = [p for folder in ("torch/lib", "torch.libs") for p in sorted((root / folder).glob("lib*omp*.so*"))]
    matching = [p for p in candidates if p.name == names[0] or soname_of(p) == names[0]]
    assert matching, f"no file of the wheel is {names[0]}, which libtorch_cpu.so NEEDs (found {candidates})"
    return matching[0]


@needs_linux
def test_cross_compiled_aarch64_library_needs_the_wheels_openmp_runtime(tmp_path, monkeypatch):
    cxx = shutil.which(CROSS_CXX)
    if cxx is None:
        pytest.skip(f"{CROSS_CXX} is not installed (Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu; "
                    "scripts/ci-test-prerequisites installs it)")
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed: cannot read the aarch64 library's dynamic section")
    wheel = aarch64_wheel()
    started = time.perf_counter()
    root = extracted_wheel(wheel)
    extract_seconds = time.perf_counter() - started
    include = root / "torch" / "include"
    torch_lib, torch_libs = root / "torch" / "lib", root / "torch.libs"
    runtime = wheel_openmp_runtime(root)
    runtime_soname = soname_of(runtime)
    assert runtime_soname != "libgomp.so.1", f"the wheel's runtime is not renamed: {runtime}"
    assert elf_machine(torch_lib / "libtorch_cpu.so") == EM_AARCH64, f"{wheel.name} is not an aarch64 wheel"

    # As cpp_extension compiles, for the wheel's torch: C++17 before torch 2.10, C++20 since; -O1 for speed.
    standard = "-std=c++17" if wheel_torch_version(root) < (2, 10) else "-std=c++20"
    flags = [standard, "-fPIC", *(f for f in _sources.CXX_FLAGS if not f.startswith("-O")), "-O1",
             "-isystem", str(include), "-isystem", str(include / "torch" / "csrc" / "api" / "include"),
             "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=deform_conv_cpu_aarch64",
             f"-D_GLIBCXX_USE_CXX11_ABI={wheel_cxx11_abi(root)}"]
    sources = [Path(s) for s in _sources.write_units("cpu", str(_variant.CSRC), str(tmp_path))]
    objects = [tmp_path / (s.stem + ".o") for s in sources]

    def compile_one(source: Path, obj: Path) -> Optional[str]:
        done = subprocess.run([cxx, *flags, "-c", str(source), "-o", str(obj)], capture_output=True, text=True)
        return None if done.returncode == 0 else f"{source.name}:\n{done.stderr[-6000:]}"

    started = time.perf_counter()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(cores, len(sources)))) as pool:
        errors = [e for e in pool.map(compile_one, sources, objects) if e is not None]
    compile_seconds = time.perf_counter() - started
    assert not errors, f"{len(errors)} of the CPU sources do not compile for aarch64 ({cxx} {' '.join(flags)}):\n" + \
        "\n".join(errors)

    libraries = ["-L" + str(torch_lib), "-lc10", "-ltorch_cpu", "-ltorch",
                 f"-Wl,-rpath-link,{torch_lib}:{torch_libs}"]  # (libtorch_cpu's own NEEDED, for the linker)

    def link(name: str, link_flags: List[str]) -> Path:
        library = tmp_path / name
        done = subprocess.run([cxx, *map(str, objects), "-shared", *link_flags, *libraries, "-o", str(library)],
                              capture_output=True, text=True)
        assert done.returncode == 0, f"linking {name} with {link_flags} failed:\n{done.stderr}"
        assert elf_machine(library) == EM_AARCH64, f"{name} is not an aarch64 ELF file"
        return library

    # What the loader links: the runtime torch loaded, here the wheel's, which an aarch64 torch would load.
    monkeypatch.setattr(_toolchain, "torch_openmp_runtime", lambda: runtime)
    cxx_version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    link_flags = _compile.link_flags(_variant.Variant("cpu"), cxx_version)
    needed = assert_needs_only_runtime(link("deform_conv_cpu_aarch64.so", link_flags), runtime_soname)
    assert "libgomp.so.1" not in needed, f"link_flags gave {link_flags}"

    # The control: the same objects with -fopenmp's runtime, the hazard link_flags avoids. The check above would
    # fail on it.
    control_needed, _ = dynamic_section(link("control_fopenmp.so", list(_variant.Variant("cpu").ld_flags)))
    assert "libgomp.so.1" in control_needed and runtime_soname not in control_needed, control_needed
    print(f"\n{wheel.name}: extracted in {extract_seconds:.1f} s, {len(sources)} sources compiled in "
          f"{compile_seconds:.1f} s ({standard}); NEEDED {needed}; control NEEDED {control_needed}")


# --- a Clang build ----------------------------------------------------------------------------------------------

CLANG_PROBE = """
import os, torch
torch.set_num_threads(2)
a = torch.randn(512, 512); (a @ a).sum()  # torch's own pool is up
import deform_conv
x, w = torch.randn(4, 32, 24, 24, requires_grad=True), torch.randn(32, 32, 3, 3, requires_grad=True)
o, m = torch.randn(4, 18, 24, 24, requires_grad=True), torch.rand(4, 9, 24, 24, requires_grad=True)
deform_conv.deform_conv2d(x, o, w, padding=1, mask=m).sum().backward()  # warm-up: the library's runtime starts
before = len(os.listdir("/proc/self/task"))
for _ in range(3):
    deform_conv.deform_conv2d(x, o, w, padding=1, mask=m).sum().backward()
print(deform_conv.libraries[0].path, len(os.listdir("/proc/self/task")) - before)
"""


@needs_linux
@pytest.mark.skipif(shutil.which("clang++") is None, reason="needs clang++ with LLVM's OpenMP (Debian: clang libomp-dev)")
def test_a_clang_build_follows_torchs_thread_count(tmp_path):
    """Clang cannot emit libgomp's calls, so its build runs on LLVM's runtime, whose own default team is as large as
    OMP_NUM_THREADS says (6 here). After torch.set_num_threads(2) the library's loops must use 2 threads: one
    worker of LLVM's runtime at most. (Without following torch's count this process gained 5 threads.) The build
    takes about two minutes."""
    from helpers.loader import child_env

    env = child_env(tmp_path, CXX="clang++", OMP_NUM_THREADS="6")
    result = subprocess.run([sys.executable, "-c", CLANG_PROBE], capture_output=True, text=True, env=env, timeout=900)
    if result.returncode != 0 and "omp.h" in result.stderr:
        pytest.skip("clang++ has no OpenMP headers here (Debian: libomp-dev)")
    assert result.returncode == 0, result.stderr[-3000:]
    library, new_threads = result.stdout.split()
    assert "libomp" in " ".join(dynamic_section(Path(library))[0])  # it is the Clang build
    assert int(new_threads) <= 1, f"the Clang build's loops started {new_threads} threads after 2 were asked for"
