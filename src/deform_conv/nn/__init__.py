"""Modules, a file per op family: ``DeformConv2d`` (torchvision's), the learned-offset layers ``DeformConv2dPack``
and ``ModulatedDeformConv2dPack`` (mmcv's) in ``deform_conv2d.py``; ``MSDeformAttn`` (Deformable DETR's) in
``ms_deform_attn.py``."""

from .deform_conv2d import DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack
from .ms_deform_attn import MSDeformAttn

__all__ = ["DeformConv2d", "DeformConv2dPack", "MSDeformAttn", "ModulatedDeformConv2dPack"]
