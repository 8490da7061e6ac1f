"""Property tests of the DCNv3/DCNv4 family (dcnv3, dcnv4 and flash_deform_attn, the compiled CPU ops) on random
geometry: agreement with the float64 references, forward and every gradient (autograd through the reference), and
invariances that hold exactly or to float64's rounding: zero offsets make dcnv3 a sum of shifted (zero-padded)
inputs, permuting the groups permutes the output's channel blocks, dcnv4 without softmax is dcnv3 bit for bit,
flash_deform_attn is a softmax then ms_deform_attn, doubling the mask doubles the output; and the CPU backward is
deterministic (the same bits on every call and for any thread count).

Geometry drawn: kernel sides 1-4 (unequal allowed), stride 1-3, padding 0-2, dilation 1-3, group 1-3 of 1-4
channels, batch 0-2, input sides from the smallest that leaves one output pixel up, offset_scale from a few values
(0 and a negative one among them), remove_center with odd kernels only, offsets N(0, std <= 5) pixels, some rounded
to integers (pixel centres and the kinks of the bilinear weights) and some +-1e6 (far outside); dcnv4 with 0-3
padding channels and its softmax on or off.

Profiles (selected by $HYPOTHESIS_PROFILE, default "ci"):
  ci        400 examples of each agreement with a reference and 100 of each invariance, derandomized (the same
            examples every run): 7-12 s on 2 cores, depending on the load;
  thorough  10,000 of each, random (a new draw every run; failures are kept in .hypothesis/ and replayed),
            about 3.5 min:
            HYPOTHESIS_PROFILE=thorough pytest tests/family/test_family_properties.py
A failure prints the drawn Spec (every size, flag and seed that rebuilds the tensors) and a reproduce_failure blob.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from helpers.common import hypothesis_profile
from helpers.family import (GRAD_NAMES, PUBLIC, REFERENCE, Case, assert_all_close, assert_identical,
                            dcnv4_from_dcnv3, grad_output_for, make_dcnv3, make_flash, out_size, output_and_grads,
                            softmax_then_ms_deform_attn, unpack_offset_mask)


PROFILE = hypothesis_profile(400)
INVARIANCE = settings(PROFILE, max_examples=max(1, PROFILE.max_examples // 4))

TOL = dict(rtol=1e-10, atol=1e-10)  # float64 against float64: what the arithmetic allows, never widened
# Two float64 sums of the same terms in another order (the zero-offset sum, flash as softmax + ms_deform_attn).
ROUNDING = dict(rtol=1e-12, atol=1e-12)

# offset_scale: 1 (InternImage's), powers of two (exact), one that rounds, 0 (every point on its base) and a
# negative one (the grid mirrored about each base).
OFFSET_SCALES = (1.0, 0.5, 2.0, 1.7, 0.0, -0.75)
# Mostly images, a few empty batches (shrinks towards 1).
BATCHES = (1, 2) * 2 + (0,)


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything one dcnv3/dcnv4 example draws; build() turns it into a Case (make_dcnv3's tensors)."""

    batch: int
    size: Tuple[int, int]
    group: int
    group_channels: int
    kernel: Tuple[int, int]
    stride: Tuple[int, int]
    padding: Tuple[int, int]
    dilation: Tuple[int, int]
    offset_scale: float
    remove_center: bool
    offset_std: float
    far_fraction: float     # offsets replaced by +-1e6
    round_offsets: bool     # offsets rounded to integers: on pixel centres and kinks where offset_scale is 1
    seed: int
    softmax: bool = False   # dcnv4 only
    extra_channels: int = 0  # dcnv4 only: padding channels after the last group's block

    @property
    def out_size(self) -> Tuple[int, int]:
        return out_size(self.size, self.kernel, self.stride, self.padding, self.dilation)

    @property
    def points(self) -> int:
        return self.kernel[0] * self.kernel[1] - (1 if self.remove_center else 0)

    def build(self) -> Case:
        """dcnv3's Case in float64."""
        case = make_dcnv3(torch.float64, batch=self.batch, size=self.size, group=self.group,
                          group_channels=self.group_channels, kernel=self.kernel, stride=self.stride,
                          padding=self.padding, dilation=self.dilation, offset_scale=self.offset_scale,
                          remove_center=self.remove_center, offset_std=self.offset_std,
                          far_fraction=self.far_fraction, seed=self.seed)
        if self.round_offsets:
            input, offset, mask = case.floats()
            case = case.with_floats([input, offset.round(), mask])
        return case

    def build_dcnv4(self) -> Case:
        return dcnv4_from_dcnv3(self.build(), self.softmax, self.extra_channels)


