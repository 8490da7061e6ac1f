"""dcnv3, InternImage's deformable convolution v3: ``function`` (the public function, fake kernels, autograd,
autocast), ``checks`` (shared with dcnv4's grid) and ``reference`` (the pure-PyTorch ground truth). Its kernels are
the family's shared ones (csrc/sampled_sum/), its host code csrc/dcnv3/."""

from .function import dcnv3, use_compiled_kernels
from .reference import dcnv3_reference

__all__ = ["dcnv3", "dcnv3_reference", "use_compiled_kernels"]
