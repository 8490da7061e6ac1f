"""Working with code written for other libraries:

- ``convert_modules`` swaps torchvision's, mmcv's and detectron2's deformable layers for ours, and
  ``Detectron2DeformConv`` is the layer detectron2's become (convert.py);
- ``install_multiscale_deformable_attention`` runs code written for Deformable DETR's compiled extension on our
  kernels (multiscale_extension.py);
- ``install_dcnv3`` and ``install_dcnv4`` run code written for InternImage's DCNv3 extension and ``ops_dcnv3``, and
  for the DCNv4 package, on our kernels (internimage_extensions.py);
- ``patch_transformers`` routes transformers' multi-scale deformable attention through ours (transformers_patch.py).

None of those libraries is imported by importing this package."""

from .convert import Detectron2DeformConv, convert_modules
from .internimage_extensions import install_dcnv3, install_dcnv4
from .multiscale_extension import MSDA_MODULE_NAME, install_multiscale_deformable_attention
from .transformers_patch import patch_transformers, transformers_patched, unpatch_transformers

__all__ = [
    "Detectron2DeformConv",
    "MSDA_MODULE_NAME",
    "convert_modules",
    "install_dcnv3",
    "install_dcnv4",
    "install_multiscale_deformable_attention",
    "patch_transformers",
    "transformers_patched",
    "unpatch_transformers",
]
