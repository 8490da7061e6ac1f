"""ms_deform_attn, Deformable DETR's multi-scale deformable attention: ``function`` (the public function, fake
kernels, autograd, autocast), ``checks``, ``reference`` (the pure-PyTorch ground truth and Deformable DETR's
grid_sample composition) and ``onnx`` (its export as that composition, imported only by an export). Its C++ and
CUDA kernels are in csrc/ms_deform_attn/, its module in deform_conv/nn/ms_deform_attn.py."""

from .function import ms_deform_attn, use_compiled_kernels
from .reference import ms_deform_attn_reference

__all__ = ["ms_deform_attn", "ms_deform_attn_reference", "use_compiled_kernels"]
