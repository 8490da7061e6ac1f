"""Shared by the tests of the DCNv3/DCNv4 family (tests/family/): dcnv3, dcnv4 and flash_deform_attn on one kernel
family (csrc/sampled_sum/). A Case holds one call's positional arguments (pairs as [h, w] lists, so the same tuple
serves the public function, the reference and torch.ops.deform_conv.<op>); the make_* functions draw awkward
inputs; output_and_grads() runs a differentiable function, op_results() an op namespace's forward and backward
ops, both for the same fixed grad_output so that results compare directly."""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

import torch

import deform_conv
from deform_conv._ops.shared.function import script_pair

OPS = ("dcnv3", "dcnv4", "flash_deform_attn")
PUBLIC = {"dcnv3": deform_conv.dcnv3, "dcnv4": deform_conv.dcnv4, "flash_deform_attn": deform_conv.flash_deform_attn}
REFERENCE = {"dcnv3": deform_conv.dcnv3_reference, "dcnv4": deform_conv.dcnv4_reference,
             "flash_deform_attn": deform_conv.flash_deform_attn_reference}
GRAD_NAMES = {"dcnv3": ("output", "grad_input", "grad_offset", "grad_mask"),
              "dcnv4": ("output", "grad_input", "grad_offset_mask"),
              "flash_deform_attn": ("output", "grad_value", "grad_sampling_loc_attn")}
HALF_TYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class Case:
    op: str      # "dcnv3", "dcnv4" or "flash_deform_attn"
    args: tuple  # the op's positional arguments, pairs as lists

    @property
    def float_indices(self) -> List[int]:
        """Positions of the differentiable (floating-point tensor) arguments, in argument order."""
        return [i for i, a in enumerate(self.args) if isinstance(a, torch.Tensor) and a.is_floating_point()]

    def floats(self) -> List[torch.Tensor]:
        return [self.args[i] for i in self.float_indices]

    def with_floats(self, floats: Sequence[torch.Tensor]) -> "Case":
        args = list(self.args)
        for i, t in zip(self.float_indices, floats):
            args[i] = t
        return Case(self.op, tuple(args))

    def to(self, dtype: torch.dtype, points_dtype: Optional[torch.dtype] = None) -> "Case":
        """The value (input) in ``dtype``, the offsets/mask/locations in ``points_dtype`` (default: ``dtype``)."""
        floats = self.floats()
        points_dtype = points_dtype or dtype
        return self.with_floats([floats[0].to(dtype)] + [t.to(points_dtype) for t in floats[1:]])

    def double(self) -> "Case":
        return self.to(torch.float64)

    @property
    def value(self) -> torch.Tensor:
        return self.args[0]


# ------------------------------------------------------------------------------------------------------ inputs


