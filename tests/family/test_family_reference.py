"""dcnv3, dcnv4 and flash_deform_attn (the compiled CPU ops) against their float64 references, forward and every
gradient (autograd through the reference), on awkward geometry: unequal kernel sides, stride, padding, dilation,
odd channel counts, remove_center, offsets far outside the image, offset_scale, batch 0, a non-contiguous input;
dcnv4 with and without its softmax and with padding channels; flash_deform_attn over 1 and 3 levels. Then float32
against float64 within a bound derived from float32's eps, and the ops against each other: dcnv3 through dcnv4
(bitwise) and flash_deform_attn as a softmax plus ms_deform_attn."""

from __future__ import annotations

import pytest
import torch

from helpers.family import (GRAD_NAMES, PUBLIC, REFERENCE, Case, assert_all_close, assert_identical, assert_within,
                            dcnv4_from_dcnv3, float32_bound, make_dcnv3, make_dcnv4, make_flash, output_and_grads,
                            softmax_then_ms_deform_attn, unpack_offset_mask)

import deform_conv

TOL = dict(rtol=1e-10, atol=1e-10)  # float64: what the arithmetic allows (rounding ~1e-15), never widened

# make_dcnv3's keywords; the default is kernel 3x2, stride (2, 1), padding (1, 0), dilation (2, 1), group 3 of 5
# channels, input 7x6, offsets N(0, 1.5).
GEOMETRIES = {
    "k3x2_s21_p10_d21_g3c5": dict(),
    "k2x3_g1c3_scale0.5": dict(kernel=(2, 3), stride=1, padding=(0, 1), dilation=(1, 2), group=1, group_channels=3,
                               offset_scale=0.5),
    "k1x1_g3c1": dict(kernel=1, stride=(2, 1), padding=0, dilation=1, group=3, group_channels=1, size=(5, 4)),
    "k5x5_K25_g1c71": dict(kernel=5, stride=1, padding=2, dilation=1, group=1, group_channels=71, size=(5, 4),
                           batch=1),
    "remove_center_3x3_scale2": dict(kernel=3, stride=1, padding=1, dilation=(2, 1), group=3, group_channels=3,
                                     remove_center=True, offset_scale=2.0),
    "k1x1_remove_center_K0": dict(kernel=1, stride=1, padding=(1, 0), dilation=1, remove_center=True),
    "offsets_N0_10": dict(offset_std=10.0),
    "offsets_pm1e6": dict(far_fraction=0.5, offset_scale=0.5),
    "batch0": dict(batch=0),
}

# make_flash's keywords: levels of unequal sizes (1x1 among them), n_points 1 and 4, no queries, no images.
FLASH_CASES = {
    "1_level_4_points": dict(levels=((5, 7),), n_points=4),
    "3_levels_1_point": dict(levels=((5, 7), (1, 1), (3, 2)), n_points=1),
    "3_levels_4_points": dict(levels=((5, 7), (1, 1), (3, 2)), n_points=4, group=1, channels=3),
    "far_outside": dict(levels=((4, 3), (2, 5)), n_points=2, low=-40.0, high=40.0),
    "no_queries": dict(queries=0),
    "batch0": dict(batch=0),
}


def assert_matches_reference(case: Case) -> None:
    assert_all_close(output_and_grads(PUBLIC[case.op], case), output_and_grads(REFERENCE[case.op], case),
                     GRAD_NAMES[case.op], **TOL)


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_dcnv3_matches_the_reference(geometry):
    assert_matches_reference(make_dcnv3(**GEOMETRIES[geometry]))


@pytest.mark.parametrize("softmax", [False, True], ids=["mask", "softmax"])
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_dcnv4_matches_the_reference(geometry, softmax):
    """P = group * K * 3 + 5: the 5 padding channels are ignored and get exactly zero gradient."""
    case = make_dcnv4(softmax=softmax, extra_channels=5, **GEOMETRIES[geometry])
    assert_matches_reference(case)
    grad_offset_mask = output_and_grads(PUBLIC["dcnv4"], case)[2]
    assert torch.equal(grad_offset_mask[..., -5:], torch.zeros_like(grad_offset_mask[..., -5:]))


@pytest.mark.parametrize("name", sorted(FLASH_CASES))
def test_flash_deform_attn_matches_the_reference(name):
    assert_matches_reference(make_flash(**FLASH_CASES[name]))


def test_every_point_far_outside_gives_zero_output_and_zero_gradients():
    """Offsets of +-1e6 everywhere: nothing is sampled, so output and every gradient vanish."""
    case = make_dcnv3(far_fraction=1.0)
    for name, t in zip(GRAD_NAMES["dcnv3"], output_and_grads(PUBLIC["dcnv3"], case)):
        assert torch.equal(t, torch.zeros_like(t)), name


