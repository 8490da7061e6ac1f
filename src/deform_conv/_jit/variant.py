"""What a library is built from and for: the variants (CPU, CUDA for some archs), their key inputs and the
names of their cache entries. An entry's name is derived from everything that makes two builds differ, so
nothing stale is ever loaded."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import re
import sys
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from . import settings as _settings, sources as _sources
from .._version import __version__

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # deform_conv/, the folder above _jit/
CSRC = PACKAGE_DIR / _sources.CSRC_DIR

# <tag>-torch<version>-<environment hash>-<toolchain hash>, e.g. cpu-avx512f-torch2.14.1_cu130-c2d32b4c387d-173d03c9
ENTRY_NAME = re.compile(r"^(cpu|cuda|cuda_simulation)[-\w.]*-torch[\w.+]+-[0-9a-f]{12}-[0-9a-f]{8}$")


# The instruction sets a CPU library's kernels are compiled for (csrc/cpu_kernels.h), widest first, each with the
# flags that select it, and the portable library, which holds a copy for x86-64, avx2 and avx512f and picks one when
# it is loaded. avx512bf16 is avx512f's vectors with the instruction that rounds 16 floats to bfloat16 at once
# (cpu_lanes.h): the same bits, a third fewer instructions where the bfloat16 passes write their columns.
CPU_ISA_FLAGS = {
    "avx512bf16": ("-DDC_CPU_VECTOR_BITS=512", "-DDC_CPU_AVX512_BF16"),
    "avx512f": ("-DDC_CPU_VECTOR_BITS=512",),
    "avx2": ("-DDC_CPU_VECTOR_BITS=256",),
    "x86-64": ("-DDC_CPU_VECTOR_BITS=128",),
}
PORTABLE = "portable"


def portable_copy(isa: str) -> str:
    """The portable library's copy a CPU whose widest instruction set is ``isa`` runs."""
    return "avx512f" if isa == "avx512bf16" else isa


def host_cpu_isa() -> str:
    """The instruction set ``import deform_conv`` compiles the CPU kernels for: the widest of CPU_ISA_FLAGS this
    CPU has, by the tests the portable library's loader-time choice makes (GCC's resolver asks for avx512f, then
    avx2; avx512bf16 asks for AVX512-BF16, and for BW, DQ and VL, which every such CPU has), so that a machine gets the same
    bits from either library. The kernels are compiled per instruction set on x86-64 Linux (csrc/cpu_kernels.h);
    elsewhere the one build is the portable one."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return PORTABLE
    if hasattr(torch.cpu, "get_capabilities"):  # torch >= 2.13: the CPU's own features (cpuinfo)
        has = torch.cpu.get_capabilities()
        features = {name for name in ("avx2", "avx512_f", "avx512_bw", "avx512_dq", "avx512_vl", "avx512_bf16")
                    if has.get(name)}
    else:  # the kernel's list of them, named as cpuinfo names them
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
        features = {"avx512_" + flag[6:] if flag.startswith("avx512") and not flag.startswith("avx512_") else flag
                    for flag in flags}
    if "avx512_f" not in features:
        return "avx2" if "avx2" in features else "x86-64"
    bf16 = {"avx512_bw", "avx512_dq", "avx512_vl", "avx512_bf16"} <= features
    return "avx512bf16" if bf16 else "avx512f"


@dataclasses.dataclass(frozen=True)
class Variant:
    """One library: the CPU one (every schema + CPU kernels), the CUDA one for a list of GPU archs, or the CUDA
    simulation (the CUDA kernels run on the CPU; tests only, never loaded by ``import deform_conv``)."""

    kind: str                          # "cpu", "cuda" or "cuda_simulation"
    cuda_archs: Tuple[str, ...] = ()   # TORCH_CUDA_ARCH_LIST entries, e.g. ("8.0", "9.0+PTX")
    sanitize: Tuple[str, ...] = ()     # host-compiled only: -fsanitize= names from $DEFORM_CONV_SANITIZE
    cpu_isa: str = PORTABLE            # "cpu" only: a key of CPU_ISA_FLAGS, or PORTABLE

    @property
    def units(self) -> Dict[str, Tuple[str, ...]]:
        """{translation unit: its sources relative to csrc/} (_sources.units)."""
        return _sources.units(self.kind, str(CSRC))

    @property
    def cxx_flags(self) -> Tuple[str, ...]:
        """The one place flags are chosen (the key records what this returns). Sanitized: -O1 instead of -O3,
        as ASan's docs advise: usable speed, with reports whose frames and lines match the source."""
        isa = () if self.cpu_isa == PORTABLE else CPU_ISA_FLAGS[self.cpu_isa]
        if not self.sanitize:
            return _sources.CXX_FLAGS + isa
        plain = tuple(f for f in _sources.CXX_FLAGS if not f.startswith("-O"))
        return plain + ("-fsanitize=" + ",".join(self.sanitize),) + _sources.SANITIZE_CXX_FLAGS + isa

    @property
    def ld_flags(self) -> Tuple[str, ...]:
        return _sources.LD_FLAGS + (("-fsanitize=" + ",".join(self.sanitize),) if self.sanitize else ())

    @property
    def label(self) -> str:
        sanitized = f" (-fsanitize={','.join(self.sanitize)})" if self.sanitize else ""
        if self.kind == "cpu":
            return "CPU kernels" + sanitized
        if self.kind == "cuda_simulation":
            return "CUDA simulation" + sanitized
        return "CUDA kernels for " + ", ".join("sm_" + a.replace(".", "") for a in self.cuda_archs)

    @property
    def tag(self) -> str:
        if self.kind != "cuda":
            isa = "" if self.cpu_isa == PORTABLE else "-" + self.cpu_isa.replace("-", "_")
            return self.kind + isa + ("-sanitize_" + "_".join(self.sanitize) if self.sanitize else "")
        return "cuda-" + "_".join("sm" + a.replace(".", "").replace("+PTX", "ptx") for a in self.cuda_archs)


    def stand_ins(self, buildable: bool) -> Tuple["Variant", ...]:
        """The CPU libraries that may be loaded in this one's place, best first: the portable library, which runs
        as fast (it holds a copy for this CPU's instruction set too); and where nothing can be built here, the
        libraries compiled for narrower instruction sets than this CPU's, slower but better than none. Never one
        for an instruction set this CPU lacks."""
        if self.kind != "cpu" or self.cpu_isa == PORTABLE:
            return ()
        narrower = list(CPU_ISA_FLAGS)[list(CPU_ISA_FLAGS).index(self.cpu_isa) + 1:]
        isas = [PORTABLE] + ([] if buildable else narrower)
        return tuple(dataclasses.replace(self, cpu_isa=isa) for isa in isas)