@st.composite
def specs(draw, dcnv4: bool = False) -> Spec:
    kernel = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    dilation = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    # From the smallest input that leaves one output pixel (1x1 images where padding allows) up.
    size = tuple(
        draw(st.integers(lo, lo + 5))
        for lo in (max(1, d * (k - 1) + 1 - 2 * p) for k, p, d in zip(kernel, padding, dilation))
    )
    odd = kernel[0] % 2 == 1 and kernel[1] % 2 == 1
    return Spec(
        batch=draw(st.sampled_from(BATCHES)),
        size=size,
        group=draw(st.integers(1, 3)),
        group_channels=draw(st.integers(1, 4)),
        kernel=kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        offset_scale=draw(st.sampled_from(OFFSET_SCALES)),
        remove_center=odd and draw(st.booleans()),
        offset_std=draw(st.floats(0.0, 5.0)),
        far_fraction=draw(st.sampled_from((0.0, 0.0, 0.2))),
        round_offsets=draw(st.integers(0, 3)) == 0,
        seed=draw(st.integers(0, 2**32 - 1)),
        softmax=dcnv4 and draw(st.booleans()),
        extra_channels=draw(st.integers(0, 3)) if dcnv4 else 0,
    )


def note_spec(spec: Spec) -> None:
    note(f"out_size={spec.out_size}, K={spec.points}")
    # Shown by --hypothesis-show-statistics: what the examples covered.
    event("batch 0" if spec.batch == 0 else "batch > 0")
    event("remove_center" if spec.remove_center else "all points")
    event(f"offset_scale {spec.offset_scale}")
    event("far offsets" if spec.far_fraction else "near offsets")
    event("integer offsets" if spec.round_offsets else "real offsets")


