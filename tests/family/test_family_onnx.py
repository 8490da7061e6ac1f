"""ONNX export of dcnv3, dcnv4 and flash_deform_attn with both exporters (the TorchScript-based ``dynamo=False`` and
the dynamo-based default), run in plain onnxruntime against the op, on awkward geometry: kernel (3, 2), stride
(2, 1), padding (1, 0), dilation (2, 1), group 3; remove_center with 3x3 (offset_scale 2); dcnv4 with and without
its softmax (and with padding channels after the last group's block); flash_deform_attn over 3 levels (one 1x1).
Each graph holds standard-domain operators only, among them GridSample (one for a grid, one a level), and runs at
its export sizes and at other sizes where the exporter leaves them dynamic.

The exports run in this process after nothing but ``import deform_conv``: the ops return their composition of
standard operators while an export traces them, and nothing is registered for it (unlike deform_conv2d's
TorchScript symbolic, whose plain-import test needs a fresh process), so no other test's imports can change what
is exported here.
"""

from __future__ import annotations

import warnings
from typing import Dict, List

import pytest
import torch
from torch import nn

from helpers.family import PUBLIC, Case, make_dcnv3, make_dcnv4, make_flash, point_magnitudes

pytestmark = [
    pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The feature will be removed:DeprecationWarning"),  # torch's, same exporter
    pytest.mark.filterwarnings("ignore:# The axis name:UserWarning"),  # the dynamo-based one renaming derived Dims
]

onnx = pytest.importorskip("onnx", reason="ONNX export tests need onnx (pip install -e '.[test]')")
ort = pytest.importorskip("onnxruntime", reason="ONNX export tests need onnxruntime (pip install -e '.[test]')")

# The TorchScript-based exporter at GridSample's first opset; the dynamo-based one at the lowest it writes natively
# (asked for less, it converts its opset-18 graph down).
OPSET = {"torchscript": 16, "dynamo": 18}

F32 = torch.float32
REMOVE_CENTER = dict(kernel=3, stride=1, padding=1, dilation=(2, 1), remove_center=True, offset_scale=2.0)
# name: (make a case of the given sizes, the second run's sizes). make_dcnv3's default geometry is kernel (3, 2),
# stride (2, 1), padding (1, 0), dilation (2, 1), group 3 of 5 channels, input 7x6, batch 2, offsets N(0, 1.5).
CASES = {
    "dcnv3_k3x2_s21_p10_d21_g3": (lambda **kw: make_dcnv3(F32, **kw), dict(batch=3, size=(11, 9))),
    "dcnv3_remove_center_3x3": (lambda **kw: make_dcnv3(F32, **REMOVE_CENTER, **kw), dict(batch=3, size=(10, 5))),
    "dcnv4_k3x2_no_softmax_padded": (lambda **kw: make_dcnv4(F32, extra_channels=2, **kw),
                                     dict(batch=3, size=(11, 9))),
    "dcnv4_remove_center_softmax": (lambda **kw: make_dcnv4(F32, softmax=True, **REMOVE_CENTER, **kw),
                                    dict(batch=3, size=(10, 5))),
    "flash_3_levels": (lambda **kw: make_flash(F32, **kw), dict(batch=3, queries=5)),
}
# flash_deform_attn's levels are the graph's constants with the TorchScript-based exporter, read at run time with
# the dynamo-based one (ms_deform_attn's export): the second run there changes them too (same number of levels).
FLASH_OTHER_LEVELS = ((4, 6), (2, 3), (1, 2))

INPUTS = {"dcnv3": ["input", "offset", "mask"], "dcnv4": ["input", "offset_mask"],
          "flash_deform_attn": ["value", "spatial_shapes", "level_start_index", "sampling_loc_attn"]}