@pytest.mark.parametrize("op", ["dcnv3", "dcnv4", "flash_deform_attn"])
def test_non_contiguous_arguments(op):
    """A non-contiguous input (value) and point tensor, the same values: the same results as the reference."""
    case = make_dcnv3() if op == "dcnv3" else make_dcnv4(softmax=True) if op == "dcnv4" else make_flash()
    floats = case.floats()
    value = floats[0].transpose(1, 2).contiguous().transpose(1, 2)
    points = [torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0] for t in floats[1:]]
    assert not value.is_contiguous() and not any(t.is_contiguous() for t in points)
    strided = case.with_floats([value, *points])
    assert_matches_reference(strided)
    assert_all_close(output_and_grads(PUBLIC[op], strided), output_and_grads(PUBLIC[op], case), GRAD_NAMES[op],
                     rtol=0, atol=0)


# ---------------------------------------------------------------------------------- float32 vs float64


FLOAT32_CASES = {
    "dcnv3_awkward": lambda: make_dcnv3(),
    "dcnv3_K25_c71": lambda: make_dcnv3(**GEOMETRIES["k5x5_K25_g1c71"]),
    "dcnv3_remove_center": lambda: make_dcnv3(**GEOMETRIES["remove_center_3x3_scale2"]),
    "dcnv4_softmax": lambda: make_dcnv4(softmax=True, extra_channels=3),
    "dcnv4_mask_scale0.5": lambda: make_dcnv4(**GEOMETRIES["k2x3_g1c3_scale0.5"]),
    "flash_3_levels": lambda: make_flash(),
}


@pytest.mark.parametrize("name", sorted(FLOAT32_CASES))
def test_float32_forward_within_the_float32_bound(name):
    """float32 against the float64 reference on the same float32 arguments, element by element, within the
    rounding bound of helpers/family.py's float32_bound (derived from float32's eps, nothing added)."""
    case = FLOAT32_CASES[name]().to(torch.float32)
    out = PUBLIC[case.op](*case.args)
    assert out.dtype == torch.float32
    assert_within(out, REFERENCE[case.op](*case.double().args), float32_bound(case), name)


# ------------------------------------------------------------------------------------- the ops together


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("geometry", ["k3x2_s21_p10_d21_g3c5", "remove_center_3x3_scale2", "k5x5_K25_g1c71"])
def test_dcnv3_through_dcnv4_is_dcnv3_bit_for_bit(geometry, dtype):
    """dcnv4 without softmax, on dcnv3's offsets and mask packed as its offset_mask (plus padding channels): the
    same output and the same gradients, bit for bit (the unpacked gradient of offset_mask)."""
    case3 = make_dcnv3(dtype, **GEOMETRIES[geometry])
    case4 = dcnv4_from_dcnv3(case3, softmax=False, extra_channels=2)
    out3, grad_input3, grad_offset3, grad_mask3 = output_and_grads(PUBLIC["dcnv3"], case3)
    out4, grad_input4, grad_offset_mask = output_and_grads(PUBLIC["dcnv4"], case4)
    group, kernel = case3.args[7], case3.args[3]
    k = kernel[0] * kernel[1] - (1 if case3.args[9] else 0)
    grad_offset4, grad_mask4 = unpack_offset_mask(grad_offset_mask, group, k)
    assert_identical([out4, grad_input4, grad_offset4, grad_mask4], [out3, grad_input3, grad_offset3, grad_mask3],
                     GRAD_NAMES["dcnv3"])


@pytest.mark.parametrize("name", ["1_level_4_points", "3_levels_1_point", "3_levels_4_points"])
def test_flash_deform_attn_is_softmax_then_ms_deform_attn(name):
    """flash_deform_attn(sampling_loc_attn) = ms_deform_attn(locations, softmax(logits)), its logits one softmax
    over a group's levels and points: the same output and gradients in float64."""
    case = make_flash(**FLASH_CASES[name])
    n_points = case.args[4]
    assert n_points == FLASH_CASES[name]["n_points"]
    assert_all_close(output_and_grads(PUBLIC["flash_deform_attn"], case),
                     output_and_grads(softmax_then_ms_deform_attn, case),
                     GRAD_NAMES["flash_deform_attn"], **TOL)


