"""What the ops' Python faces (their ``function.py``) share: the autocast rule, and whether an ONNX export is
running."""

from __future__ import annotations

import sys
from typing import List

import torch
from torch import Tensor

from .checks import IntPair


def autocast_cast(t, dtype: torch.dtype):
    """The ops' autocast rule for their input or value, as autocast treats ``conv2d``: a float32 or half tensor becomes ``dtype``; float64
    tensors, integer tensors and anything that is not a tensor are left alone."""
    if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64:
        return t.to(dtype)
    return t


@torch.jit.unused
def autocast_inputs(*tensors):
    """The tensors as the op's autocast kernel will cast them, where autocast is on for their device: so that the
    checks, which want one dtype, see what the kernels will get. Under autocast the tensors of a layer often differ
    (a Linear's bfloat16 output beside float32 locations or a float32 input)."""
    first = next((t for t in tensors if isinstance(t, Tensor)), None)
    # Autocast exists for some device types only (not "meta": an all-meta call is checked as the op would be).
    if first is None or first.device.type not in ("cpu", "cuda", "xpu", "mps", "hpu", "xla"):
        return tensors
    if not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(autocast_cast(t, dtype) for t in tensors)


@torch.jit.unused
def in_onnx_export() -> bool:
    """Whether torch.onnx.export is running. Never imports torch.onnx (~26 ms): an export has imported it."""
    onnx = sys.modules.get("torch.onnx")
    return onnx is not None and onnx.is_in_onnx_export()


def autocast_coordinates(t, value_dtype: torch.dtype):
    """The autocast rule for coordinates (offsets, locations) and point weights beside a value cast to
    ``value_dtype``: never rounded to a half type. A float32 tensor stays float32; a tensor of another half type
    than the value's becomes float32."""
    if isinstance(t, Tensor) and t.is_floating_point() and t.dtype not in (value_dtype, torch.float32):
        if value_dtype in (torch.float16, torch.bfloat16):
            return t.float()
    return t


def script_pair(value: IntPair) -> List[int]:
    """``value`` (an int or an (h, w) pair: shared/checks.py's IntPair) as [height, width], also inside TorchScript,
    where the Python checks are not compiled."""
    if isinstance(value, int):
        return [value, value]
    if isinstance(value, list):
        return value
    return [value[0], value[1]]