class CallOp(nn.Module):
    """The public function on a case's non-tensor arguments (geometry, group, offset_scale, ...); its tensors are
    the model's inputs."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.op = case.op
        self.tensors = len(INPUTS[case.op])
        self.constants = case.args[self.tensors:]

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return PUBLIC[self.op](*tensors, *self.constants)


def dynamo_shapes(case: Case) -> Dict[str, object]:
    """Batch and spatial sizes (dcnv3, dcnv4) or batch, query count and pixel count (flash) as torch.export Dims.
    The input's height is derived from the output's, H = stride * H_out + (span - 2 * padding - stride) (conv2d's
    H_out inverted; span = dilation * (kernel - 1) + 1), so that the fake kernel's shape check holds symbolically;
    likewise the width."""
    Dim = torch.export.Dim
    batch = Dim("batch")
    if case.op == "flash_deform_attn":
        queries, pixels = Dim("queries"), Dim("pixels")
        return {"value": {0: batch, 1: pixels}, "spatial_shapes": None, "level_start_index": None,
                "sampling_loc_attn": {0: batch, 1: queries}}
    kernel, stride, padding, dilation = case.args[len(INPUTS[case.op]):][:4]
    out = [Dim("out_height", min=2), Dim("out_width", min=2)]
    sides = []
    for a in (0, 1):
        shift = dilation[a] * (kernel[a] - 1) + 1 - 2 * padding[a] - stride[a]
        # torch.export takes 1 * d + 0 for another dimension than d's own
        sides.append(out[a] if (stride[a], shift) == (1, 0) else stride[a] * out[a] + shift)
    per_output = {0: batch, 1: out[0], 2: out[1]}
    return {"input": {0: batch, 1: sides[0], 2: sides[1]},
            **{name: per_output for name in INPUTS[case.op][1:]}}


def torchscript_axes(case: Case) -> Dict[str, Dict[int, str]]:
    if case.op == "flash_deform_attn":  # the levels (and with them the pixel count) are constants
        return {"value": {0: "batch"}, "sampling_loc_attn": {0: "batch", 1: "queries"}}
    per_output = {0: "batch", 1: "out_height", 2: "out_width"}
    return {"input": {0: "batch", 1: "height", 2: "width"}, **{name: per_output for name in INPUTS[case.op][1:]}}


def export(case: Case, exporter: str, path) -> None:
    model, args, names = CallOp(case).eval(), case.args[:len(INPUTS[case.op])], INPUTS[case.op]
    if exporter == "dynamo":  # the default: no dynamo= argument
        pytest.importorskip("onnxscript", reason="the dynamo-based exporter needs onnxscript")
        shapes = dynamo_shapes(case)
        torch.onnx.export(model, args, str(path), opset_version=OPSET[exporter], input_names=names,
                          dynamic_shapes={"tensors": tuple(shapes[name] for name in names)})  # forward(*tensors)
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", torch.jit.TracerWarning)
            torch.onnx.export(model, args, str(path), opset_version=OPSET[exporter], dynamo=False,
                              input_names=names, dynamic_axes=torchscript_axes(case))
        tracer = {str(w.message).split(" might ")[0] for w in caught if w.category is torch.jit.TracerWarning}
        # The trace's only warning is flash_deform_attn's (ms_deform_attn's export's): the levels read as constants.
        # The sizes are traced (no "Converting a tensor to a Python integer"); the checks' comparisons and the
        # taps' constants say nothing the user must know (dcnv3/onnx.py's quiet_tracer).
        expected = {"Converting a tensor to a Python list"} if case.op == "flash_deform_attn" else set()
        assert tracer == expected


def run_onnxruntime(path, case: Case) -> torch.Tensor:
    """The graph on the case's tensors (those that are still its inputs: the TorchScript-based export of
    flash_deform_attn holds the levels as constants)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    tensors = dict(zip(INPUTS[case.op], case.args))
    return torch.from_numpy(session.run(None, {i.name: tensors[i.name].numpy() for i in session.get_inputs()})[0])


def graph_nodes(path) -> List[tuple]:
    """(domain, op_type) of every node, in the graph and in any local function."""
    model = onnx.load(str(path))
    nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
    return [(n.domain, n.op_type) for n in nodes]


# The bound on |onnxruntime - op| of each output element, from float32's eps. With u = eps / 2, V = max|value|,
# each point's weight w_k and M_k (helpers.family.point_magnitudes: M_x + M_y bounds the terms the pixel coordinate
# is computed from), S = sum_k |w_k| and the image's sides H, W (of the largest level for flash_deform_attn):
#
#   the pixel coordinate x: the op's is within 3 u M_x of the exact one (helpers.family.float32_bound), the graph
#     computes it by the same formula (3 u M_x more), then normalises it, g = (2x + 1) / W - 1, and onnxruntime's
#     GridSample takes it back, ((g + 1) W - 1) / 2: 6 roundings, which in pixels are at most u (|x| + 1/2),
#     u (|x| + 1/2), u (|x| + 1/2 + W/2), u (|x| + 1/2 + W), u (|x| + 1/2) and u |x|: together
#     u (12 M_x + 5/2 + 3/2 W), likewise y (flash_deform_attn's x * W - 1/2 against 2x - 1 has fewer);
#   the bilinear sample is 2V-Lipschitz along each axis: eps V (12 M_k + 5 + 3/2 (H + W)) a point, times |w_k|;
#   the sample, the weight (and its softmax) and the sum over K points: eps V S (K + 6) on each side
#     (float32_bound's count), twice.
#
# So eps V (sum_k |w_k| (12 M_k + 5 + 3/2 (H + W)) + 2 S (K + 6)): ~1e-4 here, ~100x the differences seen
# (~1e-6, outputs of magnitude ~10), and a sample off by a pixel or a swapped H and W moves outputs by ~1.
def onnx_bound(case: Case) -> torch.Tensor:
    weights, m = point_magnitudes(case)  # [N, H_out, W_out, G, K] or [N, Lq, G, L * K]
    if case.op == "flash_deform_attn":
        sides = int(case.args[1].sum(1).max())
        channels = case.value.shape[3]
    else:
        sides = case.value.shape[1] + case.value.shape[2]
        channels = case.value.shape[3] // weights.shape[-2]
    k = weights.shape[-1]
    eps = torch.finfo(torch.float32).eps
    v = float(case.value.abs().max())
    per_group = eps * v * ((weights * (12 * m + 5 + 1.5 * sides)).sum(-1) + 2 * weights.sum(-1) * (k + 6))
    return per_group.unsqueeze(-1).expand(*per_group.shape, channels).flatten(-2)


