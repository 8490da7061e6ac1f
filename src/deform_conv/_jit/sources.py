"""What each kernel library is compiled from and with: the one list shared by the JIT loader (compile.py)
and the opt-in ahead-of-time build (setup.py). Plain data and the standard library only, so setup.py can read it
by path.

A library is compiled as a few translation units ("units"), each the sources of one concern of one op (or of a
group of ops that take the same headers: UNIT_GROUPS) included one after another. torch's headers, not our code,
dominate the compile (a unit holding nothing but <ATen/ATen.h> and <torch/library.h> takes 6.8 s on a 2-core Xeon,
and nvcc parses a header several times), so they are parsed once a unit instead of once a file. In the CPU library
the registration (torch/library.h) and every op's host code (which calls torch's operators: their headers cost
seconds) share one unit; the kernels see ATen/core/Tensor.h (its methods create their outputs) and the few ATen
functions they call, the CUDA kernels no torch header beyond c10's Half and BFloat16. A unit's sources share one
translation unit, so their file-local names must differ.

Each op lives in csrc/<op>/ and is found there by convention:
  csrc/<op>/*.cpp         host code of every backend (sizes, checks, the device-independent driver)
  csrc/<op>/cpu/*.cpp     its CPU kernels
  csrc/<op>/cuda/*.cpp    its CUDA backend's host code (tensors, dispatch, launches), compiled by the host compiler
  csrc/<op>/cuda/*.cu     its CUDA kernels
"""

import os

CSRC_DIR = "csrc"  # relative to the package directory

# The ops, each a folder csrc/<op>/ laid out as above; adding an op is adding its folder and its name here (and its
# schema in csrc/schemas.h, registered in ops.cpp and cuda/impl_ops.h).
OPS = ("deform_conv2d", "ms_deform_attn", "dcnv3", "dcnv4", "flash_deform_attn")

# Folders compiled together, as one unit per library and kind (named after the group), because they take the same
# headers: a unit's headers cost seconds, its own code little. csrc/sampled_sum/ holds the kernels DCNv3, DCNv4 and
# FlashDeformAttn share, laid out as an op's folder; those ops have no kernels of their own (their host code,
# csrc/<op>/*.cpp, is written once for every backend), and multi-scale deformable attention's CPU backend runs on
# them too (its CUDA kernels are its own). Their file-local names must differ.
UNIT_GROUPS = {"attention": ("sampled_sum", "ms_deform_attn", "dcnv3", "dcnv4", "flash_deform_attn")}

# Sources of an op's CPU kernels compiled as a unit of their own (<op>_cpu_sampling), apart from the op's other
# CPU sources: code generation, not headers, is what these cost (their loops are compiled for each dtype, and in
# the portable library for three instruction sets). The split keeps both cores of a 2-core machine busy to the
# end: this unit and the registration on one, the attention kernels and the op's other CPU sources on the other,
# about equal (benchmarks/results/loader.md has each unit's time).
CPU_SAMPLING_UNITS = {
    "deform_conv2d": (
        "cpu/sampling_passes.cpp", "cpu/depthwise.cpp", "cpu/transpose.cpp", "cpu/tiled_forward.cpp",
        "cpu/half_conversion.cpp",
    ),
}

# The registration units: the only ones that include torch/library.h. The CPU library's goes with every op's host
# code; the CUDA library's with what its host code asks of CUDA (cuda/host.cpp: the current stream, the launch
# check); the simulation's with its execution layer.
CPU_REGISTRATION = "ops.cpp"
CUDA_REGISTRATION = ("ops_cuda.cpp", "cuda/host.cpp")
SIMULATION_LAYER = ("cuda_simulation/ops_sim.cpp", "cuda_simulation/simt.cpp")

