"""Deformable convolution (DCNv1 and DCNv2) for PyTorch, with C++ kernels built for this machine on first import.

Importing the package loads the kernel libraries from the cache, compiling them once if needed (``_jit``):
the CPU library always, the CUDA library when a GPU is visible or $TORCH_CUDA_ARCH_LIST asks for one.
"""

import os as _os
import sys as _sys
import warnings as _warnings
from typing import Tuple as _Tuple

from ._version import __version__
from ._jit.errors import BuildError
from ._jit.loader import LoadedLibrary, cache_root
from ._jit import loader as _loader, settings as _settings, variant as _variant
from . import _ops

libraries: _Tuple[LoadedLibrary, ...] = ()  # what was loaded, from where, and whether it was just built


def _load_libraries() -> _Tuple[LoadedLibrary, ...]:
    """Loads (building once) the libraries this machine needs. With DEFORM_CONV_FALLBACK=reference a library
    that cannot be built is a warning, and its device runs the pure-PyTorch implementation instead."""
    global libraries
    _settings.validate_all()
    fallback = _settings.fallback_to_reference()
    loaded = []
    variants = _variant.wanted_variants()
    failed = {}
    if len(variants) > 1:  # the CPU and the CUDA library: their compiles overlap when both are needed
        from ._jit import build as _build

        failed = _build.build_concurrently(variants)
    for variant in variants:
        try:
            if variant in failed:
                raise failed[variant]
            loaded.append(_loader.load(variant))
        except BuildError as error:
            if not fallback:
                raise
            _warnings.warn(
                f"deform_conv: the {variant.label} could not be built; {variant.kind} tensors run the slow "
                f"pure-PyTorch implementation instead (DEFORM_CONV_FALLBACK=reference). The build said:\n{error}",
                RuntimeWarning,
                stacklevel=3,
            )
            if variant.kind == "cpu":
                break  # the CUDA library implements the schemas the CPU library defines
    libraries = tuple(loaded)
    devices = {lib.variant.kind for lib in libraries}
    for op in _ops.OPS:
        op.use_compiled_kernels(devices)
    return libraries


def _invoked_as_command_line() -> bool:
    """True while `python -m deform_conv ...` or `deform-conv ...` is starting: the command line decides
    itself what to load (`doctor`, `clean` and `build --cpu-only` must work even where a build would fail)."""
    if _os.path.basename(_sys.argv[0] if _sys.argv else "") == "deform-conv":
        return True
    # While `python -m X` imports X's package, sys.argv[0] is "-m"; orig_argv tells which X.
    orig = _sys.orig_argv
    return bool(_sys.argv) and _sys.argv[0] == "-m" and any(
        a == "-m" and b == "deform_conv" for a, b in zip(orig, orig[1:])
    )


if not _invoked_as_command_line():
    _load_libraries()

from ._ops.deform_conv2d import deform_conv2d, deform_conv2d_reference  # noqa: E402
from ._ops.ms_deform_attn import ms_deform_attn, ms_deform_attn_reference  # noqa: E402
from ._ops.dcnv3 import dcnv3, dcnv3_reference  # noqa: E402
from ._ops.dcnv4 import dcnv4, dcnv4_reference  # noqa: E402
from ._ops.flash_deform_attn import flash_deform_attn, flash_deform_attn_reference  # noqa: E402
from .nn import DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack, MSDeformAttn  # noqa: E402
from .compat import convert_modules  # noqa: E402

__all__ = [
    "BuildError",
    "DeformConv2d",
    "DeformConv2dPack",
    "LoadedLibrary",
    "MSDeformAttn",
    "ModulatedDeformConv2dPack",
    "__version__",
    "cache_root",
    "convert_modules",
    "dcnv3",
    "dcnv3_reference",
    "dcnv4",
    "dcnv4_reference",
    "flash_deform_attn",
    "flash_deform_attn_reference",
    "deform_conv2d",
    "deform_conv2d_reference",
    "libraries",
    "ms_deform_attn",
    "ms_deform_attn_reference",
]