def assert_matches_op(got: torch.Tensor, case: Case, what: str) -> None:
    with torch.no_grad():
        want = CallOp(case)(*case.args[:len(INPUTS[case.op])])
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    error, bound = (got.double() - want.double()).abs(), onnx_bound(case)
    assert bool((error <= bound).all()), (
        f"{what}: error up to {float(error.max()):.3g}, {float((error / bound).max()):.3g}x the bound")


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("name", list(CASES))
def test_export_runs_in_onnxruntime(tmp_path, name, exporter):
    make, other_sizes = CASES[name]
    case = make()
    path = tmp_path / "model.onnx"
    export(case, exporter, path)

    nodes = graph_nodes(path)
    assert all(domain in ("", "ai.onnx") for domain, _ in nodes), f"custom ops: {sorted(set(nodes))}"
    grid_samples = [op for _, op in nodes].count("GridSample")
    assert grid_samples == (case.args[1].shape[0] if case.op == "flash_deform_attn" else 1), nodes
    assert onnx.load(str(path)).opset_import[0].version == OPSET[exporter]

    assert_matches_op(run_onnxruntime(path, case), case, "export sizes")
    if case.op == "flash_deform_attn" and exporter == "dynamo":
        other_sizes = dict(other_sizes, levels=FLASH_OTHER_LEVELS)
    other = make(**other_sizes, seed=1)
    assert_matches_op(run_onnxruntime(path, other), other, f"other sizes {other_sizes}")


@pytest.mark.parametrize("name", ["dcnv3_k3x2_s21_p10_d21_g3", "dcnv4_remove_center_softmax", "flash_3_levels"])
def test_half_input_keeps_float32_coordinates(tmp_path, name):
    """A float16 input beside float32 offsets (locations): the graph samples a float32 image on a float32 grid
    (the coordinates never in float16, as the op) and rounds the sum to float16 once. The TorchScript-based
    exporter alone, to keep this short: both trace the same composition."""
    case32 = CASES[name][0]()
    case = case32.to(torch.float16, torch.float32)
    path = tmp_path / "half.onnx"
    export(case, "torchscript", path)
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.input]}
    grid_samples = [n for n in model.graph.node if n.op_type == "GridSample"]
    assert grid_samples and all(types[n.input[0]] == types[n.input[1]] == onnx.TensorProto.FLOAT
                                for n in grid_samples)
    got = run_onnxruntime(path, case)
    with torch.no_grad():
        want = CallOp(case)(*case.args[:len(INPUTS[case.op])])
    assert got.dtype == want.dtype == torch.float16 and got.shape == want.shape
    # Both sums are the float32 ones on the same (float16-exact) values, within onnx_bound of each other, each then
    # rounded to float16 once: up to an ulp more apart, 2**-10 relative (2**-24 below float16's normal range).
    error = (got.double() - want.double()).abs()
    bound = onnx_bound(case.to(torch.float32)) + 2.0**-10 * want.double().abs() + 2.0**-24
    assert bool((error <= bound).all()), f"error up to {float(error.max()):.3g}"


def test_far_offsets_sample_zero_as_the_op(tmp_path):
    """Offsets of +-1e6 pixels (a third of them): the normalised grid lies far outside [-1, 1] and GridSample's
    zeros padding gives what the op gives (those points add exactly 0). The bound is onnx_bound's with those
    points' mask values set to 0 (their M of 1e6 would make it useless where they are); the rest is the same
    arithmetic. The TorchScript-based exporter alone: the composition is the same with either."""
    case = make_dcnv3(F32, far_fraction=0.3, offset_scale=0.5)
    input, offset, mask, *constants = case.args
    far = offset.unflatten(3, (-1, 2)).abs().amax(-1) > 1e5  # [N, H_out, W_out, G * K]
    assert 0 < float(far.float().mean()) < 1
    near_only = Case("dcnv3", (input, offset, mask.masked_fill(far, 0.0), *constants))
    path = tmp_path / "far.onnx"
    export(case, "torchscript", path)
    got = run_onnxruntime(path, case)
    with torch.no_grad():
        want = CallOp(case)(input, offset, mask)
    error, bound = (got.double() - want.double()).abs(), onnx_bound(near_only)
    assert float(bound.max()) < 1e-3 and bool((error <= bound).all()), f"error up to {float(error.max()):.3g}"