def test_points_read_in_place_equal_the_materialised_ones_bitwise():
    """The CPU forward reads each point in place from the offsets and mask (sampled_sum's grid_forward) where they
    share one dtype, the points' or the input's (and beside the softmax's output, under dcnv4's softmax, where
    offset_mask has the points' dtype); otherwise (here: float32 offsets beside a bfloat16 mask, and a bfloat16
    offset_mask under the softmax) it materialises the points first (grid_points). The same values must give the
    same bits, for dcnv3 and dcnv4.
    (The outputs are bfloat16: a difference of an ulp of float32 in a coordinate would mostly round away; what
    this catches is a point read from the wrong place or computed another way.)"""
    g = torch.Generator().manual_seed(0)
    n, h, w, group, channels, kernel, stride, padding, dilation = 2, 9, 8, 3, 5, (3, 2), (2, 1), (1, 0), (2, 1)
    k = kernel[0] * kernel[1]
    ho, wo = (h + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1, w - 1
    x = torch.randn(n, h, w, group * channels, generator=g).bfloat16()
    offset = (3 * torch.randn(n, ho, wo, group * k * 2, generator=g)).bfloat16()
    mask = torch.rand(n, ho, wo, group * k, generator=g).bfloat16()
    geometry = (kernel, stride, padding, dilation, group, 1.7)
    materialised = deform_conv.dcnv3(x, offset.float(), mask, *geometry)
    blocks = torch.cat([offset.view(n, ho, wo, group, 2 * k), mask.view(n, ho, wo, group, k)], -1).flatten(3)
    offset_mask = torch.cat([blocks, torch.randn(n, ho, wo, 3, generator=g).bfloat16()], -1)
    in_place = {
        "dcnv3, float32 offsets and mask": deform_conv.dcnv3(x, offset.float(), mask.float(), *geometry),
        "dcnv3, bfloat16 offsets and mask": deform_conv.dcnv3(x, offset, mask, *geometry),
        "dcnv4, float32 offset_mask": deform_conv.dcnv4(x, offset_mask.float(), *geometry),
        "dcnv4, bfloat16 offset_mask": deform_conv.dcnv4(x, offset_mask, *geometry),
    }
    for name, out in in_place.items():
        assert torch.equal(out, materialised), name
    # Under dcnv4's softmax: float32 offset_mask in place beside the softmax's output; bfloat16 materialised.
    assert torch.equal(deform_conv.dcnv4(x, offset_mask.float(), *geometry, False, True),
                       deform_conv.dcnv4(x, offset_mask, *geometry, False, True))


def test_gradients_of_points_read_in_place_equal_the_materialised_ones_bitwise():
    """The CPU backward too reads the points in place and writes their gradients into the offsets' and the mask's
    layouts (sampled_sum's grid_backward) where the forward reads them in place; otherwise it materialises the
    points and carries their gradients back (grid_points_backward). The same values must give the same bits:
    float32 offsets and mask (in place) against float32 offsets beside a bfloat16 mask (materialised), and dcnv4's
    offset_mask in place against the same through dcnv3, padding included."""
    g = torch.Generator().manual_seed(1)
    n, h, w, group, channels, kernel, stride, padding, dilation = 2, 9, 8, 3, 5, (3, 2), (2, 1), (1, 0), (2, 1)
    k = kernel[0] * kernel[1]
    ho, wo = (h + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1, w - 1
    x = torch.randn(n, h, w, group * channels, generator=g).bfloat16()
    offset = 3 * torch.randn(n, ho, wo, group * k * 2, generator=g)
    offset[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -1.0])  # NaN, outside, on the border
    mask = torch.rand(n, ho, wo, group * k, generator=g).bfloat16()
    grad_output = torch.randn(n, ho, wo, group * channels, generator=g).bfloat16()
    geometry = (kernel, stride, padding, dilation, group, 1.7)

    def same(actual, expected):  # bitwise, NaN where NaN
        assert actual.dtype == expected.dtype and torch.equal(actual.isnan(), expected.isnan())
        assert torch.equal(actual.nan_to_num(), expected.nan_to_num())

    def gradients(op, *tensors):
        tensors = [t.detach().clone().requires_grad_() for t in tensors]
        op(*tensors, *geometry).backward(grad_output)
        return [t.grad for t in tensors]

    gx, goffset, gmask = gradients(deform_conv.dcnv3, x, offset, mask)  # materialised: a bfloat16 mask
    in_place = gradients(deform_conv.dcnv3, x, offset, mask.float())
    assert in_place[2].dtype == torch.float32 and gmask.dtype == torch.bfloat16
    same(in_place[0], gx)
    same(in_place[1], goffset)
    same(in_place[2].bfloat16(), gmask)
    blocks = torch.cat([offset.view(n, ho, wo, group, 2 * k), mask.float().view(n, ho, wo, group, k)], -1)
    offset_mask = torch.cat([blocks.flatten(3), torch.randn(n, ho, wo, 3, generator=g)], -1)
    gx4, gom = gradients(deform_conv.dcnv4, x, offset_mask)
    same(gx4, gx)
    grad_blocks = gom[..., : group * 3 * k].view(n, ho, wo, group, 3 * k)
    same(grad_blocks[..., : 2 * k].flatten(3), goffset)
    same(grad_blocks[..., 2 * k:].flatten(3).bfloat16(), gmask)
    assert torch.equal(gom[..., group * 3 * k:], torch.zeros(n, ho, wo, 3))
    assert goffset.isnan().any() and not goffset.isnan().all()


def test_an_input_without_pixels_samples_zero_on_every_path():
    """An input of no rows whose padding still gives output pixels (1x1 kernel, padding 1): every point lies
    outside it, so the output is the reference's 0 and so are the offsets' and mask's gradients, whichever path
    the call takes: the points read in place, materialised (float32 offsets beside a bfloat16 mask), or under
    dcnv4's softmax, whose forward reads them in place and whose backward materialises them. Before, the
    materialised path sampled NaN from the empty level."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 0, 4, 4, generator=g)
    offset, mask = torch.randn(1, 2, 6, 2, generator=g), torch.rand(1, 2, 6, 1, generator=g)
    geometry = (1, 1, 1, 1, 1, 1.0)
    expected = deform_conv.dcnv3_reference(x.double(), offset.double(), mask.double(), *geometry)
    assert expected.shape == (1, 2, 6, 4) and torch.equal(expected, torch.zeros_like(expected))
    for x_, mask_ in ((x, mask), (x.bfloat16(), mask.bfloat16())):
        tensors = [t.clone().requires_grad_() for t in (x_, offset, mask_)]
        out = deform_conv.dcnv3(*tensors, *geometry)
        out.float().sum().backward()
        assert torch.equal(out.float(), torch.zeros(1, 2, 6, 4)), mask_.dtype
        for t in tensors[1:]:
            assert torch.equal(t.grad.float(), torch.zeros_like(t.grad.float())), mask_.dtype
    offset_mask = torch.randn(1, 2, 6, 4, generator=g).requires_grad_()
    out = deform_conv.dcnv4(x, offset_mask, *geometry, False, True)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(1, 2, 6, 4))
    assert torch.equal(offset_mask.grad, torch.zeros_like(offset_mask.grad))

def test_flash_and_ms_deform_attn_read_locations_through_one_path_bitwise():
    """On the CPU flash_deform_attn and ms_deform_attn (a bfloat16 value, its float32 weights beside locations in
    float32 or bfloat16) read each point in place from the locations, through the family's level_forward and
    level_backward, whose points are location * size - 0.5 in float32 (as points.cpp's level_points materialises
    them for the CUDA backend). The same values must give the same bits: the output and the gradients of value
    and locations, NaN and infinite locations among them."""
    g = torch.Generator().manual_seed(0)
    n, lq, group, channels, n_points = 2, 7, 3, 5, 2
    spatial_shapes = torch.tensor([[6, 5], [3, 4], [1, 2]])
    level_start_index = torch.tensor([0, 30, 42])
    levels, points = 3, 3 * n_points
    value = torch.randn(n, 44, group, channels, generator=g).bfloat16()
    locations = 1.4 * torch.rand(n, lq, group, points, 2, generator=g) - 0.2
    locations[0, 0, 0, 0, 0] = float("nan")
    locations[1, 2, 1, 3, 1] = float("inf")
    logits = torch.randn(n, lq, group, points, generator=g)
    grad = torch.randn(n, lq, group * channels, generator=g).bfloat16()
    for location_dtype in (torch.float32, torch.bfloat16):
        loc = locations.to(location_dtype)
        flash_value, flash_input = value.clone().requires_grad_(), torch.cat([loc.flatten(3),
                                                                             logits.to(location_dtype)], -1)
        flash_input.requires_grad_()
        flash = deform_conv.flash_deform_attn(flash_value, spatial_shapes, level_start_index, flash_input, n_points)
        flash.backward(grad)
        msda_value, msda_loc = value.clone().requires_grad_(), loc.view(n, lq, group, levels, n_points, 2).clone()
        msda_loc.requires_grad_()
        weights = logits.to(location_dtype).float().softmax(-1).view(n, lq, group, levels, n_points)
        msda = deform_conv.ms_deform_attn(msda_value, spatial_shapes, level_start_index, msda_loc, weights)
        msda.backward(grad)
        flash_loc_grad = flash_input.grad[..., : 2 * points].reshape(msda_loc.shape)
        for a, b in ((flash, msda), (flash_value.grad, msda_value.grad), (flash_loc_grad, msda_loc.grad)):
            assert torch.equal(a.isnan(), b.isnan()), location_dtype
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), location_dtype
        assert flash.isnan().any() and not flash.isnan().all()
