"""ONNX export to the standard DeformConv (opset 19) with both exporters, run in onnxruntime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.deform_conv2d import make_case

import deform_conv

onnx = pytest.importorskip("onnx", reason="ONNX export tests need onnx (pip install -e '.[test]')")
ort = pytest.importorskip("onnxruntime", reason="ONNX export tests need onnxruntime (pip install -e '.[test]')")
deform_conv_onnx = pytest.importorskip("deform_conv.onnx")


class CallOp(torch.nn.Module):
    """The functional op on a case's geometry; bias and mask are inputs when the case has them."""

    def __init__(self, case) -> None:
        super().__init__()
        self.case = case

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.case.call(deform_conv.deform_conv2d, list(tensors))


def export(model, args, path, dynamo: bool, **kwargs) -> None:
    if dynamo:
        pytest.importorskip("onnxscript", reason="the dynamo-based exporter needs onnxscript")
        kwargs["custom_translation_table"] = deform_conv_onnx.translation_table()
    torch.onnx.export(model, args, str(path), opset_version=19, dynamo=dynamo, **kwargs)


def run_onnxruntime(path, args):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: a.detach().numpy() for i, a in zip(session.get_inputs(), args)}
    return torch.from_numpy(session.run(None, feeds)[0])


EXPORTERS = pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])


@EXPORTERS
@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_awkward_geometry_exports_to_deform_conv(tmp_path, dynamo, with_mask, with_bias):
    case = make_case(torch.float32, with_mask=with_mask, with_bias=with_bias)
    args = tuple(case.tensors())
    path = tmp_path / "model.onnx"
    export(CallOp(case), args, path, dynamo)

    nodes = [n for n in onnx.load(str(path)).graph.node if n.op_type == "DeformConv"]
    assert len(nodes) == 1 and nodes[0].domain == ""  # the standard operator, not a custom domain
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attributes == dict(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 0], dilations=[2, 1], group=2,
                              offset_group=3)
    inputs = list(nodes[0].input)
    assert len(inputs) == (5 if with_mask else 4 if with_bias else 3)
    if with_mask and not with_bias:
        assert inputs[3] == ""  # bias left out, mask in its place (5th)

    torch.testing.assert_close(run_onnxruntime(path, args), CallOp(case)(*args), rtol=1e-4, atol=1e-4)


@EXPORTERS
def test_pack_layer_with_dynamic_batch(tmp_path, dynamo):
    torch.manual_seed(0)
    model = deform_conv.ModulatedDeformConv2dPack(6, 4, 3, stride=2, padding=1, groups=2, deform_groups=3).eval()
    with torch.no_grad():
        model.conv_offset.weight.normal_(std=0.3)
    x = torch.randn(2, 6, 13, 11)
    path = tmp_path / "pack.onnx"
    if dynamo:
        export(model, (x,), path, dynamo, input_names=["x"], dynamic_shapes={"x": {0: torch.export.Dim("batch")}})
    else:
        export(model, (x,), path, dynamo, input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    for batch in (2, 5):
        x = torch.randn(batch, 6, 13, 11)
        with torch.no_grad():
            torch.testing.assert_close(run_onnxruntime(path, (x,)), model(x), rtol=1e-4, atol=1e-4)


def test_plain_import_is_enough_for_both_exporters():
    """No `import deform_conv.onnx`, no custom_translation_table: the function and every module export to the
    standard DeformConv with dynamic batch and spatial sizes, and onnxruntime agrees at two sizes. A fresh process,
    since this file itself imports deform_conv.onnx (which registers the TorchScript symbolic at import)."""
    pytest.importorskip("onnxscript", reason="the dynamo-based exporter needs onnxscript")
    child = Path(__file__).with_name("onnx_export_child.py")
    result = subprocess.run([sys.executable, str(child)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS "):])
    assert results.pop("torch.onnx imported by import deform_conv") is False  # the warm import stays short
    assert len(results) == 12  # 6 models x 2 exporters
    for key, outcome in results.items():
        assert "error" not in outcome, f"{key}: {outcome.get('error')}"
        assert outcome["deform_conv_nodes"] == 1, key
        assert max(outcome["max_errors"]) < 1e-4, key