def out_size(size, kernel, stride, padding, dilation) -> Tuple[int, int]:
    return tuple((size[i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(2))


def _offsets(shape, std: float, far_fraction: float, g: torch.Generator) -> torch.Tensor:
    """N(0, std) offsets, a fraction of them replaced by +-1e6 (far outside any image)."""
    offsets = std * torch.randn(shape, dtype=torch.float64, generator=g)
    if far_fraction:
        far = torch.rand(shape, dtype=torch.float64, generator=g) < far_fraction
        sign = torch.where(torch.rand(shape, dtype=torch.float64, generator=g) < 0.5, -1.0, 1.0)
        offsets = torch.where(far, 1e6 * sign, offsets)
    return offsets


def make_dcnv3(dtype=torch.float64, batch: int = 2, size=(7, 6), group: int = 3, group_channels: int = 5,
               kernel=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1), offset_scale: float = 1.0,
               remove_center: bool = False, offset_std: float = 1.5, far_fraction: float = 0.0,
               seed: int = 0) -> Case:
    """Input N(0, 1), offsets N(0, offset_std) pixels (some far out with far_fraction), mask N(0, 1) (any sign).
    Drawn in float64, then rounded once: the same values in every dtype."""
    g = torch.Generator().manual_seed(seed)
    kernel, stride, padding, dilation = map(script_pair, (kernel, stride, padding, dilation))
    ho, wo = out_size(size, kernel, stride, padding, dilation)
    k = kernel[0] * kernel[1] - (1 if remove_center else 0)
    input = torch.randn(batch, *size, group * group_channels, dtype=torch.float64, generator=g)
    offset = _offsets((batch, ho, wo, group * k * 2), offset_std, far_fraction, g)
    mask = torch.randn(batch, ho, wo, group * k, dtype=torch.float64, generator=g)
    return Case("dcnv3", (input, offset, mask, kernel, stride, padding, dilation, group, offset_scale,
                          remove_center)).to(dtype)


def make_dcnv4(dtype=torch.float64, softmax: bool = False, extra_channels: int = 0, **kwargs) -> Case:
    """dcnv3's inputs (make_dcnv3's keywords) packed as DCNv4's offset_mask (each group's 2K offsets then its K
    mask values), with extra_channels of padding (N(0, 1), ignored by the op) after the last block."""
    return dcnv4_from_dcnv3(make_dcnv3(dtype, **kwargs), softmax, extra_channels)


def pack_offset_mask(offset: torch.Tensor, mask: torch.Tensor, group: int, extra_channels: int = 0) -> torch.Tensor:
    n, ho, wo, gk = mask.shape
    k = gk // group
    blocks = torch.cat([offset.reshape(n, ho, wo, group, 2 * k), mask.reshape(n, ho, wo, group, k)], dim=-1)
    padding = torch.randn(n, ho, wo, extra_channels, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(99)).to(mask.dtype)
    return torch.cat([blocks.flatten(3), padding], dim=-1)


def unpack_offset_mask(offset_mask: torch.Tensor, group: int, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """offset_mask [N, Ho, Wo, P] -> offsets [N, Ho, Wo, group * 2K], mask [N, Ho, Wo, group * K]."""
    blocks = offset_mask[..., : group * 3 * k].unflatten(3, (group, 3 * k))
    return blocks[..., : 2 * k].flatten(3), blocks[..., 2 * k:].flatten(3)


def dcnv4_from_dcnv3(case: Case, softmax: bool = False, extra_channels: int = 0) -> Case:
    input, offset, mask, kernel, stride, padding, dilation, group, offset_scale, remove_center = case.args
    offset_mask = pack_offset_mask(offset, mask, group, extra_channels)
    return Case("dcnv4", (input, offset_mask, kernel, stride, padding, dilation, group, offset_scale,
                          remove_center, softmax))


def level_tensors(levels: Sequence[Tuple[int, int]]) -> Tuple[torch.Tensor, torch.Tensor]:
    spatial_shapes = torch.tensor(levels, dtype=torch.int64).reshape(-1, 2)
    sizes = spatial_shapes.prod(1)
    return spatial_shapes, torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])


