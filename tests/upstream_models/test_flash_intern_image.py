"""The DCNv4 repository's FlashInternImage (classification/models/flash_intern_image.py, an unchanged copy in
dcnv4_models/) on install_dcnv4()'s ``DCNv4`` package, CPU only, float64, tiny (channels 16, 64 x 80
images: H != W at every level, 16 x 20 down to 2 x 3).

Its ``import DCNv4`` binds our package (conftest.flash_intern_image_models), ``getattr(DCNv4, 'DCNv4')`` builds
deform_conv.nn.DCNv4 layers, and in eval and training mode (DropPath on, the same random draws for every model)
forward and backward are finite and equal, with the same weights:

- the same file on the DCNv4 repository's own DCNv4 module (dcnv4_modules/, on our DCNv4Function): the same op,
  so to float64 roundoff (1e-12 of the largest entry);
- the same model whose DCNv4 layers compute through deform_conv.dcnv3 (compiled) and through
  deform_conv.dcnv3_reference (pure PyTorch): DCNv4 is DCNv3 with, per group, a block of 3K offset_mask channels
  (2K offsets (x, y), then K mask values used as they are, no softmax) -- logits and every gradient to 1e-10 of
  the largest entry;
- each DCNv4 layer's output, as the model ran, against dcnv3_reference on that layer's input: 1e-10.

Variants: FlashInternImage-T's options; FlashInternImage-L's (configs/flash_intern_image_l_22kto1k_384.yaml:
post_norm, layer_scale, offset_scale 2, dw_kernel_size 3, dcn_output_bias, mlp_fc2_bias, with_cp as its
TRAIN.USE_CHECKPOINT); InternImage-H's (res_post_norm, level2_post_norm, center_feature_scale, dw_kernel_size 5;
the repository has no FlashInternImage-H config). Not run: use_clip_projector -- upstream's
forward_clip_projector permutes the already NCHW outputs of forward_features_seq_out again (``x4.permute(0, 3, 1,
2) # NHWC -> NCHW``), so dcnv3_head_x4's conv gets [N, W, C, H] and fails whatever the DCNv4 implementation.
"""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
from torch import nn

import deform_conv
from deform_conv.nn import DCNv4

pytestmark = [
    pytest.mark.filterwarnings("ignore:Importing from timm.models.layers:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`torch.cuda.amp.custom_:FutureWarning"),  # dcnv4_modules' functions
    # with_cp: upstream calls torch.utils.checkpoint.checkpoint without use_reentrant (reentrant, the default).
    pytest.mark.filterwarnings("ignore:torch.utils.checkpoint. the use_reentrant parameter:UserWarning"),
    # dcnv4_modules/modules/flash_deform_attn.py's docstring (imported by the fixture)
    pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:invalid escape sequence:SyntaxWarning"),  # the same, Python >= 3.12
]

F64 = torch.float64
TINY = dict(channels=16, depths=[1, 1, 1, 1], groups=[1, 2, 4, 8], num_classes=10, drop_path_rate=0.1)
VARIANTS = {
    # configs/flash_intern_image_t_1k_224.yaml (16 channels a group at every level, as upstream's module asserts)
    "T": dict(TINY, offset_scale=1.0),
    # configs/flash_intern_image_l_22kto1k_384.yaml; LAYER_SCALE there is 1e-5: 0.1 here, the same code, so that
    # the DCNv4 branches move the logits by more than the comparison's tolerance.
    "L": dict(TINY, layer_scale=0.1, offset_scale=2.0, post_norm=True, dw_kernel_size=3, dcn_output_bias=True,
              mlp_fc2_bias=True, with_cp=True),
    # InternImage-H's options (InternImage's configs), without use_clip_projector (see the docstring).
    "H_options": dict(TINY, depths=[1, 1, 2, 1], res_post_norm=True, level2_post_norm=True,
                      level2_post_norm_block_ids=[1], center_feature_scale=True, dw_kernel_size=5,
                      with_cp=True),
}
RELATIVE = 1e-10  # independent computations (dcnv3 / dcnv3_reference) against ours
SAME_OP = 1e-12  # upstream's DCNv4 module on our DCNv4Function against ours
FLOOR = 1e-13  # gradients that are 0 by construction (the stem's conv biases before training-mode BatchNorm)


def _max_abs(t: torch.Tensor) -> float:
    return t.detach().abs().max().item() if t.numel() else 0.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, relative: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = _max_abs(actual - expected)
    tol = relative * _max_abs(expected) + FLOOR
    assert error <= tol, f"{what}: max |difference| {error:.3e} > {tol:.3e} (max |expected| {_max_abs(expected):.3e})"