# -fopenmp makes at::parallel_for use threads (its OpenMP backend is header code compiled into the library). With
# GCC the link names the OpenMP runtime torch loaded instead of -fopenmp's -lgomp (compile.link_flags), so
# that the library uses torch's runtime and thread count.
# --as-needed drops the libraries cpp_extension always lists but the library does not use (libtorch_python
# among them, which would tie it to one Python version).
# -ffp-contract=off: no multiply-add is fused behind our back. GCC otherwise fuses in some of the code paths it
# generates for one loop (vector body, remainder, the copy taken when pointers may overlap) and not in others,
# so which path runs -- decided by where the heap put a buffer -- changed the last bit of a result from one call
# to the next.
# -fno-trapping-math: the kernels' loops that select on float comparisons are vectorised (and floor, and the
# conversions of the sampling coordinates) only where floating-point operations are not assumed to trap; a
# comparison with NaN raises an exception flag, which nothing here reads. It changes no value. As a flag of the
# whole library, not a per-function attribute: GCC does not inline a function into one compiled with other
# optimisation options, so an attribute would have to sit on every function of a kernel down to sampling.h's.
CXX_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math")
# GCC's only (compile.compiler_flags adds them where the compiler is GCC): no vectorised copy of a vectorised
# loop's remainder, only the scalar one. It cuts the kernels' code by an eighth and the CPU library's cold build
# by about 3 s of 20 on a 2-core Xeon, with no measurable change in their speed (their channel loops are
# multiples of the vector width in the models they serve; benchmarks/results/loader.md) and none in any result:
# a remainder is computed element by element either way, and an omp simd reduction adds it after the vector
# partial sums either way.
GCC_CXX_FLAGS = ("--param=vect-epilogues-nomask=0",)
LD_FLAGS = ("-fopenmp", "-Wl,--as-needed")
# No --use_fast_math: it changes results (division, denormals) and NaN handling. -Xptxas=-v: ptxas reports each
# kernel's registers, stack frame and spills in build.log (the tests check that no kernel uses local memory).
NVCC_FLAGS = ("-O3", "-lineinfo", "-Xptxas=-v")
# DEFORM_CONV_SANITIZE (CPU library only, after -fsanitize=...; -O1 replaces -O3): stop at the first report so
# that a test run fails, and keep frames and line numbers in the reports.
SANITIZE_CXX_FLAGS = ("-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1")


def _listed(csrc, folder, suffix):
    """csrc/<folder>/*<suffix>, relative to csrc and sorted (empty when the folder does not exist)."""
    directory = os.path.join(csrc, folder)
    if not os.path.isdir(directory):
        return ()
    return tuple(f"{folder}/{name}" for name in sorted(os.listdir(directory)) if name.endswith(suffix))


def _unit_folders():
    """{unit prefix: the folders of csrc/ compiled in its units}: an op on its own, or a group (UNIT_GROUPS)."""
    grouped = {folder for folders in UNIT_GROUPS.values() for folder in folders}
    folders = {op: (op,) for op in OPS if op not in grouped}
    folders.update(UNIT_GROUPS)
    return folders


def _sources(csrc, folders, subfolder, suffix):
    """The sources of `folders` in csrc/<folder>/ (subfolder None) or csrc/<folder>/<subfolder>/, in that order."""
    found = ()
    for folder in folders:
        found += _listed(csrc, folder if subfolder is None else f"{folder}/{subfolder}", suffix)
    return found


def units(kind, csrc):
    """The translation units of library ``kind`` ("cpu", "cuda" or "cuda_simulation"): {unit name: sources
    relative to ``csrc``}, in the order ninja is to start them (see each kind below); no unit without sources."""
    folders = _unit_folders()
    if kind == "cpu":
        # ninja starts the units in this order, two at a time on two cores: first the code generation (the
        # groups' kernels, several ops' each, a long unit; then the sampling units), then the registration
        # with every op's host code (the code that calls torch's operators and so takes their headers, seconds of
        # every unit that includes them, which the kernels' units need not include), then the other kernels,
        # which fill the gaps (benchmarks/results/loader.md has each unit's time).
        generated, rest = {}, {}
        for prefix, fs in sorted(folders.items(), key=lambda item: item[0] not in UNIT_GROUPS):
            apart = tuple(f"{prefix}/{name}" for name in CPU_SAMPLING_UNITS.get(prefix, ()))
            kernels = tuple(s for s in _sources(csrc, fs, "cpu", ".cpp") if s not in apart)
            if apart:
                generated[f"{prefix}_cpu_sampling"] = apart
            (generated if prefix in UNIT_GROUPS else rest)[f"{prefix}_cpu"] = kernels
        every_folder = tuple(folder for fs in folders.values() for folder in fs)
        registration = {"ops": (CPU_REGISTRATION,) + _sources(csrc, every_folder, None, ".cpp")}
        return {name: sources for name, sources in {**generated, **registration, **rest}.items() if sources}
    if kind in ("cuda", "cuda_simulation"):
        # Each op's CUDA kernels (.cu) and its CUDA host code as it is, with the library's registration. The
        # simulation compiles the kernels with the host compiler against its execution layer (unit_text defines
        # DEFORM_CONV_CUDA_SIMULATION for them), which registers them into deform_conv_sim (cuda_simulation/).
        simulated = kind == "cuda_simulation"
        kernels, host = ("_simulated_kernels", "_simulated_host") if simulated else ("_kernels", "_cuda")
        found = {prefix + kernels: _sources(csrc, fs, "cuda", ".cu") for prefix, fs in folders.items()}
        found["simulation" if simulated else "ops_cuda"] = SIMULATION_LAYER if simulated else CUDA_REGISTRATION
        for prefix, fs in folders.items():
            found[prefix + host] = _sources(csrc, fs, None, ".cpp") + _sources(csrc, fs, "cuda", ".cpp")
        return {name: sources for name, sources in found.items() if sources}
    raise ValueError(f"unknown library kind {kind!r}")


