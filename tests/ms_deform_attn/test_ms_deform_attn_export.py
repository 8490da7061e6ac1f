"""Multi-scale deformable attention inside real models: ONNX export with both exporters (run in onnxruntime),
torch.compile (fullgraph, dynamic shapes), torch.export, TorchScript (script and trace), CPU autocast in
bfloat16, and the fake kernels' shape checks under torch.compile, each against eager.

About 85 s on a 2-core AMD EPYC shared with other work (about 1 min of CPU time): ~40 s the fresh process of the
plain-import test (two exports, one of them dynamo-based), ~20 s the other dynamo-based export, ~10 s the two
torch.compile tests with a warm Inductor cache (25-50 s cold); the rest under 2 s each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
from torch import nn

import deform_conv

# Three levels of unequal, non-square sizes (one of them a single row), 2 heads, 3 points: small enough for the
# compile tests, awkward enough that a mixed-up H/W or level order shows.
LEVELS = [(6, 5), (3, 4), (1, 3)]
HEADS, CHANNELS, POINTS = 2, 4, 3
EMBED = HEADS * CHANNELS


def level_tensors(levels: List[Tuple[int, int]]) -> Tuple[torch.Tensor, torch.Tensor]:
    spatial_shapes = torch.tensor(levels, dtype=torch.long)  # [L, 2]
    level_start_index = torch.cat((spatial_shapes.new_zeros(1), spatial_shapes.prod(1).cumsum(0)[:-1]))  # [L]
    return spatial_shapes, level_start_index


def make_args(batch: int = 2, queries: int = 7, levels=LEVELS, dtype=torch.float64, seed: int = 0):
    """The op's five arguments as Deformable DETR builds them: reference points plus offsets of a few pixels
    (some locations land outside [0, 1]), weights softmax-normalised over the levels and points of each head."""
    g = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index = level_tensors(levels)
    pixels = int(spatial_shapes.prod(1).sum())
    value = torch.randn(batch, pixels, HEADS, CHANNELS, generator=g, dtype=dtype)  # [N, S, M, D]
    reference = torch.rand(batch, queries, 1, 1, 1, 2, generator=g, dtype=dtype)
    offsets = 1.5 * torch.randn(batch, queries, HEADS, len(levels), POINTS, 2, generator=g, dtype=dtype)
    sampling_locations = reference + offsets / spatial_shapes.flip(1).to(dtype)[:, None]  # [N, Lq, M, L, P, 2]
    logits = torch.randn(batch, queries, HEADS, len(levels) * POINTS, generator=g, dtype=dtype)
    attention_weights = logits.softmax(-1).view(batch, queries, HEADS, len(levels), POINTS)  # [N, Lq, M, L, P]
    return value, spatial_shapes, level_start_index, sampling_locations, attention_weights


def call(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    return deform_conv.ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights)


class Attention(nn.Module):
    """Deformable DETR's attention block at one input size (a deployed model): the level shapes are buffers,
    the offsets and weights are predicted from the queries."""

    def __init__(self, levels=LEVELS) -> None:
        super().__init__()
        spatial_shapes, level_start_index = level_tensors(levels)
        self.register_buffer("spatial_shapes", spatial_shapes)
        self.register_buffer("level_start_index", level_start_index)
        self.levels = len(levels)
        self.value_proj = nn.Linear(EMBED, EMBED)
        self.sampling_offsets = nn.Linear(EMBED, HEADS * self.levels * POINTS * 2)
        self.attention_weights = nn.Linear(EMBED, HEADS * self.levels * POINTS)
        self.output_proj = nn.Linear(EMBED, EMBED)
        torch.manual_seed(0)
        with torch.no_grad():
            for layer in (self.value_proj, self.sampling_offsets, self.attention_weights, self.output_proj):
                layer.weight.normal_(std=0.5)
                layer.bias.normal_(std=0.5)

    def forward(self, query, reference_points, features):
        # query [N, Lq, C], reference_points [N, Lq, 2] in [0, 1], features [N, S, C]
        batch, queries, _ = query.shape
        value = self.value_proj(features).view(batch, features.shape[1], HEADS, CHANNELS)
        offsets = self.sampling_offsets(query).view(batch, queries, HEADS, self.levels, POINTS, 2)
        normalizer = self.spatial_shapes.flip(1).to(query.dtype)  # (W_l, H_l): offsets are in pixels
        locations = reference_points[:, :, None, None, None, :] + offsets / normalizer[None, None, None, :, None, :]
        weights = self.attention_weights(query).view(batch, queries, HEADS, self.levels * POINTS).softmax(-1)
        weights = weights.view(batch, queries, HEADS, self.levels, POINTS)
        out = deform_conv.ms_deform_attn(value, self.spatial_shapes, self.level_start_index, locations, weights)
        return self.output_proj(out)


def attention_inputs(batch: int, queries: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pixels = sum(h * w for h, w in LEVELS)
    return (torch.randn(batch, queries, EMBED, generator=g, dtype=dtype),
            torch.rand(batch, queries, 2, generator=g, dtype=dtype),
            torch.randn(batch, pixels, EMBED, generator=g, dtype=dtype))


# ---------------------------------------------------------------------------------------------------------- ONNX


def needs_onnx(dynamo: bool = True) -> None:
    """Skips an ONNX test where its packages are missing (in the test, not for the file: the other tests here need
    none of them)."""
    pytest.importorskip("onnx", reason="ONNX export tests need onnx (pip install -e '.[test]')")
    pytest.importorskip("onnxruntime", reason="ONNX export tests need onnxruntime (pip install -e '.[test]')")
    if dynamo:
        pytest.importorskip("onnxscript", reason="the dynamo-based exporter needs onnxscript")


# onnxruntime's GridSample and our kernel compute the same bilinear samples in float32 along different paths (the
# pixel coordinate as ((2x - 1 + 1) * W - 1) / 2 there, x * W - 0.5 here; another order of the 4 * L * P terms of
# each output; the projections' GEMMs in other libraries), so they differ by a few float32 ulps of outputs of
# magnitude ~1-4: up to 6e-7 seen. 1e-5 (+ 1e-5 relative) leaves room for that and none for a misplaced sample
# (a level's H and W swapped moves outputs by 0.6-2.4).
ONNX_TOL = dict(rtol=1e-5, atol=1e-5)


def run_onnxruntime(path, feeds: dict) -> torch.Tensor:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert sorted(i.name for i in session.get_inputs()) == sorted(feeds)
    return torch.from_numpy(session.run(None, {k: v.numpy() for k, v in feeds.items()})[0])


def graph_ops(path) -> List[Tuple[str, str]]:
    import onnx

    return [(node.domain, node.op_type) for node in onnx.load(str(path)).graph.node]


SIZES = [(2, 7), (3, 11)]  # (batch, queries) at which onnxruntime runs each export


def export_fixed_levels(directory: str) -> dict:
    """Exports the attention block with the default (dynamo-based) exporter and the TorchScript-based one, batch
    and query count dynamic, and runs each in onnxruntime at SIZES; saves those outputs and eager's to
    directory/outputs.pt and returns each graph's operators. Run by the test below in a fresh process."""
    model = Attention().eval()
    names = ["query", "reference_points", "features"]
    outputs, ops = {}, {}
    for exporter in ("dynamo", "torchscript"):
        path = f"{directory}/{exporter}.onnx"
        args = attention_inputs(*SIZES[0])
        if exporter == "dynamo":  # the default: no dynamo= argument
            batch, queries = torch.export.Dim("batch"), torch.export.Dim("queries")
            shapes = {"query": {0: batch, 1: queries}, "reference_points": {0: batch, 1: queries},
                      "features": {0: batch}}
            torch.onnx.export(model, args, path, opset_version=19, input_names=names, dynamic_shapes=shapes)
        else:
            axes = {"query": {0: "batch", 1: "queries"}, "reference_points": {0: "batch", 1: "queries"},
                    "features": {0: "batch"}}
            torch.onnx.export(model, args, path, opset_version=19, dynamo=False, input_names=names,
                              dynamic_axes=axes)
        ops[exporter] = graph_ops(path)
        for batch, queries in SIZES:
            args = attention_inputs(batch, queries, seed=batch)
            outputs[exporter, batch] = run_onnxruntime(path, dict(zip(names, args)))
            with torch.no_grad():
                outputs["eager", batch] = model(*args)
    torch.save(outputs, f"{directory}/outputs.pt")
    return ops


