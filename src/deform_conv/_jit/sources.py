"""What each kernel library is compiled from and with: the one list shared by the JIT loader (compile.py)
and the opt-in ahead-of-time build (setup.py). Plain data, no imports, so setup.py can read it by path."""

CSRC_DIR = "csrc"  # relative to the package directory

# Each op's sources live under csrc/<op>/; what they share (the schemas, the sampling math, the CUDA execution
# layer and its simulation) directly under csrc/.
_DEFORM_CONV2D = "deform_conv2d/"
_MS_DEFORM_ATTN = "ms_deform_attn/"

# The CPU library holds every schema (ops.cpp) and the CPU kernels.
CPU_SOURCES = (
    "ops.cpp",
    *(_DEFORM_CONV2D + name for name in (
        "conv_params.cpp", "columns_driver.cpp", "cpu/sampling_passes.cpp", "cpu/scratch.cpp", "cpu/depthwise.cpp",
        "cpu/transpose.cpp", "cpu/brgemm.cpp", "cpu/half_conversion.cpp", "cpu/half_gemm.cpp", "cpu/tiled_forward.cpp",
        "cpu/deform_conv_cpu.cpp")),
    *(_MS_DEFORM_ATTN + name for name in ("attention_params.cpp", "cpu/ms_deform_attn_cpu.cpp")),
)

# The CUDA library holds only CUDA kernels; it is loaded after the CPU library, whose schemas it implements.
# The device-independent sources are compiled into both: libraries are loaded with local symbol visibility.
CUDA_SOURCES = (
    *(_DEFORM_CONV2D + name for name in ("conv_params.cpp", "columns_driver.cpp", "cuda/deform_conv_cuda.cu")),
    *(_MS_DEFORM_ATTN + name for name in ("attention_params.cpp", "cuda/ms_deform_attn_cuda.cu")),
)

# The CUDA simulation, for the tests only (deform_conv.testing.load_cuda_simulation): the CUDA kernels' source
# compiled by the host compiler against cuda_simulation/simt.h, registered as torch.ops.deform_conv_sim.*.
CUDA_SIMULATION_SOURCES = (
    *(_DEFORM_CONV2D + name for name in ("conv_params.cpp", "columns_driver.cpp")),
    _MS_DEFORM_ATTN + "attention_params.cpp",
    "cuda_simulation/simt.cpp", "cuda_simulation/deform_conv2d_kernels.cpp", "cuda_simulation/ms_deform_attn_kernels.cpp",
)

# -fopenmp makes at::parallel_for use threads (its OpenMP backend is header code compiled into the library). With
# GCC the link names the OpenMP runtime torch loaded instead of -fopenmp's -lgomp (compile.link_flags), so
# that the library uses torch's runtime and thread count.
# --as-needed drops the libraries cpp_extension always lists but the library does not use (libtorch_python
# among them, which would tie it to one Python version).
# -ffp-contract=off: no multiply-add is fused behind our back. GCC otherwise fuses in some of the code paths it
# generates for one loop (vector body, remainder, the copy taken when pointers may overlap) and not in others,
# so which path runs -- decided by where the heap put a buffer -- changed the last bit of a result from one call
# to the next.
CXX_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
LD_FLAGS = ("-fopenmp", "-Wl,--as-needed")
# No --use_fast_math: it changes results (division, denormals) and NaN handling. -Xptxas=-v: ptxas reports each
# kernel's registers, stack frame and spills in build.log (the tests check that no kernel uses local memory).
NVCC_FLAGS = ("-O3", "-lineinfo", "-Xptxas=-v")
# DEFORM_CONV_SANITIZE (CPU library only, after -fsanitize=...; -O1 replaces -O3): stop at the first report so
# that a test run fails, and keep frames and line numbers in the reports.
SANITIZE_CXX_FLAGS = ("-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1")
