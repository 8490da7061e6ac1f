# OURS, NOT UPSTREAM. The DCNv4 repository's DCNv4_op/DCNv4/functions/ cannot run here: its
# flash_deform_attn_func.py reads torch.cuda.get_device_properties(0) at import (and raises without a GPU), and
# both of its files wrap the compiled extension. The unchanged copies in ../modules/ import
# `from ..functions import DCNv4Function` and `FlashDeformAttnFunction`: this file gives them deform_conv's stand-ins,
# the ones `deform_conv.compat.install_dcnv4()` puts at DCNv4.functions (install it before importing this package;
# conftest.py does), so the upstream modules run on deform_conv's ops.
from DCNv4.functions import DCNv4Function, FlashDeformAttnFunction

__all__ = ["DCNv4Function", "FlashDeformAttnFunction"]
