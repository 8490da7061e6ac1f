"""Argument validation of multi-scale deformable attention at the Python boundary, shared by the public function,
the fake kernel, the ONNX export and the compiled-extension shim.

Each error names the argument, what was expected and what was got. The C++ op repeats the essential checks
(TORCH_CHECK) as a backstop for direct ``torch.ops.deform_conv`` calls.
"""

from __future__ import annotations

from typing import List, NamedTuple

import torch
from torch import Tensor

from ..shared.checks import INT64_MAX, SUPPORTED_DTYPES, _check_tensor, _shape, check_point_dtype


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
    # Locations and weights in value's dtype, or float32 beside a half value (never rounded to a half type).
    check_point_dtype(sampling_locations, "sampling_locations", value, "value")
    check_point_dtype(attention_weights, "attention_weights", value, "value")
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
        if start > INT64_MAX:
            raise ValueError(
                f"spatial_shapes: the levels' pixel count sum(H_l * W_l) overflows int64 at level {level} "
                f"({start} > 2**63 - 1)"
            )
    if start != pixels:
        raise ValueError(
            f"value.shape[1] must be the levels' pixel count sum(H_l * W_l) = {start} from spatial_shapes, "
            f"got {pixels}"
        )
