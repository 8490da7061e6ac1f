"""flash_deform_attn, the DCNv4 repository's FlashDeformAttn: ``function``, ``checks``, ``reference``; its kernels are
the family's shared ones (csrc/sampled_sum/), its host code csrc/flash_deform_attn/."""

from .function import flash_deform_attn, use_compiled_kernels
from .reference import flash_deform_attn_reference

__all__ = ["flash_deform_attn", "flash_deform_attn_reference", "use_compiled_kernels"]
