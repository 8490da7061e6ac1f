"""examples/cpp builds against the installed torch's libtorch, loads the library `import deform_conv` loaded,
calls the op through the dispatcher and gets what the Python op gets on the same inputs."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path
from typing import Tuple

import pytest
import torch

import deform_conv
from deform_conv._jit import toolchain as _toolchain

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpp"
TARGET = "deform_conv_example"


def _why_cannot_build() -> str:
    if shutil.which("cmake") is None:
        return "cmake not found on PATH: cannot configure examples/cpp"
    if _toolchain.find_cxx() is None:
        return f"no C++ compiler ({_toolchain.cxx_name()!r} not found): cannot build examples/cpp"
    if torch.version.cuda is not None and _toolchain.cuda_home() is None:
        # TorchConfig.cmake of a CUDA build of torch fails without the toolkit, even for a CPU-only program.
        return f"torch {torch.__version__} is a CUDA build and no CUDA toolkit was found: find_package(Torch) needs one"
    if not any(lib.variant.kind == "cpu" for lib in deform_conv.libraries):
        return "no compiled CPU library loaded (DEFORM_CONV_FALLBACK=reference): nothing for the example to load"
    return ""


pytestmark = pytest.mark.skipif(bool(_why_cannot_build()), reason=_why_cannot_build() or "n/a")


def _run(command, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, command))} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    """The example, configured and built once for this module (about 20 s on 2 cores: libtorch's headers)."""
    build = tmp_path_factory.mktemp("cpp-example")
    configure = ["cmake", "-S", EXAMPLE, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                 f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                 f"-DCMAKE_CXX_COMPILER={_toolchain.find_cxx()}"]  # the compiler that built the library
    if torch.version.cuda is not None:
        configure.append(f"-DCUDA_TOOLKIT_ROOT_DIR={_toolchain.cuda_home()}")
    _run(configure, build, timeout=600)
    _run(["cmake", "--build", build, "--parallel", "2"], build, timeout=1200)
    binary = build / TARGET
    assert binary.is_file(), f"the build did not produce {binary}"
    return binary


def _wave(shape: Tuple[int, ...], freq: float, phase: float, scale: float, shift: float = 0.0) -> torch.Tensor:
    """shift + scale * sin(freq * k + phase), k = 0, 1, ... in row-major order: wave() of the C++ example, the
    same operations in the same order, so both sides start from the same bits."""
    k = torch.arange(torch.Size(shape).numel(), dtype=torch.float64)
    return k.mul(freq).add(phase).sin().mul(scale).add(shift).reshape(shape)


def _expected_output() -> torch.Tensor:
    # The geometry and inputs of deform_conv_example.cpp's run().
    batch, in_channels, out_channels, height, width = 2, 6, 4, 9, 7
    kh, kw, groups, offset_groups = 3, 2, 2, 3
    out_h, out_w, taps = 4, 6, kh * kw
    input = _wave((batch, in_channels, height, width), 0.37, 0.0, 1.0)
    offset = _wave((batch, 2 * offset_groups * taps, out_h, out_w), 0.53, 0.3, 2.5)
    weight = _wave((out_channels, in_channels // groups, kh, kw), 0.71, 1.1, 0.5)
    mask = _wave((batch, offset_groups * taps, out_h, out_w), 0.29, 0.7, 0.5, 0.5)
    bias = _wave((out_channels,), 1.3, 0.2, 1.0)
    return deform_conv.deform_conv2d(input, offset, weight, bias, stride=(2, 1), padding=(1, 0), dilation=(2, 1),
                                     mask=mask)


def _expected_dcnv3_output() -> torch.Tensor:
    # The geometry and inputs of deform_conv_example.cpp's run_dcnv3().
    input = _wave((2, 7, 6, 15), 0.41, 0.2, 1.0)
    offset = _wave((2, 3, 5, 36), 0.57, 0.1, 2.5)
    mask = _wave((2, 3, 5, 18), 0.31, 0.9, 0.5, 0.5)
    return deform_conv.dcnv3(input, offset, mask, (3, 2), (2, 1), (1, 0), (2, 1), 3, 1.5)


def _read(path: Path, expected: torch.Tensor) -> torch.Tensor:
    assert path.stat().st_size == expected.numel() * 8
    return torch.tensor(struct.unpack(f"<{expected.numel()}d", path.read_bytes()), dtype=torch.float64).reshape(
        expected.shape)


def test_cpp_example_matches_python(example, tmp_path):
    library = next(lib.path for lib in deform_conv.libraries if lib.variant.kind == "cpu")
    outputs = tmp_path / "deform_conv2d.bin", tmp_path / "dcnv3.bin"
    result = _run([example, library, *outputs], tmp_path, timeout=120)
    for name, output, expected in (("", outputs[0], _expected_output()),
                                   ("dcnv3 ", outputs[1], _expected_dcnv3_output())):
        assert f"{name}output shape [{', '.join(map(str, expected.shape))}]" in result.stdout, result.stdout
        torch.testing.assert_close(_read(output, expected), expected, rtol=1e-12, atol=1e-12)
        assert expected.abs().max() > 1.0  # not a match of two near-zero outputs


def test_cpp_example_names_a_library_it_cannot_load(example, tmp_path):
    missing = tmp_path / "no_such_library.so"
    result = subprocess.run([str(example), str(missing), str(tmp_path / "out.bin"), str(tmp_path / "dcnv3.bin")],
                            capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1
    assert f"cannot load the deform_conv library '{missing}'" in result.stderr, result.stderr