def make_flash(dtype=torch.float64, levels=((5, 7), (1, 1), (3, 2)), batch: int = 2, queries: int = 6,
               group: int = 3, channels: int = 5, n_points: int = 4, low: float = -0.3, high: float = 1.3,
               seed: int = 0) -> Case:
    """Value N(0, 1), locations uniform in [low, high] (some outside their level), logits N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index = level_tensors(levels)
    pixels = int(spatial_shapes.prod(1).sum())
    points = len(levels) * n_points
    value = torch.randn(batch, pixels, group, channels, dtype=torch.float64, generator=g)
    locations = low + (high - low) * torch.rand(batch, queries, group, 2 * points, dtype=torch.float64, generator=g)
    logits = torch.randn(batch, queries, group, points, dtype=torch.float64, generator=g)
    sampling_loc_attn = torch.cat([locations, logits], dim=-1)
    return Case("flash_deform_attn", (value, spatial_shapes, level_start_index, sampling_loc_attn,
                                      n_points)).to(dtype)


def make_case(op: str, dtype=torch.float64, **kwargs) -> Case:
    return {"dcnv3": make_dcnv3, "dcnv4": make_dcnv4, "flash_deform_attn": make_flash}[op](dtype, **kwargs)


# ---------------------------------------------------------------------------------------------------- running


def softmax_then_ms_deform_attn(value, spatial_shapes, level_start_index, sampling_loc_attn, n_points):
    """flash_deform_attn as its definition composes it: a softmax over each group's levels and points, then
    ms_deform_attn."""
    n, lq, g, _ = sampling_loc_attn.shape
    levels = spatial_shapes.shape[0]
    points = levels * n_points
    locations = sampling_loc_attn[..., : 2 * points].reshape(n, lq, g, levels, n_points, 2)
    weights = sampling_loc_attn[..., 2 * points:].softmax(-1).reshape(n, lq, g, levels, n_points)
    return deform_conv.ms_deform_attn(value, spatial_shapes, level_start_index, locations, weights)


def grad_output_for(out: torch.Tensor, seed: int = 1) -> torch.Tensor:
    # Drawn in float64, then cast: the same values for every dtype and implementation.
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return g.to(out.dtype)


def output_and_grads(fn: Callable, case: Case, seed: int = 1) -> List[torch.Tensor]:
    """[output, d/d each floating argument] of ``fn(*case.args)`` by autograd, for grad_output_for(output)."""
    leaves = [t.detach().requires_grad_() for t in case.floats()]  # detach keeps the strides
    out = fn(*case.with_floats(leaves).args)
    grads = torch.autograd.grad(out, leaves, grad_output_for(out, seed), materialize_grads=True)
    return [out.detach(), *grads]


def op_results(namespace, case: Case, seed: int = 1) -> List[torch.Tensor]:
    """[output, gradients] from ``namespace.<op>`` and ``namespace.<op>_backward`` (torch.ops.deform_conv or
    torch.ops.deform_conv_sim), for the same grad_output as output_and_grads."""
    out = getattr(namespace, case.op)(*case.args)
    grads = getattr(namespace, case.op + "_backward")(grad_output_for(out, seed), *case.args)
    return [out, *grads]


def assert_all_close(actual, expected, names, rtol: float, atol: float) -> None:
    assert len(actual) == len(expected) == len(names)
    for name, a, e in zip(names, actual, expected):
        assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_identical(actual, expected, names) -> None:
    for name, a, e in zip(names, actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        assert torch.equal(a, e), f"{name}: not bitwise equal (max diff {(a.double() - e.double()).abs().max()})"


# ------------------------------------------------------------------------------------------- error bounds


def _taps(kernel, dilation, remove_center):
    """(x, y) of each point's tap, in the grid's x-major order (points.h)."""
    kh, kw = kernel
    taps = [(i * dilation[1], j * dilation[0]) for i in range(kw) for j in range(kh)
            if not (remove_center and i == kw // 2 and j == kh // 2)]
    return torch.tensor(taps, dtype=torch.float64)  # [K, 2]


def point_magnitudes(case: Case) -> Tuple[torch.Tensor, torch.Tensor]:
    """|weight| and M of every point, [N, H_out, W_out, G, K] (dcnv3, dcnv4) or [N, Lq, G, L * K] (flash), from
    the float64 values of ``case``'s arguments. M = M_x + M_y bounds the magnitude of every term the op's float32
    coordinate is computed from (points.cpp): |base| + (|tap| + |offset|) |offset_scale| a grid's, |location| *
    size + 0.5 a level's."""
    c = case.double()
    if c.op == "flash_deform_attn":
        value, spatial_shapes, _, sla, n_points = c.args
        points = spatial_shapes.shape[0] * n_points
        weights = sla[..., 2 * points:].softmax(-1)
        sizes = spatial_shapes.flip(1).to(torch.float64).repeat_interleave(n_points, 0)  # [LK, 2] (W, H)
        m = (sla[..., : 2 * points].unflatten(3, (points, 2)).abs() * sizes + 0.5).sum(-1)
        return weights.abs(), m
    if c.op == "dcnv4":
        input, offset_mask, kernel, stride, padding, dilation, group, scale, remove_center, softmax = c.args
        k = kernel[0] * kernel[1] - (1 if remove_center else 0)
        offset, mask = unpack_offset_mask(offset_mask, group, k)
        mask = mask.unflatten(3, (group, k))
        mask = mask.softmax(-1) if softmax else mask
    else:
        input, offset, mask, kernel, stride, padding, dilation, group, scale, remove_center = c.args
        k = kernel[0] * kernel[1] - (1 if remove_center else 0)
        mask = mask.unflatten(3, (group, k))
    n, ho, wo = mask.shape[:3]
    bases = []
    for axis, outputs in ((1, wo), (0, ho)):  # x: width, y: height
        half = dilation[axis] * (kernel[axis] - 1) // 2
        o = torch.arange(outputs, dtype=torch.float64)
        bases.append((half - padding[axis] + o * stride[axis] - half * scale).abs())
    taps = _taps(kernel, dilation, remove_center)
    offsets = offset.reshape(n, ho, wo, group, k, 2).abs()
    m_x = bases[0].view(1, 1, -1, 1, 1) + (taps[:, 0] + offsets[..., 0]) * abs(scale)
    m_y = bases[1].view(1, -1, 1, 1, 1) + (taps[:, 1] + offsets[..., 1]) * abs(scale)
    return mask.abs(), m_x + m_y


