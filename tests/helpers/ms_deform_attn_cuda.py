"""Shared by the tests of multi-scale deformable attention's CUDA kernels, in the CUDA simulation and on a GPU:
their inputs (Attention, make_attention), the shapes each exercising a part of the kernels, the float64
reference's results and the tolerances."""

from __future__ import annotations

from typing import List, NamedTuple, Sequence, Tuple

import torch

import deform_conv


class Attention(NamedTuple):
    value: torch.Tensor
    spatial_shapes: torch.Tensor
    level_start_index: torch.Tensor
    sampling_locations: torch.Tensor
    attention_weights: torch.Tensor

    def floats(self) -> List[torch.Tensor]:
        return [self.value, self.sampling_locations, self.attention_weights]

    def with_floats(self, value, locations, weights) -> "Attention":
        return self._replace(value=value, sampling_locations=locations, attention_weights=weights)


def make_attention(levels: Sequence[Tuple[int, int]], batch=2, heads=3, channels=5, queries=7, points=2,
                   dtype=torch.float64, seed=0) -> Attention:
    """Locations drawn over [-0.2, 1.2]: some outside the levels, most inside."""
    g = torch.Generator().manual_seed(seed)
    shapes = torch.tensor(levels, dtype=torch.int64).reshape(-1, 2)
    sizes = shapes[:, 0] * shapes[:, 1]
    starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    value = torch.randn(batch, int(sizes.sum()), heads, channels, generator=g, dtype=torch.float64)
    locations = torch.rand(batch, queries, heads, len(levels), points, 2, generator=g, dtype=torch.float64) * 1.4 - 0.2
    weights = torch.rand(batch, queries, heads, len(levels), points, generator=g, dtype=torch.float64)
    return Attention(value.to(dtype), shapes, starts, locations.to(dtype), weights.to(dtype))




def referenced(a: Attention, grad_output: torch.Tensor) -> List[torch.Tensor]:
    floats = [t.detach().double().requires_grad_() for t in a.floats()]
    out = deform_conv.ms_deform_attn_reference(floats[0], a.spatial_shapes, a.level_start_index, *floats[1:])
    return [out, *torch.autograd.grad(out, floats, grad_output)]


def grad_output_for(a: Attention, seed: int = 1) -> torch.Tensor:
    batch, _, heads, channels = a.value.shape
    shape = (batch, a.sampling_locations.shape[1], heads * channels)
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


NAMES = ("output", "grad_value", "grad_sampling_locations", "grad_attention_weights")
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5}



# Each shape names what it exercises in the kernels (ms_deform_attn/cuda/): the lane group an item gets (the
# smallest power of two covering the head's channels, at most 32) and what the levels look like.
SHAPES = {
    "one_lane": dict(levels=[(4, 6), (2, 3)], channels=1),
    "eight_lanes_five_channels": dict(levels=[(5, 7), (3, 3), (1, 1), (1, 4)], channels=5),
    "a_warp": dict(levels=[(6, 5), (3, 2)], channels=32, heads=2),
    "more_channels_than_a_warp": dict(levels=[(3, 4)], channels=40, heads=1),
    "one_of_everything": dict(levels=[(1, 1)], batch=1, heads=1, channels=3, queries=1, points=1),
    "odd_many_queries": dict(levels=[(2, 9), (4, 1)], channels=13, queries=101, heads=2, points=3, batch=1),
}
