"""Modules, a file per op family: ``DeformConv2d`` (torchvision's), the learned-offset layers ``DeformConv2dPack``
and ``ModulatedDeformConv2dPack`` (mmcv's) in ``deform_conv2d.py``; ``MSDeformAttn`` (Deformable DETR's) in
``ms_deform_attn.py``; ``DCNv3`` (InternImage's) in ``dcnv3.py``; ``DCNv4`` and ``FlashDeformAttn`` (the DCNv4
repository's) in ``dcnv4.py`` and ``flash_deform_attn.py``."""

from .dcnv3 import DCNv3
from .dcnv4 import DCNv4
from .deform_conv2d import DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack
from .flash_deform_attn import FlashDeformAttn
from .ms_deform_attn import MSDeformAttn

__all__ = ["DCNv3", "DCNv4", "DeformConv2d", "DeformConv2dPack", "FlashDeformAttn", "MSDeformAttn",
           "ModulatedDeformConv2dPack"]