class DCNv4ThroughDCNv3(nn.Module):
    """A DCNv4 layer's parameters (the same objects: built by taking over its __dict__) computed through
    ``op`` (deform_conv.dcnv3 or dcnv3_reference): offset_mask's first group * 3K channels, per group 2K offsets
    then K mask values (the DCNv4 kernel's layout; the rest is padding to a multiple of 8)."""

    op = staticmethod(deform_conv.dcnv3)

    @classmethod
    def taking_over(cls, layer: nn.Module, op) -> "DCNv4ThroughDCNv3":
        module = cls.__new__(cls)
        module.__dict__.update(layer.__dict__)
        module.op = op
        return module

    def forward(self, input, shape=None):
        batch, length, channels = input.shape
        height, width = shape if shape is not None else (math.isqrt(length), math.isqrt(length))
        value = input if self.without_pointwise else self.value_proj(input)
        value = value.reshape(batch, height, width, channels)
        source = input
        if self.dw_kernel_size is not None:
            source = self.offset_mask_dw(input.reshape(batch, height, width, channels).permute(0, 3, 1, 2))
            source = source.permute(0, 2, 3, 1).reshape(batch, length, channels)
        points = self.kernel_size ** 2 - self.remove_center
        blocks = self.offset_mask(source).reshape(batch, height, width, -1)[..., : self.group * 3 * points]
        blocks = blocks.unflatten(-1, (self.group, 3 * points))
        offset = blocks[..., : 2 * points].flatten(-2)
        mask = blocks[..., 2 * points:].flatten(-2)
        out = self.op(value, offset, mask, self.kernel_size, self.stride, self.pad, self.dilation, self.group,
                      self.offset_scale, bool(self.remove_center))
        if self.center_feature_scale:  # never set by FlashInternImage (it does not pass it to core_op)
            scale = nn.functional.linear(out, self.center_feature_scale_proj_weight,
                                         self.center_feature_scale_proj_bias).sigmoid()
            scale = scale[..., None].repeat(1, 1, 1, 1, channels // self.group).flatten(-2)
            out = out * (1 - scale) + value * scale
        out = out.reshape(batch, length, -1)
        return out if self.without_pointwise else self.output_proj(out)


def _dcn_layers(model):
    return [block.dcn for level in model.levels for block in level.blocks]


def _through_dcnv3(model, op):
    reference = copy.deepcopy(model)
    for level in reference.levels:
        for block in level.blocks:
            block.dcn = DCNv4ThroughDCNv3.taking_over(block.dcn, op)
    return reference


def _randomize_offsets(model, seed: int) -> None:
    """Upstream initialises offset_mask to 0 (every point on its grid place, every mask value 0: the layers'
    outputs would be 0): random weights instead, offsets of about half a pixel times offset_scale."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for dcn in _dcn_layers(model):
            weight, bias = dcn.offset_mask.weight, dcn.offset_mask.bias
            weight.copy_(torch.randn(weight.shape, generator=generator, dtype=weight.dtype) * 0.5
                         / math.sqrt(weight.shape[1]))
            bias.copy_(torch.randn(bias.shape, generator=generator, dtype=bias.dtype) * 0.5)


def forward_and_grads(model, image, train: bool):
    """model(image) and the gradients of <logits, R> (R fixed random) w.r.t. the image and every parameter, by
    name. backward(), not autograd.grad: upstream's with_cp uses reentrant checkpointing. DropPath's draws come
    from a fixed seed (checkpointing replays them), inside fork_rng so no other test's RNG moves."""
    model.train(train)
    model.zero_grad(set_to_none=True)
    x = image.detach().clone().requires_grad_()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        logits = model(x)
    weights = torch.randn(logits.shape, dtype=logits.dtype, generator=torch.Generator().manual_seed(1))
    (logits * weights).sum().backward()
    grads = {"image": x.grad}
    grads.update({name: p.grad if p.grad is not None else torch.zeros_like(p)
                  for name, p in model.named_parameters()})
    return logits.detach(), grads


def assert_all_close(actual, expected, relative: float, what: str) -> None:
    logits_a, grads_a = actual
    logits_e, grads_e = expected
    assert_close(logits_a, logits_e, relative, f"{what}: logits")
    assert list(grads_a) == list(grads_e)
    for name in grads_e:
        assert_close(grads_a[name], grads_e[name], relative, f"{what}: grad {name}")


def _build(module, config, seed=0):
    torch.manual_seed(seed)
    return module.FlashInternImage(core_op="DCNv4", **config)


def test_flash_intern_image_imports_our_shim(flash_intern_image_models, upstream_dcnv4):
    """``import DCNv4`` in the unchanged file bound install_dcnv4()'s package, whose DCNv4 is deform_conv.nn.DCNv4;
    no ``DCNv4`` is left in sys.modules by the fixture."""
    ours = flash_intern_image_models.ours
    assert ours.DCNv4 is flash_intern_image_models.shim
    assert ours.DCNv4.DCNv4 is DCNv4 and ours.DCNv4.__name__ == "DCNv4"
    assert flash_intern_image_models.upstream.DCNv4.DCNv4 is upstream_dcnv4.DCNv4
    shim_modules = (flash_intern_image_models.shim, flash_intern_image_models.shim.ext,
                    flash_intern_image_models.shim.functions, flash_intern_image_models.shim.modules)
    for name in ("DCNv4", "DCNv4.ext", "DCNv4.functions", "DCNv4.modules"):
        assert all(sys.modules.get(name) is not module for module in shim_modules), name


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_flash_intern_image_on_shim(flash_intern_image_models, upstream_dcnv4, variant, capsys):
    """The model on our shim: same state_dict as on upstream's DCNv4 module after the same seed; then, offsets
    randomised, float64, eval and training mode: finite, offset_mask reached by the gradient, each DCNv4 layer's
    output equal to dcnv3_reference's, logits and every gradient equal to those of upstream's module (1e-12) and
    of the model computing through dcnv3 and dcnv3_reference (1e-10)."""
    ours = _build(flash_intern_image_models.ours, variant)
    upstream = _build(flash_intern_image_models.upstream, variant)
    capsys.readouterr()  # the constructor's prints
    assert all(type(dcn) is DCNv4 for dcn in _dcn_layers(ours))
    assert all(type(dcn) is upstream_dcnv4.DCNv4 for dcn in _dcn_layers(upstream))
    assert len(_dcn_layers(ours)) == sum(variant["depths"])
    # Same state_dict (keys, dtypes, values) after the same seed: the constructors draw alike, _init_deform_weights
    # calls our _reset_parameters as upstream's.
    state_ours, state_up = ours.state_dict(), upstream.state_dict()
    assert list(state_ours) == list(state_up)
    for key in state_up:
        assert state_ours[key].dtype == state_up[key].dtype and torch.equal(state_ours[key], state_up[key]), key

    ours = ours.to(F64)
    _randomize_offsets(ours, seed=3)
    upstream = upstream.to(F64)
    upstream.load_state_dict(ours.state_dict(), strict=True)
    through_dcnv3 = _through_dcnv3(ours, deform_conv.dcnv3)
    through_reference = _through_dcnv3(ours, deform_conv.dcnv3_reference)
    image = torch.randn(2, 3, 64, 80, dtype=F64, generator=torch.Generator().manual_seed(2))

    for train in (False, True):
        mode = "train" if train else "eval"
        # Each mode from the same state (training mode updates the BatchNorms' running statistics).
        models = [copy.deepcopy(m) for m in (ours, upstream, through_dcnv3, through_reference)]
        inputs = []
        hooks = [dcn.register_forward_hook(lambda module, args, output: inputs.append((module, args, output)))
                 for dcn in _dcn_layers(models[0])]
        result_ours = forward_and_grads(models[0], image, train)
        for hook in hooks:
            hook.remove()

        logits, grads = result_ours
        assert torch.isfinite(logits).all() and all(torch.isfinite(g).all() for g in grads.values())
        dcn_names = [name for name, module in models[0].named_modules() if isinstance(module, DCNv4)]
        assert len(dcn_names) == sum(variant["depths"])
        for name in dcn_names:  # the offsets and mask values took part: offset_mask got gradient in every layer
            assert _max_abs(grads[f"{name}.offset_mask.weight"]) > 0, name

        # Each layer's output as the model ran (with_cp: the checkpoint's recomputation calls it again, with the
        # same input) against dcnv3_reference on its input, with its own parameters.
        assert len(inputs) >= len(_dcn_layers(models[0]))
        for module, args, output in inputs:
            with torch.no_grad():
                expected = DCNv4ThroughDCNv3.taking_over(module, deform_conv.dcnv3_reference)(*args)
            assert_close(output, expected, RELATIVE, f"{mode}: layer output vs dcnv3_reference")

        assert_all_close(result_ours, forward_and_grads(models[1], image, train), SAME_OP,
                         f"{mode}, vs upstream's DCNv4 module")
        assert_all_close(result_ours, forward_and_grads(models[2], image, train), RELATIVE,
                         f"{mode}, vs deform_conv.dcnv3")
        assert_all_close(result_ours, forward_and_grads(models[3], image, train), RELATIVE,
                         f"{mode}, vs deform_conv.dcnv3_reference")