def sources_sha256() -> str:
    """One hash over every source and header under csrc/ (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.suffix in {".h", ".cuh", ".cpp", ".cu"}):
        digest.update(path.relative_to(CSRC).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment_inputs(variant: Variant, sources: Optional[str] = None) -> Dict[str, object]:
    """The key inputs known without running any tool: what the library is built from and for (``sources``:
    sources_sha256(), where the caller has it already)."""
    inputs: Dict[str, object] = {
        "variant": variant.kind,
        "package_version": __version__,
        "sources_sha256": sources or sources_sha256(),
        "units": {name: list(sources) for name, sources in variant.units.items()},
        "cxx_flags": list(variant.cxx_flags),
        "gcc_cxx_flags": list(_sources.GCC_CXX_FLAGS),  # added where the compiler (in the key too) is GCC
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


def _hash_of(inputs: Dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def entry_prefix(variant: Variant, environment: Dict[str, object]) -> str:
    torch_tag = str(environment["torch_version"]).replace("+", "_")
    return f"{variant.tag}-torch{torch_tag}-{_hash_of(environment)[:12]}"


def entry_name(variant: Variant, environment: Dict[str, object], tools: Dict[str, str]) -> str:
    """Readable prefix, then a hash of the environment inputs and one of the toolchain."""
    return f"{entry_prefix(variant, environment)}-{_hash_of(tools)[:8]}"


def requested_cuda_archs(explicit: Optional[str] = None) -> Tuple[str, ...]:
    """GPU archs to build the CUDA library for: ``explicit`` (the CLI's --cuda-arch) or $TORCH_CUDA_ARCH_LIST
    when given, else the archs of the visible GPUs, else none. Without a CUDA build of torch, none; without
    a list and without a GPU, CUDA is not initialised (device_count does not create a context); with a GPU,
    reading its compute capability initialises CUDA in this process. DEFORM_CONV_CUDA=0 asks for none."""
    if torch.version.cuda is None:
        return ()
    if explicit is None and not _settings.cuda_wanted():
        return ()  # the user's opt-out: CPU kernels only, e.g. on a GPU machine without the CUDA toolkit
    listed = _settings.cuda_archs(explicit, "--cuda-arch" if explicit is not None else "TORCH_CUDA_ARCH_LIST")
    if listed:
        return listed
    count = torch.cuda.device_count()
    return tuple(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(count)}))


def cpu_variant(portable: bool = False) -> Variant:
    """The CPU library an import builds: for this CPU's instruction set, or ``portable`` (`deform-conv build
    --portable`) for every x86-64 CPU."""
    return Variant("cpu", sanitize=_settings.sanitizers(), cpu_isa=PORTABLE if portable else host_cpu_isa())


def wanted_variants() -> Tuple[Variant, ...]:
    """The CPU library (instrumented if $DEFORM_CONV_SANITIZE says so), then the CUDA library when
    :func:`requested_cuda_archs` asks for one."""
    archs = requested_cuda_archs()
    return (cpu_variant(),) + ((Variant("cuda", archs),) if archs else ())


def unit_file_name(variant: Variant, unit: str) -> str:
    """The file name of ``unit``'s generated source (and, less its suffix, of its object)."""
    return _sources.unit_file_name(variant.kind, unit, variant.units[unit], str(CSRC))


def unit_of(file_name: str) -> str:
    """The unit a generated source or object belongs to: <unit>-<hash>.<suffix>."""
    return file_name.split(".")[0].rsplit("-", 1)[0]


def unit_sha256(variant: Variant) -> Dict[str, str]:
    """{unit: a hash of its text and of every file it may read} (_sources.unit_inputs). A later build of other
    sources reuses the object of a unit whose hash is unchanged, and compiles the others."""
    hashes = {}
    for name, sources in variant.units.items():
        digest = hashlib.sha256(_sources.unit_text(variant.kind, sources, str(CSRC)).encode() + b"\0")
        for path in _sources.unit_inputs(variant.kind, name, sources, str(CSRC)):
            digest.update(path.encode() + b"\0" + (CSRC / path).read_bytes() + b"\0")
        hashes[name] = digest.hexdigest()
    return hashes