def weight_sums(case: Case) -> torch.Tensor:
    """S, the sum of |weights| of each output element's points, in the output's shape."""
    weights, _ = point_magnitudes(case)
    return _per_channel(case, weights.sum(-1))


def _per_channel(case: Case, per_group: torch.Tensor) -> torch.Tensor:
    channels = case.value.shape[3] // case.args[6] if case.op == "dcnv4" else (
        case.value.shape[3] // case.args[7] if case.op == "dcnv3" else case.value.shape[3])
    return per_group.unsqueeze(-1).expand(*per_group.shape, channels).flatten(-2)


def float32_bound(case: Case) -> torch.Tensor:
    """A bound on |float32 op - float64 reference on the same (float32) arguments| of each output element. With
    u = eps / 2 of float32, V = max|value|, each point's weight w_k and M_k (point_magnitudes), S = sum |w_k|:

      coordinates (points.cpp): base rounded, tap + offset, times offset_scale, plus base: 4 roundings of terms
        <= M_x, so |dx| <= 3 u M_x, likewise y; the bilinear sample (zero outside the image) is Lipschitz with
        constant <= 2 V along each axis: <= 6 u V M_k a point.
      the sample: corner weights (1 - lx)(1 - ly)... (<= 3 u relative), times the corner (u), 3 additions (3 u):
        <= 7 u V.
      the point's weight: a softmax over K logits (where there is one): exp, a sum of K terms, a division:
        <= (K + 2) u relative; times the sample: u.
      the sum over the K points: <= K u S V; the final rounding: u |output| <= u S V.

    Summed: u V (6 sum_k |w_k| M_k + S (7 + K + 2 + 1 + K + 1)) = eps V (3 sum_k |w_k| M_k + S (K + 6)), and
    every point dropping out of a softmax-free op still leaves the bound valid (its terms only add)."""
    weights, m = point_magnitudes(case)
    k = weights.shape[-1]
    eps = torch.finfo(torch.float32).eps
    v = float(case.value.abs().max()) if case.value.numel() else 0.0
    per_group = eps * v * (3 * (weights * m).sum(-1) + weights.sum(-1) * (k + 6))
    return _per_channel(case, per_group)


def assert_within(actual: torch.Tensor, expected64: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    error = (actual.double() - expected64).abs()
    assert actual.shape == expected64.shape, what
    assert torch.all(error <= bound), (
        f"{what}: error exceeds the bound, up to {(error / bound).nan_to_num(nan=float('inf')).max().item():.3g}x "
        f"(largest error {error.max().item():.3g})")
