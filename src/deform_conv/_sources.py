"""What each kernel library is compiled from and with: the one list shared by the JIT loader (_build.py)
and the opt-in ahead-of-time build (setup.py). Plain data, no imports, so setup.py can read it by path."""

CSRC_DIR = "csrc"  # relative to the package directory

# The CPU library holds every schema (ops.cpp) and the CPU kernels.
CPU_SOURCES = (
    "ops.cpp", "conv_params.cpp", "columns_driver.cpp",
    "cpu/sampling_passes.cpp", "cpu/depthwise.cpp", "cpu/deform_conv_cpu.cpp",
)

# The CUDA library holds only CUDA kernels; it is loaded after the CPU library, whose schemas it implements.
# The device-independent sources are compiled into both: libraries are loaded with local symbol visibility.
CUDA_SOURCES = ("conv_params.cpp", "columns_driver.cpp", "cuda/deform_conv_cuda.cu")

# -fopenmp makes at::parallel_for use threads (its OpenMP backend is header code compiled into the library);
# the libgomp.so.1 it links resolves to the one torch has already loaded.
# --as-needed drops the libraries cpp_extension always lists but the library does not use (libtorch_python
# among them, which would tie it to one Python version).
CXX_FLAGS = ("-O3", "-fopenmp")
LD_FLAGS = ("-fopenmp", "-Wl,--as-needed")
# No --use_fast_math: it changes results (division, denormals) and NaN handling.
NVCC_FLAGS = ("-O3", "-lineinfo")
