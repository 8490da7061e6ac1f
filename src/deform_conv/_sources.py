"""What each kernel library is compiled from and with: the one list shared by the JIT loader (_compile.py)
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

# The CUDA library holds only the CUDA backends; it is loaded after the CPU library, whose schemas it implements.
# Each op's backend is two units: its host code (cuda/*.cpp: checks, allocation, ATen calls, the dispatch and every
# launch decision), compiled by the host compiler, and its kernels (cuda/*.cu), compiled by nvcc against no torch
# header but c10's half types -- nvcc parses every header several times (device pass, cudafe++, host pass), and
# ATen's cost it half a minute a file. ops_cuda.cpp registers them; cuda/host.cpp is what the host code asks of
# CUDA (the current stream, the launch check). The device-independent sources are compiled into both libraries:
# libraries are loaded with local symbol visibility.
CUDA_SOURCES = (
    "ops_cuda.cpp", "cuda/host.cpp",
    *(_DEFORM_CONV2D + name for name in (
        "conv_params.cpp", "columns_driver.cpp", "cuda/deform_conv_cuda.cpp", "cuda/deform_conv_cuda.cu")),
    *(_MS_DEFORM_ATTN + name for name in (
        "attention_params.cpp", "cuda/ms_deform_attn_cuda.cpp", "cuda/ms_deform_attn_cuda.cu")),
)

# The CUDA simulation, for the tests only (deform_conv.testing.load_cuda_simulation): the CUDA backends' host code
# as it is, and their kernels compiled by the host compiler against cuda_simulation/simt.h (the *_kernels.cpp
# wrappers include the .cu files), registered as torch.ops.deform_conv_sim.* (cuda_simulation/ops_sim.cpp).
CUDA_SIMULATION_SOURCES = (
    *("cuda_simulation/" + name for name in (
        "ops_sim.cpp", "simt.cpp", "deform_conv2d_kernels.cpp", "ms_deform_attn_kernels.cpp")),
    *(_DEFORM_CONV2D + name for name in ("conv_params.cpp", "columns_driver.cpp", "cuda/deform_conv_cuda.cpp")),
    *(_MS_DEFORM_ATTN + name for name in ("attention_params.cpp", "cuda/ms_deform_attn_cuda.cpp")),
)

# -fopenmp makes at::parallel_for use threads (its OpenMP backend is header code compiled into the library). With
# GCC the link names the OpenMP runtime torch loaded instead of -fopenmp's -lgomp (_compile.link_flags), so
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
