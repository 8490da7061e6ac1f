"""dcnv3, dcnv4 and flash_deform_attn inside compiled code: torch.compile (fullgraph, dynamic shapes) forward and
backward against eager, torch.export (one call of the op in the graph, saved, loaded and run), and torch.fx
symbolic tracing (the public functions hand a Proxy call to __torch_function__)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deform_conv

from helpers.family import level_tensors

# float64: compiled and eager graphs may order their sums differently, by ~1e-15 in float64, far inside these
# tolerances, while any real divergence shows.
TOL = dict(rtol=1e-10, atol=1e-10)

GROUP, CHANNELS = 3, 5
KERNEL, STRIDE, PADDING, DILATION = (3, 2), (2, 1), (1, 0), (2, 1)
K = KERNEL[0] * KERNEL[1]
LEVELS = [(5, 7), (1, 1), (3, 2)]
POINTS = 2


def dcnv3_step(input, offset, mask_logits):
    """InternImage's block around the op: the mask a softmax over each group's points (pointwise work the
    compiler fuses), the offsets scaled."""
    n, ho, wo, _ = mask_logits.shape
    mask = mask_logits.view(n, ho, wo, GROUP, K).softmax(-1).view(n, ho, wo, GROUP * K)
    return deform_conv.dcnv3(input, offset * 0.5, mask, KERNEL, STRIDE, PADDING, DILATION, GROUP, 2.0, False)


def dcnv4_step(input, offset_mask):
    return deform_conv.dcnv4(torch.tanh(input), offset_mask, KERNEL, STRIDE, PADDING, DILATION, GROUP, 0.5, False,
                             True)


def flash_step(value, spatial_shapes, level_start_index, sampling_loc_attn):
    return deform_conv.flash_deform_attn(value * 2, spatial_shapes, level_start_index, sampling_loc_attn, POINTS)


def out_size(height, width):
    return ((height + 2 * PADDING[0] - DILATION[0] * (KERNEL[0] - 1) - 1) // STRIDE[0] + 1,
            (width + 2 * PADDING[1] - DILATION[1] * (KERNEL[1] - 1) - 1) // STRIDE[1] + 1)


def step_args(op: str, batch: int = 2, height: int = 7, width: int = 6, queries: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return std * torch.randn(*shape, dtype=torch.float64, generator=g)

    if op == "flash_deform_attn":
        spatial_shapes, level_start_index = level_tensors(LEVELS)
        points = len(LEVELS) * POINTS
        locations = -0.2 + 1.4 * torch.rand(batch, queries, GROUP, 2 * points, dtype=torch.float64, generator=g)
        sla = torch.cat([locations, randn(batch, queries, GROUP, points)], -1)
        return randn(batch, 42, GROUP, CHANNELS), spatial_shapes, level_start_index, sla
    ho, wo = out_size(height, width)
    input = randn(batch, height, width, GROUP * CHANNELS)
    if op == "dcnv3":
        return input, randn(batch, ho, wo, GROUP * K * 2, std=2.0), randn(batch, ho, wo, GROUP * K)
    return input, randn(batch, ho, wo, GROUP * K * 3 + 4, std=2.0)


STEPS = {"dcnv3": dcnv3_step, "dcnv4": dcnv4_step, "flash_deform_attn": flash_step}


def output_and_grads(fn, args):
    leaves = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    out = fn(*leaves)
    out.pow(2).sum().backward()
    return [out.detach()] + [leaf.grad for leaf in leaves if leaf.is_floating_point()]


def assert_same(actual, expected) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, **TOL, msg=lambda m: f"result {i}: {m}")


@pytest.mark.parametrize("op", sorted(STEPS))
def test_torch_compile_fullgraph_forward_and_backward(op):
    torch._dynamo.reset()
    compiled = torch.compile(STEPS[op], fullgraph=True)  # Inductor; fullgraph: any graph break raises
    args = step_args(op)
    assert_same(output_and_grads(compiled, args), output_and_grads(STEPS[op], args))


# (batch, height, width, queries): each size differs from every other dimension of the first call (duck sizing
# gives equal sizes one symbol) and from 1 (which would specialise).
DYNAMIC_SIZES = [(4, 11, 13, 9), (6, 16, 10, 17)]


@pytest.mark.parametrize("op", sorted(STEPS))
def test_torch_compile_dynamic_compiles_once(op):
    """Batch and spatial sizes (queries) symbolic: one compilation through the fake kernels and the autograd
    formula (aot_eager: Dynamo and AOTAutograd, without Inductor's code generation, which the test above runs)
    serves both sizes, forward and backward, with eager's results."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(STEPS[op], fullgraph=True, dynamic=True, backend=counter)
    for batch, height, width, queries in DYNAMIC_SIZES:
        args = step_args(op, batch, height, width, queries, seed=batch)
        assert_same(output_and_grads(compiled, args), output_and_grads(STEPS[op], args))
    assert counter.frame_count == 1, f"recompiled for new sizes: {counter.frame_count} compilations"


class Dcnv3Block(nn.Module):
    """A deployed DCNv3 layer: offsets and mask predicted from the input by a Linear, channels last."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.offset = nn.Linear(GROUP * CHANNELS, GROUP * K * 3).double()
        self.output = nn.Linear(GROUP * CHANNELS, GROUP * CHANNELS).double()

    def forward(self, x):
        predicted = self.offset(x)[:, :-1:2, :-1]  # the output's rows and columns (for an odd H)
        offset, mask_logits = predicted[..., : GROUP * K * 2], predicted[..., GROUP * K * 2:]
        return self.output(dcnv3_step(x, offset, mask_logits))


def block_input(batch: int, height: int, width: int = 6) -> torch.Tensor:
    return torch.randn(batch, height, width, GROUP * CHANNELS, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(batch))


def test_torch_export_keeps_the_op_and_saves(tmp_path):
    model = Dcnv3Block()
    x = block_input(2, 7)
    assert model(x).shape == (2, 3, 5, GROUP * CHANNELS)
    program = torch.export.export(model, (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    calls = [node for node in program.graph.nodes if node.op == "call_function"
             and str(node.target).startswith("deform_conv.")]
    assert [str(node.target) for node in calls] == ["deform_conv.dcnv3.default"]  # the op, once, not decomposed
    path = tmp_path / "dcnv3.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path).module()
    for batch in (2, 3):
        x = block_input(batch, 7)
        torch.testing.assert_close(loaded(x), model(x), **TOL)


@pytest.mark.parametrize("op", sorted(STEPS))
def test_fx_symbolic_trace_sees_one_call(op):
    """symbolic_trace of a function calling the op: one call_function node for it, the traced module giving the
    same outputs and gradients."""
    traced = torch.fx.symbolic_trace(STEPS[op])
    targets = [node.target for node in traced.graph.nodes if node.op == "call_function"]
    public = getattr(deform_conv, op)
    assert targets.count(public) == 1, targets
    args = step_args(op)
    assert_same(output_and_grads(traced, args), output_and_grads(STEPS[op], args))


# The steps above as modules for torch.jit.script, which reads no module-level constant: the same values written out
# (test_the_scripted_steps_use_the_constants checks that they are).
class _Dcnv3Step(nn.Module):
    def forward(self, input, offset, mask_logits):
        n, ho, wo = mask_logits.shape[0], mask_logits.shape[1], mask_logits.shape[2]
        mask = mask_logits.view(n, ho, wo, 3, 6).softmax(-1).view(n, ho, wo, 18)
        return deform_conv.dcnv3(input, offset * 0.5, mask, (3, 2), (2, 1), (1, 0), (2, 1), 3, 2.0, False)


class _Dcnv4Step(nn.Module):
    def forward(self, input, offset_mask):
        return deform_conv.dcnv4(torch.tanh(input), offset_mask, (3, 2), (2, 1), (1, 0), (2, 1), 3, 0.5, False, True)


class _FlashStep(nn.Module):
    def forward(self, value, spatial_shapes, level_start_index, sampling_loc_attn):
        return deform_conv.flash_deform_attn(value * 2, spatial_shapes, level_start_index, sampling_loc_attn, 2)


def test_the_scripted_steps_use_the_constants():
    assert (GROUP, K, KERNEL, STRIDE, PADDING, DILATION, POINTS) == (3, 6, (3, 2), (2, 1), (1, 0), (2, 1), 2)


@pytest.mark.parametrize("op", sorted(STEPS))
def test_torchscript_script_forward_backward_and_save(op, tmp_path):
    """torch.jit.script compiles each op's function (its pairs converted in TorchScript), calls the op, and the
    saved and loaded module computes the same, forward and backward."""
    module = {"dcnv3": _Dcnv3Step, "dcnv4": _Dcnv4Step, "flash_deform_attn": _FlashStep}[op]()
    scripted = torch.jit.script(module)
    torch.jit.save(scripted, str(tmp_path / "step.pt"))
    loaded = torch.jit.load(str(tmp_path / "step.pt"))
    args = step_args(op)
    expected = output_and_grads(STEPS[op], args)
    assert_same(output_and_grads(scripted, args), expected)
    assert_same(output_and_grads(loaded, args), expected)
