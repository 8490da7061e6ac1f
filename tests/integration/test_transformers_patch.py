"""deform_conv.compat.patch_transformers: transformers' multi-scale deformable attention through our op, on a tiny
randomly initialised Deformable DETR (no download: a ResNet backbone from transformers' own classes), and on
Mask2Former's function, against transformers' own grid_sample code."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DeformableDetrConfig, DeformableDetrModel, ResNetConfig
from transformers.models.deformable_detr import modeling_deformable_detr
from transformers.models.mask2former import modeling_mask2former

import deform_conv
from deform_conv.compat import patch_transformers, transformers_patched, unpatch_transformers

from helpers.common import TOLERANCES

DETR_CLASS = "transformers.models.deformable_detr.modeling_deformable_detr.MultiScaleDeformableAttention"
MASK2FORMER_FUNCTION = "transformers.models.mask2former.modeling_mask2former.multi_scale_deformable_attention"
OWN_FORWARD = modeling_deformable_detr.MultiScaleDeformableAttention.forward  # as imported, before any patch
OWN_FUNCTION = modeling_mask2former.multi_scale_deformable_attention


@pytest.fixture(autouse=True)
def unpatched():
    unpatch_transformers()
    yield
    unpatch_transformers()


@pytest.fixture(autouse=True)
def one_thread():
    """The model's tensors are tiny: with a second intra-op thread every op waits for it, which on a busy 2-core
    machine took the Deformable DETR test from 0.05 s to 2 s a pass."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def op_calls(prof) -> dict:
    """How many times the profiled code ran each of our ops (a reference fallback would run none)."""
    counts = {e.key: e.count for e in prof.key_averages()}
    return {name: counts.get(f"deform_conv::{name}", 0) for name in ("ms_deform_attn", "ms_deform_attn_backward")}


def tiny_detr() -> DeformableDetrModel:
    """1 encoder and 1 decoder layer, d_model 32 (the input projection's GroupNorm has 32 groups), 2 heads, 3 levels,
    2 points, 4 queries, on a 4-stage ResNet of basic blocks; float64 so that the two implementations agree to
    rounding."""
    backbone = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1],
                            layer_type="basic", out_features=["stage2", "stage3", "stage4"])
    config = DeformableDetrConfig(
        backbone_config=backbone, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, num_queries=4, num_feature_levels=3,
        encoder_n_points=2, decoder_n_points=2, dropout=0.0,
    )
    torch.manual_seed(0)
    model = DeformableDetrModel(config).double().eval()
    # At initialisation the offsets are the bias alone, whole pixels, so the encoder's points land exactly on pixel
    # centres: the kinks of bilinear interpolation, where the derivative in x or y jumps and which side an
    # implementation takes depends on the rounding of its own arithmetic (grid_sample computes
    # ((2 * loc - 1 + 1) * W - 1) / 2, Deformable DETR's kernel and ours loc * W - 0.5). Query-dependent offsets
    # move the points off them, as training does.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, modeling_deformable_detr.DeformableDetrMultiscaleDeformableAttention):
                module.sampling_offsets.weight.normal_(std=0.1)
    return model


def detr_outputs_and_grads(model, pixel_values, pixel_mask):
    """The encoder's and decoder's last hidden states, and the gradients of a fixed random projection of them w.r.t.
    the image and every trainable parameter."""
    pixels = pixel_values.detach().clone().requires_grad_()
    params = [p for p in model.parameters() if p.requires_grad]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = model(pixel_values=pixels, pixel_mask=pixel_mask)
        hidden = (out.last_hidden_state, out.encoder_last_hidden_state)
        g = torch.Generator().manual_seed(3)
        loss = sum((h * torch.randn(h.shape, dtype=h.dtype, generator=g)).sum() for h in hidden)
        grads = torch.autograd.grad(loss, [pixels, *params])
    return [h.detach() for h in hidden] + list(grads), op_calls(prof)


