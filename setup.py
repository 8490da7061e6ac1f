"""Opt-in ahead-of-time build: `DEFORM_CONV_AOT=1 pip install --no-build-isolation .` compiles the kernels at
install time with torch's BuildExtension (the classic extension route) from the same sources and flags as the
JIT loader's portable CPU library (`deform-conv build --portable`: src/deform_conv/_jit/sources.py, variant.py), and
bundles them in deform_conv/_prebuilt/ with their key. At import
the package prefers a bundled library whose key matches this environment and falls back to the JIT cache.

Without DEFORM_CONV_AOT=1 this is a plain pure-Python install: nothing is compiled. (--no-build-isolation:
the build must see the torch it builds against.)
"""

import os
import sys
import types
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
PACKAGE = HERE / "src" / "deform_conv"


def _package_stub():
    """Makes deform_conv's modules importable without running deform_conv/__init__.py (which would JIT-build
    the kernels)."""
    stub = types.ModuleType("deform_conv")
    stub.__path__ = [str(PACKAGE)]
    sys.modules.setdefault("deform_conv", stub)


def aot_setup_args() -> dict:
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    _package_stub()
    from deform_conv._jit import compile as _compile, loader as _loader, sources as _sources
    from deform_conv._jit import toolchain as _toolchain, variant as _variant

    variants = [_variant.Variant("cpu")]
    archs = _variant.requested_cuda_archs()
    if archs:
        variants.append(_variant.Variant("cuda", archs))
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)

    extensions = []
    units = HERE / "build" / "deform_conv_units"  # the generated translation units (_sources.write_units)
    units.mkdir(parents=True, exist_ok=True)
    for variant in variants:
        written = _sources.write_units(variant.kind, str(_variant.CSRC), str(units))
        sources = [str(Path(path).relative_to(HERE)) for path in written]
        cxx_version = _toolchain.identify(_toolchain.find_cxx(), None)
        args = dict(extra_compile_args={"cxx": _compile.compiler_flags(variant, cxx_version),
                                        "nvcc": list(_sources.NVCC_FLAGS)},
                    extra_link_args=_compile.link_flags(variant, cxx_version))
        make = CUDAExtension if variant.kind == "cuda" else CppExtension
        extensions.append((variant, make(f"deform_conv._prebuilt.{variant.kind}", sources, **args)))

    class BuildAndRecordKey(BuildExtension.with_options(no_python_abi_suffix=True)):
        """After each library, writes _prebuilt/<kind>.json: the same key the JIT loader checks."""

        def build_extension(self, ext):
            super().build_extension(ext)
            variant = next(v for v, e in extensions if e is ext)
            library = Path(self.get_ext_fullpath(ext.name))
            _loader.write_prebuilt_key(variant, library)

    return dict(ext_modules=[e for _, e in extensions], cmdclass={"build_ext": BuildAndRecordKey})


def aot_requested() -> bool:
    """$DEFORM_CONV_AOT, validated as the package validates every variable (a typo is an error, not a no)."""
    _package_stub()
    from deform_conv._jit import settings as _settings

    return _settings.ahead_of_time()


setup(**(aot_setup_args() if aot_requested() else {}))
