"""The op inside real models: torch.compile (fullgraph, dynamic shapes), torch.export (saved and loaded again)
and TorchScript, each against eager on a model that uses every public layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deform_conv
from deform_conv import DeformConv2d, DeformConv2dPack, ModulatedDeformConv2dPack

# float64 throughout: compiled and eager graphs may order their sums differently, and in float64 that moves
# results by ~1e-15, far inside these tolerances, while any real divergence shows.
TOL = dict(rtol=1e-10, atol=1e-10)


class EveryLayer(nn.Module):
    """ModulatedDeformConv2dPack -> DeformConv2dPack (2 weight groups, 2 offset groups) -> DeformConv2d fed by
    a plain conv's offsets and mask, on the awkward stride/dilation."""

    def __init__(self) -> None:
        super().__init__()
        self.modulated = ModulatedDeformConv2dPack(4, 6, 3, padding=1)
        self.pack = DeformConv2dPack(6, 6, 3, padding=1, groups=2, deform_groups=2)
        self.offsets = nn.Conv2d(6, 3 * 3 * 2, (3, 2), stride=(2, 1), padding=(2, 0), dilation=(2, 1))
        self.plain = DeformConv2d(6, 5, (3, 2), stride=(2, 1), padding=(2, 0), dilation=(2, 1))
        with torch.no_grad():  # non-zero offsets, so that sampling is really deformed
            for conv in (self.modulated.conv_offset, self.pack.conv_offset, self.offsets):
                conv.weight.normal_(std=0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pack(torch.relu(self.modulated(x)))
        predicted = self.offsets(y)
        offset, mask = predicted[:, :12], torch.sigmoid(predicted[:, 12:])
        return self.plain(y, offset, mask)


def make_model() -> EveryLayer:
    torch.manual_seed(0)
    return EveryLayer().double()


def make_input(batch: int = 2, height: int = 11, width: int = 9) -> torch.Tensor:
    return torch.randn(batch, 4, height, width, dtype=torch.float64, generator=torch.Generator().manual_seed(batch))


def output_and_param_grads(model: nn.Module, forward, x: torch.Tensor):
    model.zero_grad()
    x = x.clone().requires_grad_()
    out = forward(x)
    out.pow(2).sum().backward()
    return [out.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]


def assert_same(actual, expected) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, **TOL, msg=lambda m: f"result {i}: {m}")


def test_torch_compile_fullgraph_forward_and_backward():
    model = make_model()
    x = make_input()
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: any graph break raises
    assert_same(output_and_param_grads(model, compiled, x), output_and_param_grads(model, model, x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_dynamic_shapes(backend):
    """Batch and spatial sizes symbolic. With aot_eager (Dynamo + AOTAutograd through our fake kernels and
    autograd formula) one compilation serves every shape. Inductor's CPU lowering of plain conv2d specialises
    spatial sizes (a model of two nn.Conv2d recompiles just the same), so there only the results are checked."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = make_model()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    for batch, height, width in [(2, 11, 9), (3, 14, 10), (5, 9, 12)]:  # (a size of 1 would specialise)
        x = make_input(batch, height, width)
        assert_same(output_and_param_grads(model, compiled, x), output_and_param_grads(model, model, x))
    if backend == "aot_eager":
        assert counter.frame_count == 1, f"recompiled for new shapes: {counter.frame_count} compilations"


def test_torch_export_saved_and_loaded(tmp_path):
    model = make_model()
    x = make_input()
    batch, height, width = torch.export.Dim("batch"), torch.export.Dim("height", min=8), torch.export.Dim("width", min=8)
    program = torch.export.export(model, (x,), dynamic_shapes={"x": {0: batch, 2: height, 3: width}})
    path = tmp_path / "model.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path).module()
    for shape in [(2, 11, 9), (3, 14, 10)]:
        x = make_input(*shape)
        torch.testing.assert_close(loaded(x), model(x), **TOL)
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert "deform_conv.deform_conv2d.default" in ops  # the op itself, not a decomposition of it


def test_torchscript_modules_and_function(tmp_path):
    model = make_model()
    x = make_input()
    scripted = torch.jit.script(model)
    assert_same(output_and_param_grads(model, scripted, x), output_and_param_grads(model, model, x))
    path = tmp_path / "model.pt"
    torch.jit.save(scripted, str(path))
    torch.testing.assert_close(torch.jit.load(str(path))(x), model(x), **TOL)

    def call(x: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return deform_conv.deform_conv2d(x, offset, weight, stride=1, padding=[1, 0], dilation=(1, 1))

    weight = torch.randn(3, 4, 3, 2, dtype=torch.float64)
    offset = torch.randn(2, 12, 11, 8, dtype=torch.float64)
    torch.testing.assert_close(torch.jit.script(call)(x, offset, weight), call(x, offset, weight), **TOL)


def test_torchscript_keeps_the_cpp_checks():
    """Scripted code skips the Python checks; the op's own checks still refuse bad input with a clear error."""

    def call(x: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return deform_conv.deform_conv2d(x, offset, weight, padding=1)

    scripted = torch.jit.script(call)
    x = torch.randn(1, 4, 5, 5)
    with pytest.raises(RuntimeError, match=r"offset must have shape \[1, 18, 5, 5\], got \[1, 18, 4, 4\]"):
        scripted(x, torch.randn(1, 18, 4, 4), torch.randn(2, 4, 3, 3))
