"""deform_conv2d (DCNv1, and DCNv2 with a mask), torchvision's signature and layout: ``function`` (the public
function, fake kernels, autograd, autocast), ``checks``, ``reference`` (the pure-PyTorch ground truth) and
``onnx`` (its export to ONNX's DeformConv, imported only by an export). Its C++ and CUDA kernels are in
csrc/deform_conv2d/, its modules in deform_conv/nn/deform_conv2d.py."""

from .function import deform_conv2d, use_compiled_kernels
from .reference import deform_conv2d_reference

__all__ = ["deform_conv2d", "deform_conv2d_reference", "use_compiled_kernels"]
