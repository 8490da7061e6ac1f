# ================================================================================================
# UNCHANGED COPY of upstream code, for tests/upstream_models/ (deform_conv's tests run it against
# deform_conv's modules and shims). Do not edit below this block: refetch instead.
#   repository: https://github.com/OpenGVLab/DCNv4
#   path:       DCNv4_op/DCNv4/modules/__init__.py
#   commit:     7d59305b5f10e1a67729cefde580ccdbd2811b6a
# This file is Apache-2.0, from Deformable DETR (Copyright (c) 2020 SenseTime): header kept below.
# Everything after this block is the upstream file byte for byte, its own licence header first.
# ================================================================================================
# ------------------------------------------------------------------------------------------------
# Deformable DETR
# Copyright (c) 2020 SenseTime. All Rights Reserved.
# Licensed under the Apache License, Version 2.0 [see LICENSE for details]
# ------------------------------------------------------------------------------------------------
# Modified from https://github.com/chengdazhi/Deformable-Convolution-V2-PyTorch/tree/pytorch_1.0.0
# ------------------------------------------------------------------------------------------------

from .flash_deform_attn import FlashDeformAttn
from .dcnv4 import DCNv4