def test_deformable_detr_gives_the_same_outputs_and_gradients_through_our_op():
    model = tiny_detr()
    g = torch.Generator().manual_seed(1)
    pixel_values = torch.randn(2, 3, 32, 40, dtype=torch.float64, generator=g)
    pixel_mask = torch.ones(2, 32, 40, dtype=torch.long)
    pixel_mask[1, :, 28:] = 0  # image 1 is padded on the right: the attention's padding mask is not all False
    expected, calls = detr_outputs_and_grads(model, pixel_values, pixel_mask)
    assert calls == {"ms_deform_attn": 0, "ms_deform_attn_backward": 0}  # transformers' own code
    with transformers_patched() as names:
        assert DETR_CLASS in names
        actual, calls = detr_outputs_and_grads(model, pixel_values, pixel_mask)
    # Once in the encoder layer, once in the decoder layer's cross-attention; forward and backward.
    assert calls == {"ms_deform_attn": 2, "ms_deform_attn_backward": 2}
    names = ["last_hidden_state", "encoder_last_hidden_state", "grad_pixel_values",
             *[f"grad_{n}" for n, p in model.named_parameters() if p.requires_grad]]
    assert len(actual) == len(expected) == len(names)
    rtol, atol = TOLERANCES[torch.float64]
    for name, a, e in zip(names, actual, expected):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    assert modeling_deformable_detr.MultiScaleDeformableAttention.forward is OWN_FORWARD  # restored on exit


def test_mask2formers_function_gives_the_same_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 7), (3, 2), (2, 4)]
    value = torch.randn(2, sum(h * w for h, w in shapes), 2, 4, dtype=torch.float64, generator=g)
    locations = 1.4 * torch.rand(2, 6, 2, 3, 2, 2, dtype=torch.float64, generator=g) - 0.2  # past every border
    weights = torch.rand(2, 6, 2, 3, 2, dtype=torch.float64, generator=g)
    grad_output = torch.randn(2, 6, 2 * 4, dtype=torch.float64, generator=g)

    def run():
        leaves = [t.clone().requires_grad_() for t in (value, locations, weights)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            # Looked up on the module at call time, as Mask2Former's pixel decoder does.
            out = modeling_mask2former.multi_scale_deformable_attention(leaves[0], shapes, leaves[1], leaves[2])
            grads = torch.autograd.grad(out, leaves, grad_output)
        return [out.detach(), *grads], op_calls(prof)

    expected, calls = run()
    assert calls["ms_deform_attn"] == 0
    assert MASK2FORMER_FUNCTION in patch_transformers()
    actual, calls = run()
    assert calls == {"ms_deform_attn": 1, "ms_deform_attn_backward": 1}
    rtol, atol = TOLERANCES[torch.float64]
    for name, a, e in zip(["output", "grad_value", "grad_sampling_locations", "grad_attention_weights"],
                          actual, expected):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_patch_is_idempotent_and_undone_exactly():
    first = patch_transformers()
    assert DETR_CLASS in first and MASK2FORMER_FUNCTION in first
    assert "transformers.models.grounding_dino.modeling_grounding_dino.MultiScaleDeformableAttention" in first
    patched_forward = modeling_deformable_detr.MultiScaleDeformableAttention.forward
    assert patched_forward is not OWN_FORWARD
    assert patch_transformers() == first  # nothing more to do, the same answer
    assert modeling_deformable_detr.MultiScaleDeformableAttention.forward is patched_forward
    # A context inside a patch leaves it patched on exit; unpatching restores transformers' own objects.
    with transformers_patched() as names:
        assert names == first
    assert modeling_deformable_detr.MultiScaleDeformableAttention.forward is patched_forward
    assert unpatch_transformers() == first
    assert modeling_deformable_detr.MultiScaleDeformableAttention.forward is OWN_FORWARD
    assert modeling_mask2former.multi_scale_deformable_attention is OWN_FUNCTION
    assert unpatch_transformers() == ()


def test_a_copy_with_another_signature_is_left_alone(monkeypatch):
    cls = modeling_deformable_detr.MultiScaleDeformableAttention

    def changed(self, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return value

    monkeypatch.setattr(cls, "forward", changed)
    with pytest.warns(UserWarning, match=r"left transformers\.models\.deformable_detr\.modeling_deformable_detr\."
                                         r"MultiScaleDeformableAttention unchanged: its parameters"):
        names = patch_transformers()
    assert DETR_CLASS not in names and cls.forward is changed


def test_importing_deform_conv_does_not_import_transformers():
    code = ("import sys, deform_conv, deform_conv.compat; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'; "
            "assert 'MultiScaleDeformableAttention' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert deform_conv.compat.__name__ == "deform_conv.compat"


def test_finding_nothing_to_patch_is_a_warning(monkeypatch):
    """As with a transformers older than its MultiScaleDeformableAttention class: nothing found, nothing patched."""
    monkeypatch.setattr(deform_conv.compat.transformers_patch, "_transformers_targets", lambda: [])
    with pytest.warns(UserWarning, match=r"patch_transformers: transformers \S+ has no MultiScaleDeformableAttention "
                                         r"class nor multi_scale_deformable_attention function .* nothing was patched"):
        assert patch_transformers() == ()
