"""Multi-scale deformable attention's module: Deformable DETR's ``MSDeformAttn`` on this package's op."""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from .._ops.ms_deform_attn import ms_deform_attn


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_positive_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class MSDeformAttn(nn.Module):
    """Multi-scale deformable attention, as Deformable DETR's ``MSDeformAttn``
    (models/ops/modules/ms_deform_attn.py): its constructor arguments, initialisation, state_dict keys
    (``sampling_offsets``, ``attention_weights``, ``value_proj``, ``output_proj``, each a ``Linear`` with weight and
    bias) and forward, with :func:`deform_conv.ms_deform_attn` as the kernel.

    Args:
        d_model: channels of the queries and of the input (C); divisible by ``n_heads``.
        n_levels: feature levels L.
        n_heads: attention heads M (each sees ``d_model // n_heads`` channels; a power of 2 is what Deformable
            DETR's CUDA kernel prefers, hence the same warning otherwise).
        n_points: sampling points P per head and level.

    ``forward(query, reference_points, input_flatten, input_spatial_shapes, input_level_start_index,
    input_padding_mask=None) -> [N, Lq, C]``:

    - query ``[N, Lq, C]``.
    - reference_points ``[N, Lq, L, 2]``: (x, y) in [0, 1] of each query in each level (top-left (0, 0),
      bottom-right (1, 1), padding included); the offsets are in pixels of each level, divided by (W_l, H_l).
      Or ``[N, Lq, L, 4]``: boxes (cx, cy, w, h), each point at ``centre + offset / n_points * (w, h) / 2``.
      Dimensions of size 1 broadcast, as in Deformable DETR.
    - input_flatten ``[N, S, C]``: the pixels of all levels one level after another, S = sum of H_l * W_l.
    - input_spatial_shapes ``[L, 2]`` int64, (H_l, W_l); input_level_start_index ``[L]`` int64.
    - input_padding_mask ``[N, S]`` bool or None: True at padding pixels, whose values are set to 0.

    ``im2col_step`` (64) is kept as an attribute, as in Deformable DETR, and handed to the op, which ignores it.
    """

    def __init__(self, d_model: int = 256, n_levels: int = 4, n_heads: int = 8, n_points: int = 4) -> None:
        super().__init__()
        for value, name in ((d_model, "d_model"), (n_levels, "n_levels"), (n_heads, "n_heads"),
                            (n_points, "n_points")):
            _check_positive_int(value, name)
        if d_model % n_heads != 0:
            raise ValueError(f"d_model must be divisible by n_heads, but got {d_model} and {n_heads}")
        if not _is_power_of_2(d_model // n_heads):
            # The warning Deformable DETR's MSDeformAttn gives: a model meant to run with its kernels too is told.
            warnings.warn(
                f"MSDeformAttn: d_model // n_heads = {d_model // n_heads} channels per head is not a power of 2, "
                "which Deformable DETR's CUDA kernel is more efficient with",
                UserWarning,
                stacklevel=2,
            )
        self.im2col_step = 64
        self.d_model = d_model
        self.n_levels = n_levels
        self.n_heads = n_heads
        self.n_points = n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """Deformable DETR's initialisation. The offsets start as the bias alone: head m's points lie on the ray
        at angle 2*pi*m/M, scaled so that its larger coordinate is 1 (on the square around the reference point),
        point p at distance (p + 1) along it, the same in every level. Attention starts uniform (zero logits);
        the projections are Xavier-uniform with zero bias."""
        nn.init.zeros_(self.sampling_offsets.weight)
        thetas = torch.arange(self.n_heads, dtype=torch.float32) * (2.0 * math.pi / self.n_heads)
        directions = torch.stack([thetas.cos(), thetas.sin()], -1)  # [M, 2]
        directions = directions / directions.abs().max(-1, keepdim=True)[0]
        scale = torch.arange(1, self.n_points + 1, dtype=torch.float32).view(1, 1, self.n_points, 1)
        grid = directions.view(self.n_heads, 1, 1, 2) * scale  # [M, 1, P, 2]
        with torch.no_grad():
            # copy_ into the existing parameter (Deformable DETR assigns a new one): same values, and a module
            # already on another device or dtype, or an optimizer holding the parameter, keeps working.
            self.sampling_offsets.bias.copy_(grid.expand(-1, self.n_levels, -1, -1).reshape(-1))
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        nn.init.xavier_uniform_(self.value_proj.weight)
        nn.init.zeros_(self.value_proj.bias)
        nn.init.xavier_uniform_(self.output_proj.weight)
        nn.init.zeros_(self.output_proj.bias)

    def _check_forward_args(self, query: Tensor, reference_points: Tensor, input_flatten: Tensor,
                            input_spatial_shapes: Tensor, input_padding_mask: Optional[Tensor]) -> None:
        if query.dim() != 3 or query.shape[-1] != self.d_model:
            raise ValueError(f"query must have shape [N, Lq, d_model={self.d_model}], got {tuple(query.shape)}")
        batch, queries = query.shape[0], query.shape[1]
        if input_flatten.dim() != 3 or input_flatten.shape[0] != batch or input_flatten.shape[-1] != self.d_model:
            raise ValueError(f"input_flatten must have shape [N={batch}, S, d_model={self.d_model}] (N from query), "
                             f"got {tuple(input_flatten.shape)}")
        if reference_points.dim() != 4 or reference_points.shape[-1] not in (2, 4):
            raise ValueError(f"reference_points must have shape [N, Lq, n_levels, 2] (points) or [N, Lq, n_levels, 4] "
                             f"(boxes), the last dim 2 or 4, got {tuple(reference_points.shape)}")
        expected = (batch, queries, self.n_levels)
        if any(size not in (want, 1) for size, want in zip(reference_points.shape[:3], expected)):
            raise ValueError(f"reference_points must have shape [N={batch}, Lq={queries}, n_levels={self.n_levels}, "
                             f"2 or 4] (N and Lq from query; a dim of size 1 broadcasts), got "
                             f"{tuple(reference_points.shape)}")
        if tuple(input_spatial_shapes.shape) != (self.n_levels, 2):
            raise ValueError(f"input_spatial_shapes must have shape (n_levels={self.n_levels}, 2) [levels, (H, W)], "
                             f"got {tuple(input_spatial_shapes.shape)}")
        if input_padding_mask is not None:
            expected_mask = (batch, input_flatten.shape[1])
            if tuple(input_padding_mask.shape) != expected_mask or input_padding_mask.dtype != torch.bool:
                raise ValueError(f"input_padding_mask must be a bool tensor of shape {expected_mask} [N, S] (from "
                                 f"input_flatten) or None, got {input_padding_mask.dtype} of shape "
                                 f"{tuple(input_padding_mask.shape)}")
        # Deformable DETR asserts sum(H_l * W_l) == S. Read on the CPU only (elsewhere it would cost a device
        # synchronisation a call) and only in eager mode, where ms_deform_attn checks the same but names its own
        # argument, value, instead of input_flatten.
        if (input_spatial_shapes.device.type == "cpu" and not torch.jit.is_tracing()
                and not torch.compiler.is_compiling()):
            # In Python's integers: an int64 product or sum could wrap around to a plausible count.
            pixels = sum(height * width for height, width in input_spatial_shapes.tolist())
            if pixels > 2**63 - 1:
                raise ValueError(f"input_spatial_shapes: the levels' pixel count sum(H_l * W_l) = {pixels} "
                                 "overflows int64")
            if pixels != input_flatten.shape[1]:
                raise ValueError(f"input_flatten must have sum(H_l * W_l) = {pixels} pixels (from "
                                 f"input_spatial_shapes) in dim 1, got shape {tuple(input_flatten.shape)}")

    def forward(
        self,
        query: Tensor,
        reference_points: Tensor,
        input_flatten: Tensor,
        input_spatial_shapes: Tensor,
        input_level_start_index: Tensor,
        input_padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
        value, locations, logits = self._projections(query, reference_points, input_flatten, input_spatial_shapes,
                                                     input_padding_mask)
        # Softmax over all levels and points of a head together, as Deformable DETR.
        weights = torch.softmax(logits, -1).view(*logits.shape[:3], self.n_levels, self.n_points)
        output = ms_deform_attn(value, input_spatial_shapes, input_level_start_index, locations, weights,
                                self.im2col_step)
        return self.output_proj(output)

    def _projections(self, query: Tensor, reference_points: Tensor, input_flatten: Tensor,
                     input_spatial_shapes: Tensor, input_padding_mask: Optional[Tensor]):
        """The checked arguments' value [N, S, M, D] (padding pixels zeroed), sampling locations
        [N, Lq, M, L, P, 2] and attention logits [N, Lq, M, L * P]: what MSDeformAttn and FlashDeformAttn share."""
        self._check_forward_args(query, reference_points, input_flatten, input_spatial_shapes, input_padding_mask)
        batch, queries, _ = query.shape
        heads, levels, points = self.n_heads, self.n_levels, self.n_points
        value = self.value_proj(input_flatten)
        if input_padding_mask is not None:
            value = value.masked_fill(input_padding_mask[..., None], 0.0)
        value = value.view(batch, input_flatten.shape[1], heads, self.d_model // heads)
        offsets = self.sampling_offsets(query).view(batch, queries, heads, levels, points, 2)
        logits = self.attention_weights(query).view(batch, queries, heads, levels * points)
        return value, self._locations(reference_points, offsets, input_spatial_shapes), logits

    def _locations(self, reference_points: Tensor, offsets: Tensor, input_spatial_shapes: Tensor) -> Tensor:
        """The sampling locations [N, Lq, M, L, P, 2] from the reference points and the offsets."""
        if reference_points.shape[-1] == 2:
            # Offsets are in pixels of each level: (dx / W_l, dy / H_l).
            normalizer = torch.stack([input_spatial_shapes[..., 1], input_spatial_shapes[..., 0]], -1)  # [L, 2]
            return reference_points[:, :, None, :, None, :] + offsets / normalizer[None, None, None, :, None, :]
        # Boxes: offsets in units of half the box's size, divided by n_points so that the initial offsets (p + 1 for
        # point p) stay within the box.
        return (reference_points[:, :, None, :, None, :2]
                + offsets / self.n_points * reference_points[:, :, None, :, None, 2:] * 0.5)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_levels={self.n_levels}, n_heads={self.n_heads}, n_points={self.n_points}"
