"""What the CPU library is compiled for: an import builds it for this CPU's widest instruction set; the portable
library holds a copy for each; a library is never loaded on a CPU without its instruction set."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys

import pytest
import torch

import deform_conv
from deform_conv._jit import variant as _variant

from helpers.loader import child_env, fast_compiler, run_python

REPORT = "import deform_conv; lib = deform_conv.libraries[0]; print(lib.variant.cpu_isa, lib.from_cache)"
# What torch reports of the CPU (host_cpu_isa reads it), replaced in a child to play a narrower CPU.
PLAY = "import torch; torch.cpu.get_capabilities = lambda: {features!r}\n"


def test_stand_ins_are_the_portable_library_then_narrower_ones_where_nothing_can_be_built():
    avx2 = _variant.Variant("cpu", cpu_isa="avx2")
    assert [v.cpu_isa for v in avx2.stand_ins(buildable=True)] == ["portable"]
    assert [v.cpu_isa for v in avx2.stand_ins(buildable=False)] == ["portable", "x86-64"]
    widest = _variant.Variant("cpu", sanitize=("address",), cpu_isa="avx512f")
    assert widest.stand_ins(buildable=False) == tuple(
        _variant.Variant("cpu", sanitize=("address",), cpu_isa=isa) for isa in ("portable", "avx2", "x86-64"))
    bf16 = _variant.Variant("cpu", cpu_isa="avx512bf16")
    assert [v.cpu_isa for v in bf16.stand_ins(buildable=False)] == ["portable", "avx512f", "avx2", "x86-64"]
    assert _variant.Variant("cpu").stand_ins(buildable=False) == ()
    assert _variant.Variant("cuda", ("9.0",)).stand_ins(buildable=False) == ()


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux",
                    reason="CPU libraries per instruction set are built on x86-64 Linux only")
def test_an_import_builds_for_the_widest_instruction_set_the_cpu_has(monkeypatch):
    avx512 = {"avx2", "avx512_f", "avx512_bw", "avx512_dq", "avx512_vl"}
    cpus = {"x86-64": set(), "avx2": {"avx2"}, "avx512f": avx512, "avx512bf16": avx512 | {"avx512_bf16"}}
    for expected, features in cpus.items():
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda features=features: dict.fromkeys(features, True),
                            raising=False)
        assert _variant.host_cpu_isa() == expected
        assert _variant.portable_copy(expected) == ("avx512f" if expected == "avx512bf16" else expected)
    # AVX512-BF16 without the subsets the tier's code also uses: plain avx512f.
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: dict.fromkeys({"avx2", "avx512_f", "avx512_bf16"}, True),
                        raising=False)
    assert _variant.host_cpu_isa() == "avx512f"


def test_each_instruction_set_is_an_entry_of_its_own_named_by_it():
    isas = ("portable", "avx512bf16", "avx512f", "avx2", "x86-64")
    flags = {isa: _variant.Variant("cpu", cpu_isa=isa).cxx_flags for isa in isas}
    assert not any("DC_CPU_VECTOR_BITS" in flag for flag in flags["portable"])
    assert "-DDC_CPU_VECTOR_BITS=512" in flags["avx512f"] and "-DDC_CPU_VECTOR_BITS=128" in flags["x86-64"]
    assert "-DDC_CPU_AVX512_BF16" in flags["avx512bf16"] and "-DDC_CPU_AVX512_BF16" not in flags["avx512f"]
    assert len(set(flags.values())) == len(isas)  # the key records the flags: a key each
    assert _variant.Variant("cpu", cpu_isa="x86-64").tag == "cpu-x86_64"
    assert _variant.Variant("cpu", sanitize=("address",), cpu_isa="avx2").tag == "cpu-avx2-sanitize_address"
    assert _variant.ENTRY_NAME.match("cpu-x86_64-torch2.14.1_cu130-c2d32b4c387d-173d03c9")


@pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux",
                    reason="CPU libraries per instruction set are built on x86-64 Linux only")
def test_a_library_loads_on_cpus_with_its_instruction_set_only(tmp_path):
    """One machine plays a baseline x86-64 CPU and an AVX2 one (what torch reports of the CPU is replaced in the
    child). The objects are this session's (fast_compiler): what is checked is which entry the loader takes."""
    cache = tmp_path / "cache"
    fast, none = str(fast_compiler(tmp_path / "tools")), str(tmp_path / "no-compiler")
    cpus = {"baseline": {"sse2": True}, "avx2": {"sse2": True, "avx2": True}}

    def imports(cpu: str, compiler: str) -> subprocess.CompletedProcess:
        return run_python(PLAY.format(features=cpus[cpu]) + REPORT, child_env(cache, CXX=compiler))

    baseline = imports("baseline", fast)  # a baseline CPU builds its own
    assert baseline.stdout.split() == ["x86-64", "False"], baseline.stderr
    borrowed = imports("avx2", none)  # an AVX2 CPU that cannot build loads it: slower, but it runs
    assert borrowed.stdout.split() == ["x86-64", "True"], borrowed.stderr
    own = imports("avx2", fast)  # where it can build, it builds its own
    assert own.stdout.split() == ["avx2", "False"], own.stderr
    for entry in cache.glob("cpu-x86_64-*"):
        shutil.rmtree(entry)
    wider = imports("baseline", none)  # the AVX2 entry is there, but a baseline CPU must not run it
    assert wider.returncode != 0 and "no C++ compiler found" in wider.stderr, wider.stdout + wider.stderr
    assert "built with `deform-conv build --portable`" in wider.stderr  # the way out, named
    portable = subprocess.run([sys.executable, "-m", "deform_conv", "build", "--cpu-only", "--portable"],
                              capture_output=True, text=True, env=child_env(cache, CXX=fast), timeout=600)
    assert portable.returncode == 0 and "compiling the CPU kernels" in portable.stderr, portable.stderr
    for compiler in (none, fast):  # it runs as fast as an own build: loaded even where one could be built
        stand_in = imports("baseline", compiler)
        assert stand_in.stdout.split() == ["portable", "True"], stand_in.stderr


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="the CPU passes are compiled per instruction set on x86-64 only; needs objdump")
def test_wide_copies_of_the_cpu_passes_hold_their_inner_loops():
    # The library an import builds compiles each pass once, for this CPU's widest vectors; the portable one three
    # times (target_clones), and there its AVX-512 copy is checked. Were a helper kept out of line, its loops would
    # be compiled for baseline x86-64 and the wide copy would only call it: it would then use no wide register.
    cpu = next(lib for lib in deform_conv.libraries if lib.variant.kind == "cpu")
    if cpu.variant.sanitize:
        pytest.skip("a sanitizer build")
    isa = cpu.variant.cpu_isa
    register = {"avx512bf16": "zmm", "avx512f": "zmm", "avx2": "ymm", _variant.PORTABLE: "zmm"}.get(isa)
    if register is None:
        pytest.skip(f"built for {isa}: no wider registers than baseline x86-64's")
    suffix = "[clone .avx512f]" if isa == _variant.PORTABLE else ""
    library = cpu.path
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(library)], capture_output=True,
                             text=True, check=True).stdout
    bodies: dict = {}
    current = None
    for line in listing.splitlines():
        if line.endswith(">:"):  # "0000000000012340 <symbol>:" starts a function
            symbol = line.split("<", 1)[1][:-2]
            current = symbol if suffix in symbol else None  # (GCC's own clones, e.g. ".isra.0", keep the ISA)
            continue
        if current is not None:
            bodies.setdefault(current, []).append(line)
    if not bodies:
        pytest.skip("no per-instruction-set copies in this build (not GCC on x86-64 Linux)")
    # (DC_CPU_KERNEL: the wide copies are <pass>_wide<float, ...>.)
    passes = ("fill_rows_wide<float", "coordinate_rows_wide<float", "input_grad_tasks_wide<float",
              "forward_rows_wide<float", "sum_rows_wide<float", "sum_backward_tasks_wide<float")
    for name in passes:
        copies = [body for symbol, body in bodies.items() if name in symbol]
        assert copies, f"no {isa} copy of {name} in {library}"
        assert any(register in line for body in copies for line in body), f"the {isa} copy of {name} uses no {register}"
