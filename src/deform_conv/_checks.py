"""Argument validation at the Python boundary, shared by the public function and the fake kernel.

Each error names the argument, what was expected and what was got. The C++ op repeats the essential checks
(TORCH_CHECK) as a backstop for direct ``torch.ops.deform_conv`` calls.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

# An int or a (height, width) pair; spelled so that TorchScript can compile functions that take it.
IntPair = Union[int, Tuple[int, int], List[int]]

INT64_MAX = 2**63 - 1

# On every device; the CPU computes the half types in float32.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# The derivative at exactly y = -1 or x = -1 (csrc/sampling.h): torchvision's one-sided one, or mmcv's 0.
BORDER_GRADIENTS = ("torchvision", "mmcv")


def check_border_gradient(value: object) -> None:
    if not isinstance(value, str) or value not in BORDER_GRADIENTS:
        raise ValueError(f"border_gradient must be 'torchvision' or 'mmcv', got {value!r}")


class Geometry(NamedTuple):
    """Sizes of one call, derived from the tensors (groups and offset_groups are inferred as in torchvision)."""

    stride: Tuple[int, int]
    padding: Tuple[int, int]
    dilation: Tuple[int, int]
    groups: int
    offset_groups: int
    out_h: int
    out_w: int


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


def _check_like_input(t: Tensor, name: str, input: Tensor) -> None:
    if t.dtype != input.dtype:
        raise TypeError(f"{name} must have the input's dtype {input.dtype}, got {t.dtype}")
    if t.device != input.device:
        raise ValueError(f"{name} must be on the input's device {input.device}, got {t.device}")


def check_args(
    input: Tensor,
    offset: Tensor,
    weight: Tensor,
    mask: Optional[Tensor],
    bias: Optional[Tensor],
    stride: IntPair,
    padding: IntPair,
    dilation: IntPair,
) -> Geometry:
    """Validates one call and returns its geometry. Shapes:

    input  [B, C_in, H, W]; offset [B, 2*offset_groups*kh*kw, H_out, W_out]; weight [C_out, C_in/groups, kh, kw];
    mask   [B, offset_groups*kh*kw, H_out, W_out] or None; bias [C_out] or None.
    """
    _check_tensor(input, "input", 4, "[batch, channels, height, width]")
    _check_tensor(weight, "weight", 4, "[out_channels, in_channels / groups, kernel_h, kernel_w]")
    _check_tensor(offset, "offset", 4, "[batch, 2 * offset_groups * kernel_h * kernel_w, out_h, out_w]")
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"input must be float16, bfloat16, float32 or float64, got {input.dtype}")
    _check_like_input(offset, "offset", input)
    _check_like_input(weight, "weight", input)
    stride_hw = as_pair(stride, "stride", 1)
    padding_hw = as_pair(padding, "padding", 0)
    dilation_hw = as_pair(dilation, "dilation", 1)

    batch, in_channels, height, width = input.shape
    out_channels, in_per_group, kernel_h, kernel_w = weight.shape
    if in_channels < 1:
        raise ValueError(f"input must have at least 1 channel, got shape {_shape(input)}")
    if kernel_h < 1 or kernel_w < 1:
        raise ValueError(f"weight's kernel size must be at least 1x1, got weight of shape {_shape(weight)}")
    if in_per_group < 1 or in_channels % in_per_group != 0:
        raise ValueError(
            f"weight.shape[1] (in_channels / groups) must divide the input's {in_channels} channels, "
            f"got weight of shape {_shape(weight)}"
        )
    groups = in_channels // in_per_group
    if out_channels % groups != 0:
        raise ValueError(
            f"weight.shape[0] (out_channels) must be divisible by groups = {in_channels} // {in_per_group} = {groups}, "
            f"got {out_channels}"
        )

    taps = kernel_h * kernel_w
    if offset.shape[1] < 1 or offset.shape[1] % (2 * taps) != 0:
        raise ValueError(
            f"offset must have a positive multiple of 2 * kernel_h * kernel_w = {2 * taps} channels "
            f"(2 * offset_groups * kernel_h * kernel_w), got {offset.shape[1]}"
        )
    offset_groups = offset.shape[1] // (2 * taps)
    if in_channels % offset_groups != 0:
        raise ValueError(
            f"offset_groups = offset.shape[1] // {2 * taps} = {offset_groups} must divide the input's "
            f"{in_channels} channels"
        )

    extent_h = height + 2 * padding_hw[0] - dilation_hw[0] * (kernel_h - 1) - 1
    extent_w = width + 2 * padding_hw[1] - dilation_hw[1] * (kernel_w - 1) - 1
    if extent_h < 0 or extent_w < 0:
        raise ValueError(
            f"output size must be at least 1x1, but input {height}x{width} with kernel {kernel_h}x{kernel_w}, "
            f"padding {tuple(padding_hw)} and dilation {tuple(dilation_hw)} leaves no room for one kernel window"
        )
    out_h = extent_h // stride_hw[0] + 1
    out_w = extent_w // stride_hw[1] + 1

    expected = (batch, offset.shape[1], out_h, out_w)
    if _shape(offset) != expected:
        raise ValueError(f"offset must have shape {expected} [batch, channels, out_h, out_w], got {_shape(offset)}")
    if mask is not None:
        _check_tensor(mask, "mask", 4, "[batch, offset_groups * kernel_h * kernel_w, out_h, out_w]")
        _check_like_input(mask, "mask", input)
        expected = (batch, offset_groups * taps, out_h, out_w)
        if _shape(mask) != expected:
            raise ValueError(
                f"mask must have shape {expected} [batch, offset_groups * kernel_h * kernel_w, out_h, out_w], "
                f"got {_shape(mask)}"
            )
    if bias is not None:
        _check_tensor(bias, "bias", 1, "[out_channels]")
        _check_like_input(bias, "bias", input)
        if bias.shape[0] != out_channels:
            raise ValueError(f"bias must have shape ({out_channels},) [out_channels], got {_shape(bias)}")
    return Geometry(stride_hw, padding_hw, dilation_hw, groups, offset_groups, out_h, out_w)


# ------------------------------------------------------------------------------ multi-scale deformable attention


class AttentionSizes(NamedTuple):
    """Sizes of one ms_deform_attn call: value [batch, pixels, heads, channels], sampling_locations
    [batch, queries, heads, levels, points, 2]."""

    batch: int
    pixels: int
    heads: int
    channels: int
    queries: int
    levels: int
    points: int


def check_ms_deform_attn_args(
    value: Tensor,
    spatial_shapes: Tensor,
    level_start_index: Tensor,
    sampling_locations: Tensor,
    attention_weights: Tensor,
    check_levels: bool = True,
) -> AttentionSizes:
    """Validates one call and returns its sizes. Shapes (Deformable DETR's):

    value [N, S, M, D] (S = sum of H_l * W_l); spatial_shapes [L, 2] int64 (H_l, W_l); level_start_index [L]
    int64; sampling_locations [N, Lq, M, L, P, 2] (x, y in [0, 1]); attention_weights [N, Lq, M, L, P].

    With ``check_levels`` (the eager call; not the fake kernel, nor under torch.compile, torch.export or the
    tracer, where the values are unknown) the level sizes themselves are checked against each other and against
    S where that costs nothing: on CPU tensors. On a GPU it would cost a device synchronisation a call, so there
    the kernels guard every read instead (a level whose start and size do not fit in S samples NaN).
    """
    _check_tensor(value, "value", 4, "[batch, pixels, heads, channels]")
    _check_tensor(spatial_shapes, "spatial_shapes", 2, "[levels, 2] (height, width)")
    _check_tensor(level_start_index, "level_start_index", 1, "[levels]")
    _check_tensor(sampling_locations, "sampling_locations", 6, "[batch, queries, heads, levels, points, 2]")
    _check_tensor(attention_weights, "attention_weights", 5, "[batch, queries, heads, levels, points]")
    if value.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"value must be float16, bfloat16, float32 or float64, got {value.dtype}")
    for t, name in ((sampling_locations, "sampling_locations"), (attention_weights, "attention_weights")):
        if t.dtype != value.dtype:
            raise TypeError(f"{name} must have value's dtype {value.dtype}, got {t.dtype}")
    for t, name in ((spatial_shapes, "spatial_shapes"), (level_start_index, "level_start_index")):
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be an int64 (torch.long) tensor, got {t.dtype}")
    for t, name in ((spatial_shapes, "spatial_shapes"), (level_start_index, "level_start_index"),
                    (sampling_locations, "sampling_locations"), (attention_weights, "attention_weights")):
        if t.device != value.device:
            raise ValueError(f"{name} must be on value's device {value.device}, got {t.device}")

    batch, pixels, heads, channels = value.shape
    levels = spatial_shapes.shape[0]
    if levels < 1 or spatial_shapes.shape[1] != 2:
        raise ValueError(
            f"spatial_shapes must have shape [levels, 2] with at least 1 level, got {_shape(spatial_shapes)}"
        )
    if _shape(level_start_index) != (levels,):
        raise ValueError(
            f"level_start_index must have shape ({levels},) [levels], as spatial_shapes has {levels} levels, "
            f"got {_shape(level_start_index)}"
        )
    if heads < 1:
        raise ValueError(f"value must have at least 1 head, got shape {_shape(value)}")
    queries, points = sampling_locations.shape[1], sampling_locations.shape[4]
    expected = (batch, queries, heads, levels, points, 2)
    if _shape(sampling_locations) != expected:
        raise ValueError(
            f"sampling_locations must have shape {expected} [batch, queries, heads, levels, points, 2] "
            f"(batch and heads from value, levels from spatial_shapes), got {_shape(sampling_locations)}"
        )
    expected = (batch, queries, heads, levels, points)
    if _shape(attention_weights) != expected:
        raise ValueError(
            f"attention_weights must have shape {expected} [batch, queries, heads, levels, points] "
            f"(queries and points from sampling_locations), got {_shape(attention_weights)}"
        )
    if check_levels and spatial_shapes.device.type == "cpu":
        check_levels_fit(spatial_shapes.tolist(), level_start_index.tolist(), pixels)
    return AttentionSizes(batch, pixels, heads, channels, queries, levels, points)


def check_levels_fit(shapes: List[List[int]], starts: List[int], pixels: int) -> None:
    """The levels, (H_l, W_l) each, must be at least 1x1 and lie one after another in value's S pixels."""
    start = 0
    for level, ((height, width), given) in enumerate(zip(shapes, starts)):
        if height < 1 or width < 1:
            raise ValueError(f"spatial_shapes[{level}] (height, width) must be at least 1x1, got ({height}, {width})")
        if given != start:
            raise ValueError(
                f"level_start_index[{level}] must be {start} (the pixels of the levels before it, "
                f"sum of H_l * W_l), got {given}"
            )
        start += height * width
    if start != pixels:
        raise ValueError(
            f"value.shape[1] must be the levels' pixel count sum(H_l * W_l) = {start} from spatial_shapes, "
            f"got {pixels}"
        )
