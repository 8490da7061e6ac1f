"""Deformable DETR's level shapes under bfloat16 autocast, through the modules: MSDeformAttn and FlashDeformAttn
hand their op float32 sampling locations (reference points plus offsets over the level sizes), and the op keeps
them float32, so the error against float64 is that of the half-type Linear layers alone; rounding the locations
to bfloat16 as well (what the autocast rule did before) makes it several times larger."""

from __future__ import annotations

import pytest
import torch

import deform_conv
from deform_conv.nn import flash_deform_attn as flash_module
from deform_conv.nn import ms_deform_attn as msda_module

LEVELS = [(100, 150), (50, 75), (25, 38), (13, 19)]


def detr_inputs(g: torch.Generator):
    shapes = torch.tensor(LEVELS)
    starts = torch.cat([shapes.new_zeros(1), shapes.prod(1).cumsum(0)[:-1]])
    pixels = int(shapes.prod(1).sum())
    query = torch.randn(1, 300, 256, generator=g)
    reference = torch.rand(1, 300, 4, 2, generator=g)
    flatten = torch.randn(1, pixels, 256, generator=g)
    return query, reference, flatten, shapes, starts


def run(module, inputs, patch_module, name, round_locations: bool, seen: list):
    """The module's forward under bfloat16 autocast, recording the dtype of what reaches the op (and, to compare,
    rounding the locations to bfloat16 on the way)."""
    op = getattr(patch_module, name)

    def spy(*args):
        args = list(args)
        index = 3  # sampling_locations / sampling_loc_attn
        seen.append(args[index].dtype)
        if round_locations:
            if name == "ms_deform_attn":
                args[index] = args[index].bfloat16()
            else:  # the locations part of sampling_loc_attn
                points = args[index].shape[-1] // 3
                rounded = args[index][..., : 2 * points].bfloat16().to(args[index].dtype)
                args[index] = torch.cat([rounded, args[index][..., 2 * points:]], -1)
        return op(*args)

    setattr(patch_module, name, spy)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return module(*inputs).double()
    finally:
        setattr(patch_module, name, op)


@pytest.mark.parametrize("kind", ["MSDeformAttn", "FlashDeformAttn"])
def test_modules_keep_locations_float32_under_autocast(kind):
    g = torch.Generator().manual_seed(0)
    module = getattr(deform_conv.nn, kind)(256, 4, 8, 4)
    with torch.no_grad():  # offsets of a few pixels and uneven weights, as a trained layer's
        module.sampling_offsets.weight.normal_(0, 0.05, generator=g)
        module.attention_weights.weight.normal_(0, 0.05, generator=g)
    inputs = detr_inputs(g)
    exact = module.double()(*[t.double() if t.is_floating_point() else t for t in inputs])
    module.float()
    patch, name = (msda_module, "ms_deform_attn") if kind == "MSDeformAttn" else (flash_module, "flash_deform_attn")
    seen: list = []
    ours = (run(module, inputs, patch, name, False, seen) - exact).abs().max()
    rounded = (run(module, inputs, patch, name, True, seen) - exact).abs().max()
    assert seen[0] == torch.float32  # the locations reach the op in float32
    # Seen on a Sapphire Rapids Xeon: 0.017 (MSDeformAttn) and 0.018 (FlashDeformAttn), against 0.19 and 0.18 with
    # the locations rounded: about 10x; the test asks for 3x.
    assert ours * 3 < rounded, f"{kind}: error {float(ours)} with float32 locations, {float(rounded)} rounded"
