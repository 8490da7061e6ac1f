"""dcnv4, the DCNv4 repository's deformable convolution: ``function``, ``checks``, ``reference``, on DCNv3's grid
(dcnv3/) and the family's shared kernels (csrc/sampled_sum/); its host code is csrc/dcnv4/."""

from .function import dcnv4, use_compiled_kernels
from .reference import dcnv4_reference

__all__ = ["dcnv4", "dcnv4_reference", "use_compiled_kernels"]
