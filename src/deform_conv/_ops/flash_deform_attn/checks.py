"""Argument checks of FlashDeformAttn at the Python boundary (its levels are multi-scale deformable attention's:
ms_deform_attn/checks.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..ms_deform_attn.checks import check_levels_fit
from ..shared.checks import SUPPORTED_DTYPES, _check_tensor, _is_int, _shape, check_point_dtype, check_same_device


class FlashSizes(NamedTuple):
    """value [batch, pixels, group, channels], sampling_loc_attn [batch, queries, group, levels * points * 3]."""

    batch: int
    pixels: int
    group: int
    channels: int
    queries: int
    levels: int
    points: int  # a level


def check_flash_deform_attn_args(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                                 sampling_loc_attn: Tensor, n_points: int, check_levels: bool = True) -> FlashSizes:
    """Validates one call and returns its sizes; ``check_levels`` as ms_deform_attn's checks."""
    _check_tensor(value, "value", 4, "[N, S, group, group_channels]")
    _check_tensor(spatial_shapes, "spatial_shapes", 2, "[levels, 2] (height, width)")
    _check_tensor(level_start_index, "level_start_index", 1, "[levels]")
    _check_tensor(sampling_loc_attn, "sampling_loc_attn", 4, "[N, Lq, group, levels * n_points * 3]")
    if value.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"value must be float16, bfloat16, float32 or float64, got {value.dtype}")
    check_point_dtype(sampling_loc_attn, "sampling_loc_attn", value, "value")
    for t, name in ((spatial_shapes, "spatial_shapes"), (level_start_index, "level_start_index")):
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be an int64 (torch.long) tensor, got {t.dtype}")
    check_same_device(((spatial_shapes, "spatial_shapes"), (level_start_index, "level_start_index"),
                       (sampling_loc_attn, "sampling_loc_attn")), value, "value")
    if not _is_int(n_points):
        raise TypeError(f"n_points must be an int, got {n_points!r}")
    if n_points < 1:
        raise ValueError(f"n_points must be >= 1, got {n_points}")
    batch, pixels, group, channels = value.shape
    levels = spatial_shapes.shape[0]
    if levels < 1 or spatial_shapes.shape[1] != 2:
        raise ValueError(
            f"spatial_shapes must have shape [levels, 2] with at least 1 level, got {_shape(spatial_shapes)}")
    if _shape(level_start_index) != (levels,):
        raise ValueError(f"level_start_index must have shape ({levels},) [levels], got {_shape(level_start_index)}")
    if group < 1:
        raise ValueError(f"value must have at least 1 group, got shape {_shape(value)}")
    queries = sampling_loc_attn.shape[1]
    expected = (batch, queries, group, levels * n_points * 3)
    if _shape(sampling_loc_attn) != expected:
        raise ValueError(
            f"sampling_loc_attn must have shape {expected} [N, Lq, group, levels * n_points * 3] (levels from "
            f"spatial_shapes), got {_shape(sampling_loc_attn)}"
        )
    if check_levels and spatial_shapes.device.type == "cpu":
        check_levels_fit(spatial_shapes.tolist(), level_start_index.tolist(), pixels)
    return FlashSizes(batch, pixels, group, channels, queries, levels, n_points)
