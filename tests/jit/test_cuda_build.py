"""The CUDA library compiles for sm_90 through the loader path users take, on a machine with or without a GPU, and
ptxas reports no local memory in any kernel (no stack frame, no spills: every sampling point lives in registers)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from deform_conv._jit import cache as _cache, toolchain as _toolchain

from helpers.loader import KERNELS, check_no_local_memory, child_env, copy_current_cpu_entry


def _why_no_cuda_build() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build: nothing to build CUDA kernels against"
    if _toolchain.find_nvcc() is None:
        return "no nvcc found (CUDA_HOME unset and no /usr/local/cuda): cannot compile CUDA sources"
    return ""


@pytest.mark.skipif(bool(_why_no_cuda_build()), reason=_why_no_cuda_build() or "n/a")
def test_cuda_library_compiles_for_sm90(tmp_path):
    copy_current_cpu_entry(tmp_path)  # this session's CPU library: only the CUDA library is left to compile
    result = subprocess.run([sys.executable, "-m", "deform_conv", "build", "--cuda-arch", "9.0"],
                            capture_output=True, text=True, env=child_env(tmp_path), timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiling the CUDA kernels for sm_90" in result.stderr
    (entry,) = tmp_path.glob("cuda-sm90-*")
    key = _cache.inspect_entry(entry).key
    assert key is not None and key["environment"]["cuda_archs"] == ["9.0"]
    assert key["toolchain"]["nvcc"].startswith("nvcc ")
    check_no_local_memory((entry / "build.log").read_text())
    # The library holds sm_90 machine code (cuobjdump lists the cubins of a fat binary).
    cuobjdump = _toolchain.cuda_home() / "bin" / "cuobjdump"
    if cuobjdump.is_file():
        listing = subprocess.run([str(cuobjdump), "--list-elf", str(entry / key["library"])], capture_output=True,
                                 text=True, check=True).stdout
        assert "sm_90" in listing, listing


def test_the_local_memory_check_sees_a_stack_frame():
    """A log like the one the kernels gave before they kept their sampling points in registers."""
    log = "".join(f"ptxas info    : Compiling entry function '_Z{k}' for 'sm_90'\n"
                  "ptxas info    : Function properties for x\n"
                  "    176 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n" for k in KERNELS)
    with pytest.raises(AssertionError, match="kernels with local memory"):
        check_no_local_memory(log)
    check_no_local_memory(log.replace("176 bytes", "0 bytes"))
