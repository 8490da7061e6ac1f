"""Argument checks the ops share: tensors (type, layout, rank), int pairs, the supported dtypes.

Each error names the argument, what was expected and what was got. Each op's own checks (its ``checks.py``) are
written on these.
"""

from __future__ import annotations

from typing import List, Tuple, Union

import torch
from torch import Tensor

# An int or a (height, width) pair; spelled so that TorchScript can compile functions that take it.
IntPair = Union[int, Tuple[int, int], List[int]]

INT64_MAX = 2**63 - 1

# On every device; the CPU computes the half types in float32.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def as_pair(value: IntPair, name: str, minimum: int) -> Tuple[int, int]:
    """``value`` as (height, width); an int means the same for both. Raises if an element is below ``minimum``."""
    if _is_int(value):
        pair = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(_is_int(v) for v in value):
        pair = (value[0], value[1])
    else:
        raise TypeError(f"{name} must be an int or a pair of ints (height, width), got {value!r}")
    if pair[0] < minimum or pair[1] < minimum:
        raise ValueError(f"{name} must be >= {minimum} in both dimensions, got {tuple(pair)}")
    if pair[0] > INT64_MAX or pair[1] > INT64_MAX:  # the op's schema takes int64
        raise ValueError(f"{name} must be at most 2**63 - 1 in both dimensions, got {tuple(pair)}")
    return pair  # type: ignore[return-value]


def _shape(t: Tensor) -> Tuple[int, ...]:
    return tuple(t.shape)


def _check_tensor(t: object, name: str, dims: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be a {dims}-D tensor {layout}, got a {t.dim()}-D tensor of shape {_shape(t)}")


def check_point_dtype(t: Tensor, name: str, value: Tensor, value_name: str) -> None:
    """Coordinates (offsets, locations) and point weights: the value's dtype, or float32 beside a float16/bfloat16
    value (coordinates are never rounded to a half type)."""
    half = value.dtype in (torch.float16, torch.bfloat16)
    if t.dtype != value.dtype and not (half and t.dtype == torch.float32):
        also = " or float32" if half else ""
        raise TypeError(f"{name} must have {value_name}'s dtype {value.dtype}{also}, got {t.dtype}")


def check_same_device(tensors, value: Tensor, value_name: str) -> None:
    """Each (tensor, name) on ``value``'s device."""
    for t, name in tensors:
        if t.device != value.device:
            raise ValueError(f"{name} must be on {value_name}'s device {value.device}, got {t.device}")


def check_grad_output(grad_output: Tensor, value: Tensor, value_name: str, expected: Tuple[int, ...]) -> None:
    """A backward's grad_output: dense, the value's dtype and device, the forward output's shape."""
    _check_tensor(grad_output, "grad_output", len(expected), "(the forward output's shape)")
    if grad_output.dtype != value.dtype:
        raise TypeError(f"grad_output must have {value_name}'s dtype {value.dtype}, got {grad_output.dtype}")
    check_same_device(((grad_output, "grad_output"),), value, value_name)
    if _shape(grad_output) != tuple(expected):
        raise ValueError(f"grad_output must have shape {tuple(expected)}, got {_shape(grad_output)}")