PLAIN_IMPORT_CHILD = r"""
import json, sys
import torch
import deform_conv
imported = "torch.onnx" in sys.modules
sys.path.insert(0, sys.argv[1])
from test_ms_deform_attn_export import export_fixed_levels
ops = export_fixed_levels(sys.argv[2])
print("RESULTS " + json.dumps({"torch.onnx imported by import deform_conv": imported, "ops": ops}))
"""


def test_onnx_export_of_fixed_levels_after_a_plain_import(tmp_path):
    """A deployed model's attention block (levels fixed, batch and query count dynamic) through both exporters
    after `import deform_conv` alone (no deform_conv.onnx, no translation table): a fresh process, since this
    file's process may have imported deform_conv.onnx through other tests. The import must not import torch.onnx
    (it would lengthen every import); the graphs hold standard operators only, one GridSample a level."""
    needs_onnx()
    child = subprocess.run([sys.executable, "-c", PLAIN_IMPORT_CHILD, str(Path(__file__).parent), str(tmp_path)],
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    line = next(l for l in child.stdout.splitlines() if l.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS "):])
    assert results["torch.onnx imported by import deform_conv"] is False
    outputs = torch.load(tmp_path / "outputs.pt")
    for exporter, ops in results["ops"].items():
        assert all(domain == "" for domain, _ in ops), (exporter, ops)  # no custom domain
        assert [op for _, op in ops].count("GridSample") == len(LEVELS), (exporter, ops)
        for batch, _ in SIZES:
            torch.testing.assert_close(outputs[exporter, batch], outputs["eager", batch], **ONNX_TOL,
                                       msg=lambda m: f"{exporter}, batch {batch}: {m}")


class CallWithLevels(nn.Module):
    def forward(self, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return call(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


NAMES = ["value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights"]


def test_dynamo_export_reads_the_levels_at_run_time(tmp_path):
    """The dynamo-based exporter traces spatial_shapes' values as unknowns, so the graph computes the split and
    the images' shapes from them: one export serves other level sizes (same number of levels)."""
    needs_onnx()
    args = make_args(dtype=torch.float32)
    batch, queries, pixels = torch.export.Dim("batch"), torch.export.Dim("queries"), torch.export.Dim("pixels")
    shapes = {"value": {0: batch, 1: pixels}, "spatial_shapes": None, "level_start_index": None,
              "sampling_locations": {0: batch, 1: queries}, "attention_weights": {0: batch, 1: queries}}
    path = tmp_path / "levels.onnx"
    torch.onnx.export(CallWithLevels(), args, str(path), opset_version=19, input_names=NAMES,
                      dynamic_shapes=shapes)
    for levels, batch, queries in [(LEVELS, 2, 7), ([(4, 7), (5, 2), (2, 2)], 3, 5)]:
        args = make_args(batch, queries, levels, torch.float32, seed=1)
        torch.testing.assert_close(run_onnxruntime(path, dict(zip(NAMES, args))), call(*args), **ONNX_TOL)


def test_torchscript_export_holds_the_levels_as_constants(tmp_path):
    """The TorchScript-based exporter reads the levels while tracing: they leave the graph's inputs, and the
    values it reads are checked as an eager call checks them (the graph would never see them again)."""
    needs_onnx(dynamo=False)
    args = make_args(dtype=torch.float32)
    path = tmp_path / "levels.onnx"
    with pytest.warns(torch.jit.TracerWarning, match="to a Python list"):  # torch's word that the levels are constants
        torch.onnx.export(CallWithLevels(), args, str(path), opset_version=19, dynamo=False, input_names=NAMES)
    feeds = {name: arg for name, arg in zip(NAMES, args) if name not in ("spatial_shapes", "level_start_index")}
    torch.testing.assert_close(run_onnxruntime(path, feeds), call(*args), **ONNX_TOL)

    value, spatial_shapes, level_start_index, locations, weights = args
    bad_starts = level_start_index.clone()
    bad_starts[2] += 1
    with pytest.raises(ValueError, match=r"level_start_index\[2\] must be 42 .*, got 43"):
        torch.onnx.export(CallWithLevels(), (value, spatial_shapes, bad_starts, locations, weights),
                          str(tmp_path / "bad.onnx"), opset_version=19, dynamo=False)


# ------------------------------------------------------------------------------- torch.compile, export, TorchScript

# float64: compiled and eager graphs may order their sums differently, by ~1e-15 in float64, far inside these
# tolerances, while any real divergence shows.
TOL = dict(rtol=1e-10, atol=1e-10)


def attention_step(value, spatial_shapes, level_start_index, offsets, logits):
    """What a compiled Deformable DETR layer puts around the op: the locations and softmax weights computed from
    raw predictions (pointwise work Inductor fuses), and a loss-like reduction after it."""
    batch, queries, heads, levels, points, _ = offsets.shape
    normalizer = spatial_shapes.flip(1).to(offsets.dtype)[:, None]  # [L, 1, 2]: (W_l, H_l)
    locations = 0.5 + offsets / normalizer
    weights = logits.view(batch, queries, heads, levels * points).softmax(-1).view_as(logits)
    return deform_conv.ms_deform_attn(value, spatial_shapes, level_start_index, locations, weights)


def step_args(batch: int, queries: int, seed: int = 0):
    value, spatial_shapes, level_start_index, locations, weights = make_args(batch, queries, seed=seed)
    offsets = (locations - 0.5) * spatial_shapes.flip(1).to(locations.dtype)[:, None]
    return value, spatial_shapes, level_start_index, offsets, weights.log()


def output_and_grads(fn, args):
    leaves = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    out = fn(*leaves)
    out.pow(2).sum().backward()
    return [out.detach()] + [leaf.grad for leaf in leaves if leaf.is_floating_point()]


def assert_same(actual, expected, tol=TOL) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, **tol, msg=lambda m: f"result {i}: {m}")


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    compiled = torch.compile(attention_step, fullgraph=True)  # Inductor; fullgraph: any graph break raises
    args = step_args(2, 7)
    assert_same(output_and_grads(compiled, args), output_and_grads(attention_step, args))


def test_torch_compile_dynamic_compiles_once():
    """Batch and query count symbolic: one compilation (through our fake kernels and autograd formula) serves
    both sizes, forward and backward. The sizes differ from every other dimension of the first call: torch's
    duck sizing gives equal sizes one symbol, so a batch of 2 would share the symbol of the locations' (x, y)
    pair, which the shape check pins to 2, and a later batch of 3 would recompile (as would a size of 1)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(attention_step, fullgraph=True, dynamic=True, backend=counter)
    for batch, queries in [(5, 7), (6, 11)]:
        args = step_args(batch, queries, seed=batch)
        assert_same(output_and_grads(compiled, args), output_and_grads(attention_step, args))
    assert counter.frame_count == 1, f"recompiled for new sizes: {counter.frame_count} compilations"


def test_torch_export_keeps_the_op(tmp_path):
    class Step(nn.Module):
        def forward(self, value, spatial_shapes, level_start_index, offsets, logits):
            return attention_step(value, spatial_shapes, level_start_index, offsets, logits)

    args = step_args(2, 7)
    batch, queries = torch.export.Dim("batch"), torch.export.Dim("queries")
    per_query = {0: batch, 1: queries}
    program = torch.export.export(Step(), args, dynamic_shapes=[{0: batch}, None, None, per_query, per_query])
    ops = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert "deform_conv.ms_deform_attn.default" in ops  # the op itself, not a decomposition of it
    path = tmp_path / "step.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path).module()
    for batch, queries in [(2, 7), (3, 12)]:
        args = step_args(batch, queries, seed=batch)
        torch.testing.assert_close(loaded(*args), attention_step(*args), **TOL)


class Scriptable(nn.Module):
    def forward(self, value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                sampling_locations: torch.Tensor, attention_weights: torch.Tensor) -> torch.Tensor:
        return deform_conv.ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                          attention_weights)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_torchscript_script_forward_backward_and_save(tmp_path):
    scripted = torch.jit.script(Scriptable())
    args = make_args()
    assert_same(output_and_grads(scripted, args), output_and_grads(call, args))
    path = tmp_path / "scripted.pt"
    torch.jit.save(scripted, str(path))
    args = make_args(3, 12, seed=3)
    torch.testing.assert_close(torch.jit.load(str(path))(*args), call(*args), **TOL)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace.*` is deprecated:FutureWarning")
def test_torchscript_trace_records_the_op():
    traced = torch.jit.trace(Scriptable(), make_args())
    assert [node.kind() for node in traced.graph.nodes()] == ["deform_conv::ms_deform_attn"]
    for batch, queries in [(2, 7), (3, 12)]:  # the traced op takes any batch and query count
        args = make_args(batch, queries, seed=batch)
        assert_same(output_and_grads(traced, args), output_and_grads(call, args))


# --------------------------------------------------------------------------------------------------------- autocast


def test_cpu_autocast_bfloat16():
    args = make_args(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(*args)
    assert out.dtype == torch.bfloat16

    # Autocast casts the value to bfloat16 and keeps the locations and weights in float32 (coordinates are never
    # rounded to a half type); the kernel accumulates in float32: the result is the float32 op on the rounded value,
    # rounded once to bfloat16, up to the float32 ~1e-7 of another summation order. A rounding of that sum may tip
    # to the neighbouring bfloat16 value: one ulp, at most 2**-7 relative.
    value_rounded = [a.bfloat16().float() if i == 0 else a for i, a in enumerate(args)]
    torch.testing.assert_close(out.float(), call(*value_rounded), rtol=2**-7, atol=1e-6)

    # Against float32 on the unrounded inputs, from first-order propagation of bfloat16's relative rounding
    # error u = 2**-9 through the weighted sum (weights add up to 1 over each head's levels and points): the value's
    # rounding moves each output by at most u * max|value|, the final rounding adds u * |output| <= u * max|value|.
    # No location term: the locations are not rounded.
    value = args[0]
    u, biggest = 2.0**-9, float(value.abs().max())
    bound = 2 * u * biggest
    error = float((out.float() - call(*args)).abs().max())
    assert error <= bound, f"bfloat16 autocast differs from float32 by {error}, bound {bound}"


# ------------------------------------------------------------------------------------ fake kernels under compile


def test_fake_kernel_refuses_bad_shapes_under_torch_compile():
    """Under torch.compile the op's fake kernels see only shapes: they check them as an eager call does, with
    the same messages, whether the public function or the op itself is compiled, forward and backward."""
    value, spatial_shapes, level_start_index, locations, weights = make_args()
    bad_weights = weights[..., :2]
    # The Python checks' wording (shapes as tuples; the C++ backstop writes lists), whichever layer raises it.
    message = r"attention_weights must have shape \(2, 7, 2, 3, 3\) .*got \(2, 7, 2, 3, 2\)"
    for fn in (call, torch.ops.deform_conv.ms_deform_attn):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):
            torch.compile(fn, fullgraph=True, backend="aot_eager")(
                value, spatial_shapes, level_start_index, locations, bad_weights)

    torch._dynamo.reset()
    backward = torch.compile(torch.ops.deform_conv.ms_deform_attn_backward, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"grad_output must have shape \(2, 7, 8\).*got \(2, 7, 9\)"):
        backward(torch.randn(2, 7, 9, dtype=value.dtype), value, spatial_shapes, level_start_index, locations,
                 weights)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_keeps_locations_float32_on_deformable_detr_levels(dtype):
    """Deformable DETR's levels (100x150 down to 13x19), Lq 300, 8 heads, 32 channels, 4 points, the value in the
    half type (a Linear's output under autocast) and float32 locations and weights: under autocast the error
    against float64 is that of rounding the value alone, plus the output's own rounding. Rounding the locations
    too (a normalised location near 1 is off by up to 2**-9 of a 150-pixel level in bfloat16: 0.3 px) made it
    about 64x that."""
    g = torch.Generator().manual_seed(0)
    levels = [(100, 150), (50, 75), (25, 38), (13, 19)]
    spatial_shapes, level_start_index = level_tensors(levels)
    pixels = int(spatial_shapes.prod(1).sum())
    value = torch.randn(1, pixels, 8, 32, generator=g).to(dtype)
    locations = torch.rand(1, 300, 8, 4, 4, 2, generator=g)
    weights = torch.rand(1, 300, 8, 4, 4, generator=g)
    weights = weights / weights.sum((-1, -2), keepdim=True)
    with torch.autocast("cpu", dtype=dtype):
        out = call(value, spatial_shapes, level_start_index, locations, weights)
    assert out.dtype == dtype
    exact = call(value.double(), spatial_shapes, level_start_index, locations.double(), weights.double())
    # The value is already in the half type: "value-only rounding" is the float64 op on it, exactly `exact`; what
    # remains is the kernel's float32 sum (~1e-6) and the output's rounding, half an ulp of |output| (u * |out|).
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    error = (out.double() - exact).abs()
    bound = u * exact.abs() + 1e-5
    assert bool((error <= bound).all()), f"max error {float(error.max())}, bound {float(bound.max())}"
