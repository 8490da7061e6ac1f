"""Deformable convolution (DCNv1 and DCNv2) for PyTorch, with C++ kernels built for this machine on first import.

Importing the package loads the kernel library from the cache, compiling it once if needed (see ``_build``).
"""

from ._version import __version__
from ._build import BuildError, cache_root
from ._build import load as _load_library

library = _load_library()  # what was loaded, from where, and whether it was just built

from ._ops import deform_conv2d  # noqa: E402  (the ops must be registered first)
from ._reference import deform_conv2d_reference  # noqa: E402
from .nn import DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack  # noqa: E402

__all__ = [
    "BuildError",
    "DeformConv2d",
    "DeformConv2dPack",
    "ModulatedDeformConv2dPack",
    "__version__",
    "cache_root",
    "deform_conv2d",
    "deform_conv2d_reference",
    "library",
]
