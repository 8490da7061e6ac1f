"""Run by test_onnx.py in a fresh process: after a plain `import deform_conv` (nothing else of ours imported, no
translation table passed), both exporters turn the function and every module into the standard DeformConv, with
dynamic batch and spatial sizes; onnxruntime runs each export at two sizes. Prints one JSON line of results."""

import json
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import deform_conv

results = {"torch.onnx imported by import deform_conv": "torch.onnx" in sys.modules}

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402


class Function(nn.Module):
    """deform_conv2d with offsets (and a mask) predicted by plain convolutions; bias and mask optional."""

    def __init__(self, bias: bool, mask: bool) -> None:
        super().__init__()
        self.offset = nn.Conv2d(6, 2 * 3 * 6, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1))
        self.mask = nn.Conv2d(6, 3 * 6, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(2, 1)) if mask else None
        self.weight = nn.Parameter(torch.randn(4, 3, 3, 2))
        self.bias = nn.Parameter(torch.randn(4)) if bias else None

    def forward(self, x):
        mask = torch.sigmoid(self.mask(x)) if self.mask is not None else None
        return deform_conv.deform_conv2d(x, self.offset(x), self.weight, self.bias, (2, 1), (1, 0), (2, 1), mask)


class Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Conv2d(6, 2 * 2 * 9, 3, padding=1)
        self.mask = nn.Conv2d(6, 2 * 9, 3, padding=1)
        self.conv = deform_conv.DeformConv2d(6, 4, 3, padding=1, groups=2)

    def forward(self, x):
        return self.conv(x, self.offset(x), torch.sigmoid(self.mask(x)))


torch.manual_seed(0)
MODELS = {
    "function (bias, mask)": Function(bias=True, mask=True),
    "function (mask, no bias)": Function(bias=False, mask=True),
    "function (no bias, no mask)": Function(bias=False, mask=False),
    "DeformConv2d": Module(),
    "DeformConv2dPack": deform_conv.DeformConv2dPack(6, 4, 3, stride=2, padding=1, deform_groups=3),
    "ModulatedDeformConv2dPack": deform_conv.ModulatedDeformConv2dPack(6, 4, 3, padding=1, groups=2, deform_groups=3),
}
for model in MODELS.values():
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    model.eval()

directory = Path(tempfile.mkdtemp())
for name, model in MODELS.items():
    for dynamo in (True, False):
        path = directory / "model.onnx"
        x = torch.randn(2, 6, 13, 11)
        key = f"{name} / {'dynamo' if dynamo else 'torchscript'}"
        try:
            if dynamo:  # the default exporter: no dynamo= argument
                batch, height, width = torch.export.Dim("batch"), torch.export.Dim("height", min=5), \
                    torch.export.Dim("width", min=5)
                torch.onnx.export(model, (x,), str(path), opset_version=19, input_names=["x"],
                                  dynamic_shapes={"x": {0: batch, 2: height, 3: width}})
            else:
                torch.onnx.export(model, (x,), str(path), opset_version=19, dynamo=False, input_names=["x"],
                                  dynamic_axes={"x": {0: "batch", 2: "height", 3: "width"}})
            graph = onnx.load(str(path)).graph
            nodes = [n.op_type for n in graph.node if n.op_type == "DeformConv" and n.domain == ""]
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            errors = []
            for shape in ((2, 6, 13, 11), (3, 6, 9, 16)):
                x = torch.randn(*shape)
                got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
                with torch.no_grad():
                    want = model(x)
                errors.append(float((got - want).abs().max()) if got.shape == want.shape else float("inf"))
            results[key] = {"deform_conv_nodes": len(nodes), "max_errors": errors}
        except Exception as exc:  # reported, and the test fails on it
            results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
print("RESULTS " + json.dumps(results))