def unit_inputs(kind, name, sources, csrc):
    """Every file under ``csrc`` that unit ``name`` may read: its sources and every header (a unit may include any
    header, its op's, the shared ones, or through the registration another op's). A change to anything else --
    another unit's sources -- cannot change what it compiles to, so an incremental build reuses its object."""
    headers = []
    for directory, _folders, files in os.walk(csrc):
        folder = os.path.relpath(directory, csrc).replace(os.sep, "/")
        headers += [f if folder == "." else f"{folder}/{f}" for f in files if f.endswith((".h", ".cuh"))]
    return tuple(sorted(set(sources) | set(headers)))


def unit_text(kind, sources, csrc):
    """The source of a unit: its sources included one after another, by absolute path (their own relative
    includes resolve from their directories). The simulation compiles the CUDA kernels (.cu) as host C++ against
    its execution layer (cuda/execution.cuh then includes cuda_simulation/simt.h)."""
    simulated = kind == "cuda_simulation" and any(s.endswith(".cu") for s in sources)
    define = "#define DEFORM_CONV_CUDA_SIMULATION 1\n" if simulated else ""
    includes = "".join(f'#include "{os.path.join(os.path.abspath(csrc), s)}"\n' for s in sources)
    return f"// deform_conv {kind} unit, generated by deform_conv/_jit/sources.py: do not edit\n{define}{includes}"


def unit_suffix(kind, sources):
    """.cu for a unit of CUDA kernels (compiled by nvcc), .cpp otherwise (the host compiler)."""
    return ".cu" if kind == "cuda" and any(s.endswith(".cu") for s in sources) else ".cpp"


def unit_file_name(kind, name, sources, csrc):
    """<unit>-<hash of its text>.cpp (or .cu): named by its content, so that a unit's path -- which the compile
    command names, and ninja compares commands -- stays the same from one build to the next while the unit does.
    Its object is <unit>-<hash>.o (.cuda.o for .cu)."""
    import hashlib

    digest = hashlib.sha256(unit_text(kind, sources, csrc).encode()).hexdigest()[:12]
    return f"{name}-{digest}{unit_suffix(kind, sources)}"


def write_units(kind, csrc, directory):
    """Writes library ``kind``'s units into ``directory`` (a directory of ours) and returns their paths, in build
    order. A unit file already there with the right text is left alone (its mtime tells ninja nothing changed);
    anything else at its name is replaced by a rename, never written through."""
    import tempfile

    paths = []
    for name, sources in units(kind, csrc).items():
        path = os.path.join(directory, unit_file_name(kind, name, sources, csrc))
        text = unit_text(kind, sources, csrc)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as existing:
                st = os.fstat(existing.fileno())
                unchanged = (existing.read() == text and st.st_uid == os.geteuid() and not st.st_mode & 0o022)
        except (OSError, UnicodeDecodeError):
            unchanged = False
        if not unchanged:
            fd, temporary = tempfile.mkstemp(prefix=".unit-", dir=directory)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(temporary, path)
        paths.append(path)
    return paths