def results(fn: Callable, case: Case, grad_output: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """[output, d/d each floating argument] of ``fn(*case.args)`` by autograd, for ``grad_output`` (default:
    helpers.family's grad_output_for(output))."""
    if grad_output is None:
        return output_and_grads(fn, case)
    leaves = [t.detach().requires_grad_() for t in case.floats()]
    out = fn(*case.with_floats(leaves).args)
    if not out.requires_grad:  # no points (K = 0): an output that depends on no argument
        return [out.detach(), *(torch.zeros_like(t) for t in leaves)]
    grads = torch.autograd.grad(out, leaves, grad_output, materialize_grads=True)
    return [out.detach(), *grads]


# ------------------------------------------------------------------------------- against the references


@settings(PROFILE)
@given(spec=specs())
def test_dcnv3_matches_the_reference(spec: Spec):
    """Forward and the gradients of input, offset and mask equal the float64 reference's to 1e-10."""
    note_spec(spec)
    case = spec.build()
    assert_all_close(results(PUBLIC["dcnv3"], case), results(REFERENCE["dcnv3"], case), GRAD_NAMES["dcnv3"], **TOL)


@settings(PROFILE)
@given(spec=specs(dcnv4=True))
def test_dcnv4_matches_the_reference(spec: Spec):
    """Forward and the gradients of input and offset_mask equal the float64 reference's to 1e-10, with and without
    the softmax; the padding channels get exactly zero gradient."""
    note_spec(spec)
    event("softmax" if spec.softmax else "mask")
    case = spec.build_dcnv4()
    got = results(PUBLIC["dcnv4"], case)
    assert_all_close(got, results(REFERENCE["dcnv4"], case), GRAD_NAMES["dcnv4"], **TOL)
    padding = got[2][..., spec.group * 3 * spec.points:]
    assert padding.shape[-1] == spec.extra_channels
    assert torch.equal(padding, torch.zeros_like(padding))


# ------------------------------------------------------------------------------------------- invariances


def shifted_sum(input: torch.Tensor, mask: torch.Tensor, kernel, stride, padding, dilation, group: int,
                remove_center: bool) -> torch.Tensor:
    """dcnv3 with zero offsets and offset_scale 1, computed independently: point (i, j) of output pixel (oy, ox)
    lies at x = ox * stride_w - pad_w + i * dilation_w (y likewise), an integer, so the sum over the points (x-major,
    as the op's) of mask times the zero-padded input shifted to the point."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    n, h, w, c = input.shape
    ho, wo = out_size((h, w), kernel, stride, padding, dilation)
    padded = F.pad(input, (0, 0, pw, pw, ph, ph))  # [N, H + 2 ph, W + 2 pw, C]
    taps = [(i, j) for i in range(kw) for j in range(kh) if not (remove_center and i == kw // 2 and j == kh // 2)]
    weights = mask.unflatten(3, (group, len(taps)))
    out = input.new_zeros(n, ho, wo, group, c // group)
    for k, (i, j) in enumerate(taps):
        window = padded[:, j * dh: j * dh + (ho - 1) * sh + 1: sh, i * dw: i * dw + (wo - 1) * sw + 1: sw]
        assert window.shape[1:3] == (ho, wo)
        out = out + window.unflatten(3, (group, c // group)) * weights[..., k, None]
    return out.flatten(3)


@INVARIANCE
@given(spec=specs(), unit_mask=st.booleans())
def test_zero_offsets_are_a_sum_of_shifted_inputs(spec: Spec, unit_mask: bool):
    """Zero offsets and offset_scale 1: every point on an integer pixel, so dcnv3 is a grouped sum of the shifted
    zero-padded input (with a mask of ones: each group's channels summed over the taps, a conv2d with unit
    weights); the output and the gradients of input and mask as the shifted sum's, to float64's rounding."""
    spec = dataclasses.replace(spec, offset_scale=1.0)
    note(f"out_size={spec.out_size}, K={spec.points}")
    input, offset, mask = spec.build().floats()
    if unit_mask:
        mask = torch.ones_like(mask)
    case = Case("dcnv3", (input, torch.zeros_like(offset), mask, spec.kernel, spec.stride, spec.padding,
                          spec.dilation, spec.group, 1.0, spec.remove_center))
    out, grad_input, _, grad_mask = results(PUBLIC["dcnv3"], case)
    expected = Case("shifted_sum", (input, mask))
    geometry = (spec.kernel, spec.stride, spec.padding, spec.dilation, spec.group, spec.remove_center)
    expected_out, expected_grad_input, expected_grad_mask = results(
        lambda input, mask: shifted_sum(input, mask, *geometry), expected, grad_output_for(out))
    assert_all_close([out, grad_input, grad_mask], [expected_out, expected_grad_input, expected_grad_mask],
                     ("output", "grad_input", "grad_mask"), **ROUNDING)


def permute_groups(t: torch.Tensor, perm: Sequence[int], group: int, block: Optional[int] = None) -> torch.Tensor:
    """The last dimension's first group * block channels (block: all of them / group) as group blocks, reordered:
    block g of the result is block perm[g] of ``t``; the channels after the blocks (dcnv4's padding) kept."""
    block = t.shape[-1] // group if block is None else block
    blocks = t[..., : group * block].unflatten(-1, (group, block))[..., list(perm), :].flatten(-2)
    return torch.cat([blocks, t[..., group * block:]], dim=-1)


@INVARIANCE
@given(spec=specs(dcnv4=True), op=st.sampled_from(("dcnv3", "dcnv4")), data=st.data())
def test_permuting_the_groups_permutes_the_output_blocks(spec: Spec, op: str, data):
    """The groups are independent: reordering the input's channel blocks and the offsets' and mask's group blocks
    alike reorders the output's channel blocks (and, for the reordered grad_output, every gradient) the same way,
    bit for bit."""
    note_spec(spec)
    perm = data.draw(st.permutations(range(spec.group)), label="perm")
    g = spec.group
    if op == "dcnv3":
        case = spec.build()
        input, offset, mask = case.floats()
        permuted = case.with_floats([permute_groups(input, perm, g), permute_groups(offset, perm, g),
                                     permute_groups(mask, perm, g)])
    else:
        case = spec.build_dcnv4()
        input, offset_mask = case.floats()
        permuted = case.with_floats([permute_groups(input, perm, g),
                                     permute_groups(offset_mask, perm, g, 3 * spec.points)])
    got = results(PUBLIC[op], case)
    got_permuted = results(PUBLIC[op], permuted, permute_groups(grad_output_for(got[0]), perm, g))
    blocks = [None] * len(got) if op == "dcnv3" else [None, None, 3 * spec.points]
    assert_identical(got_permuted, [permute_groups(t, perm, g, b) for t, b in zip(got, blocks)], GRAD_NAMES[op])


@INVARIANCE
@given(spec=specs(dcnv4=True), dtype=st.sampled_from((torch.float64, torch.float32)))
def test_dcnv4_without_softmax_is_dcnv3_bit_for_bit(spec: Spec, dtype: torch.dtype):
    """dcnv4 with softmax=False on dcnv3's offsets and mask packed as its offset_mask (plus padding channels): the
    same output and gradients, bit for bit (the unpacked gradient of offset_mask), in float64 and float32."""
    spec = dataclasses.replace(spec, softmax=False)
    note_spec(spec)
    case3 = spec.build().to(dtype)
    case4 = dcnv4_from_dcnv3(case3, softmax=False, extra_channels=spec.extra_channels)
    out3, grad_input3, grad_offset3, grad_mask3 = results(PUBLIC["dcnv3"], case3)
    out4, grad_input4, grad_offset_mask = results(PUBLIC["dcnv4"], case4)
    grad_offset4, grad_mask4 = unpack_offset_mask(grad_offset_mask, spec.group, spec.points)
    assert_identical([out4, grad_input4, grad_offset4, grad_mask4], [out3, grad_input3, grad_offset3, grad_mask3],
                     GRAD_NAMES["dcnv3"])


@INVARIANCE
@given(spec=specs())
def test_doubling_the_mask_doubles_the_output(spec: Spec):
    """The output is linear in the mask and 2 is a power of two (every rounding commutes with it): twice the mask
    gives exactly twice the output, twice the gradients of input and offset, and the same gradient of mask, in
    float64, for the same grad_output. (Not for subnormal intermediates, whose rounding is absolute: offsets
    below 1e-3 pixels are made 0, else a coordinate of 1e-308 gives a subnormal bilinear weight.)"""
    if spec.offset_std < 1e-3:
        spec = dataclasses.replace(spec, offset_std=0.0)
    note_spec(spec)
    case = spec.build()
    input, offset, mask = case.floats()
    doubled = case.with_floats([input, offset, 2 * mask])
    out, grad_input, grad_offset, grad_mask = results(PUBLIC["dcnv3"], case)
    got = results(PUBLIC["dcnv3"], doubled, grad_output_for(out))
    assert_identical(got, [2 * out, 2 * grad_input, 2 * grad_offset, grad_mask], GRAD_NAMES["dcnv3"])


@st.composite
def flash_cases(draw) -> Tuple[Case, dict]:
    kwargs = dict(
        levels=tuple((draw(st.integers(1, 6)), draw(st.integers(1, 6))) for _ in range(draw(st.integers(1, 3)))),
        batch=draw(st.sampled_from((1, 2, 0))),
        queries=draw(st.sampled_from((1, 3, 5, 0))),
        group=draw(st.integers(1, 3)),
        channels=draw(st.integers(1, 4)),
        n_points=draw(st.integers(1, 4)),
        low=draw(st.floats(-1.0, 0.5)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
    kwargs["high"] = kwargs["low"] + draw(st.floats(0.0, 2.5))
    return make_flash(torch.float64, **kwargs), kwargs


@INVARIANCE
@given(drawn=flash_cases())
def test_flash_deform_attn_is_softmax_then_ms_deform_attn(drawn):
    """flash_deform_attn(sampling_loc_attn) = ms_deform_attn(locations, softmax(logits)), one softmax over a
    group's levels and points: the same output and gradients, to float64's rounding."""
    case, kwargs = drawn
    note(f"{kwargs}")
    event(f"{len(kwargs['levels'])} levels")
    assert_all_close(results(PUBLIC["flash_deform_attn"], case), results(softmax_then_ms_deform_attn, case),
                     GRAD_NAMES["flash_deform_attn"], **ROUNDING)


# --------------------------------------------------------------------------------------------- determinism


@INVARIANCE
@given(spec=specs(dcnv4=True), op=st.sampled_from(("dcnv3", "dcnv4", "flash_deform_attn")),
       dtype=st.sampled_from((torch.float64, torch.float32)), flash=flash_cases())
def test_the_cpu_backward_is_deterministic(spec: Spec, op: str, dtype: torch.dtype, flash):
    """Two calls give the same bits, and so does one thread: the backward splits (image, group, level) between
    threads, each owning its slice of the gradients and summing in one fixed order (no atomics)."""
    note_spec(spec)
    case = {"dcnv3": spec.build, "dcnv4": spec.build_dcnv4, "flash_deform_attn": lambda: flash[0]}[op]().to(dtype)
    first = results(PUBLIC[op], case)
    assert_identical(results(PUBLIC[op], case), first, GRAD_NAMES[op])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = results(PUBLIC[op], case)
    finally:
        torch.set_num_threads(threads)
    assert_identical(one_thread, first, GRAD_NAMES[op])


def test_the_compiled_cpu_ops_are_under_test():
    """deform_conv.dcnv3 and dcnv4 fall back to their references on devices without compiled kernels: the tests
    above would then compare the reference with itself."""
    from deform_conv._ops.dcnv3 import function as dcnv3_function
    from deform_conv._ops.dcnv4 import function as dcnv4_function
    from deform_conv._ops.flash_deform_attn import function as flash_function

    for module in (dcnv3_function, dcnv4_function, flash_function):
        assert "cpu" in module._compiled_devices, module.__name__
