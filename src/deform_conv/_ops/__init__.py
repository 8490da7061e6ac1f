"""The ops' Python faces, a sub-package per op with the same files (``function``, ``checks``, ``reference``,
``onnx``), on what they share (``shared/``).

``OPS`` is the one place the ops are listed. Each op package offers ``use_compiled_kernels(devices)``, which
``import deform_conv`` calls once the kernel libraries are loaded: it registers the op's fake kernels, autograd
formula and autocast rule with the library's schemas, and routes calls on ``devices`` (device types, e.g.
{"cpu"}) to the compiled kernels; other devices run the op's pure-PyTorch reference.
"""

from . import dcnv3, dcnv4, deform_conv2d, flash_deform_attn, ms_deform_attn

OPS = (deform_conv2d, ms_deform_attn, dcnv3, dcnv4, flash_deform_attn)
