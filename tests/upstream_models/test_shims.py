"""deform_conv.compat.install_dcnv3 / install_dcnv4: the stand-ins for InternImage's ``DCNv3`` extension and
``ops_dcnv3`` package and for the DCNv4 package, called the way upstream's Python calls them (argument order as in
InternImage's ops_dcnv3/functions/dcnv3_func.py, versions 1.0 and 1.1, and the DCNv4 repository's
DCNv4/functions/*.py; see upstream_models/ for the copies), against deform_conv's ops. Every test starts with those
names out of sys.modules and leaves sys.modules as it found it (monkeypatch)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch

import deform_conv
from deform_conv.compat import install_dcnv3, install_dcnv4
from deform_conv import nn as dnn

F64 = torch.float64
DCNV3_NAMES = ("DCNv3", "ops_dcnv3", "ops_dcnv3.functions", "ops_dcnv3.modules")
DCNV4_NAMES = ("DCNv4", "DCNv4.ext", "DCNv4.functions", "DCNv4.modules")


def _without(monkeypatch, names):
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # records the entry (or its absence) for monkeypatch's undo
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def no_dcnv3(monkeypatch):
    _without(monkeypatch, DCNV3_NAMES)


@pytest.fixture
def no_dcnv4(monkeypatch):
    _without(monkeypatch, DCNV4_NAMES)


def _close(actual, expected, what):
    assert actual.shape == expected.shape, what
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= 1e-12 * scale + 1e-14, f"{what}: {error:.3e} (max |expected| {scale:.3e})"


# ------------------------------------------------------------------------------------------------------ DCNv3

# Non-square, so that swapping h and w anywhere changes shapes or values.
KH, KW, SH, SW, PH, PW, DH, DW = 3, 5, 2, 1, 1, 2, 1, 2
GROUP, GROUP_CHANNELS = 2, 3


def _dcnv3_case(remove_center=False, seed=0, kernel=(KH, KW)):
    generator = torch.Generator().manual_seed(seed)
    kh, kw = kernel
    height, width = 7, 9
    out_h = (height + 2 * PH - (DH * (kh - 1) + 1)) // SH + 1
    out_w = (width + 2 * PW - (DW * (kw - 1) + 1)) // SW + 1
    points = kh * kw - int(remove_center)
    x = torch.randn(2, height, width, GROUP * GROUP_CHANNELS, dtype=F64, generator=generator)
    offset = torch.randn(2, out_h, out_w, GROUP * points * 2, dtype=F64, generator=generator)
    mask = torch.rand(2, out_h, out_w, GROUP * points, dtype=F64, generator=generator)
    grad_output = torch.randn(2, out_h, out_w, GROUP * GROUP_CHANNELS, dtype=F64, generator=generator)
    return x, offset, mask, grad_output


def _dcnv3_expected(x, offset, mask, grad_output, kernel, scale, remove_center):
    leaves = [t.detach().requires_grad_() for t in (x, offset, mask)]
    out = deform_conv.dcnv3(*leaves, kernel, (SH, SW), (PH, PW), (DH, DW), GROUP, scale, remove_center)
    return out.detach(), torch.autograd.grad(out, leaves, grad_output)


@pytest.mark.parametrize("version, remove_center", [("1.1", False), ("1.1", True), ("1.0", False)],
                         ids=["1.1", "1.1_remove_center", "1.0"])
def test_dcnv3_extension_functions(no_dcnv3, version, remove_center):
    """DCNv3.dcnv3_forward / dcnv3_backward with the extension's arguments in its order: version 1.1's
    (remove_center last) and 1.0's (none: all points), as dcnv3_func.py calls them; no autograd graph recorded."""
    extension = install_dcnv3()
    import DCNv3 as imported

    assert imported is extension and sys.modules["DCNv3"] is extension
    kernel = (3, 3) if remove_center else (KH, KW)  # remove_center: odd square kernels
    x, offset, mask, grad_output = _dcnv3_case(remove_center, kernel=kernel)
    scale, im2col_step = 1.5, 64
    head = [x.requires_grad_(), offset, mask, kernel[0], kernel[1], SH, SW, PH, PW, DH, DW, GROUP, GROUP_CHANNELS,
            scale]
    tail = [] if version == "1.0" else [int(remove_center)]
    expected, expected_grads = _dcnv3_expected(x, offset, mask, grad_output, kernel, scale, remove_center)

    output = extension.dcnv3_forward(*head, im2col_step, *tail)
    assert not output.requires_grad and output.grad_fn is None
    _close(output, expected, "forward")
    grads = extension.dcnv3_backward(*head, grad_output, im2col_step, *tail)
    assert len(grads) == 3
    for name, g, e in zip(("input", "offset", "mask"), grads, expected_grads):
        _close(g, e, f"grad {name}")


def test_dcnv3_extension_checks_group_channels(no_dcnv3):
    extension = install_dcnv3()
    x, offset, mask, _ = _dcnv3_case()
    with pytest.raises(ValueError, match="group_channels"):
        extension.dcnv3_forward(x, offset, mask, KH, KW, SH, SW, PH, PW, DH, DW, GROUP, GROUP_CHANNELS + 1, 1.0, 64,
                                0)


def test_ops_dcnv3_function_and_modules(no_dcnv3):
    """ops_dcnv3.functions.DCNv3Function.apply (16 arguments, and 15 without remove_center) is deform_conv.dcnv3,
    differentiable; dcnv3_core_pytorch too; `from ops_dcnv3 import modules as opsm` gives deform_conv.nn.DCNv3 as
    both DCNv3 and DCNv3_pytorch, which build and run."""
    install_dcnv3()
    import ops_dcnv3
    import ops_dcnv3.functions
    from ops_dcnv3 import modules as opsm

    assert importlib.util.find_spec("DCNv3") is not None and importlib.util.find_spec("ops_dcnv3") is not None
    x, offset, mask, grad_output = _dcnv3_case(seed=1)
    expected, expected_grads = _dcnv3_expected(x, offset, mask, grad_output, (KH, KW), 2.0, False)
    for extra in ([64, 0], [64]):
        leaves = [t.detach().requires_grad_() for t in (x, offset, mask)]
        out = ops_dcnv3.functions.DCNv3Function.apply(*leaves, KH, KW, SH, SW, PH, PW, DH, DW, GROUP,
                                                      GROUP_CHANNELS, 2.0, *extra)
        _close(out, expected, "DCNv3Function forward")
        for name, g, e in zip(("input", "offset", "mask"), torch.autograd.grad(out, leaves, grad_output),
                              expected_grads):
            _close(g, e, f"DCNv3Function grad {name}")
    core = ops_dcnv3.functions.dcnv3_core_pytorch(x, offset, mask, KH, KW, SH, SW, PH, PW, DH, DW, GROUP,
                                                  GROUP_CHANNELS, 2.0, 0)
    _close(core, expected, "dcnv3_core_pytorch")

    assert getattr(opsm, "DCNv3") is dnn.DCNv3 and getattr(opsm, "DCNv3_pytorch") is dnn.DCNv3
    assert sys.modules["ops_dcnv3.modules"] is opsm is ops_dcnv3.modules
    layer = getattr(opsm, "DCNv3")(channels=8, group=2).to(F64)
    assert layer(torch.randn(1, 5, 6, 8, dtype=F64)).shape == (1, 5, 6, 8)


def test_install_dcnv3_twice_returns_the_same_module(no_dcnv3):
    first = install_dcnv3()
    modules = {name: sys.modules[name] for name in DCNV3_NAMES}
    assert install_dcnv3() is first
    assert {name: sys.modules[name] for name in DCNV3_NAMES} == modules
    assert install_dcnv3(replace=True) is first


@pytest.mark.parametrize("taken", DCNV3_NAMES)
def test_install_dcnv3_refuses_another_module(no_dcnv3, monkeypatch, taken):
    """Another module at any of the names: RuntimeError, nothing installed; replace=True installs ours."""
    other = types.ModuleType(taken)
    monkeypatch.setitem(sys.modules, taken, other)
    with pytest.raises(RuntimeError, match="replace=True"):
        install_dcnv3()
    assert sys.modules[taken] is other
    assert all(name not in sys.modules for name in DCNV3_NAMES if name != taken)
    extension = install_dcnv3(replace=True)
    assert sys.modules["DCNv3"] is extension and sys.modules[taken] is not other
    assert hasattr(sys.modules["ops_dcnv3.modules"], "DCNv3")


# ------------------------------------------------------------------------------------------------------ DCNv4

def _dcnv4_case(kernel=(KH, KW), remove_center=False, seed=0, padding_channels=5):
    generator = torch.Generator().manual_seed(seed)
    kh, kw = kernel
    height, width = 7, 9
    out_h = (height + 2 * PH - (DH * (kh - 1) + 1)) // SH + 1
    out_w = (width + 2 * PW - (DW * (kw - 1) + 1)) // SW + 1
    points = kh * kw - int(remove_center)
    x = torch.randn(2, height, width, GROUP * GROUP_CHANNELS, dtype=F64, generator=generator)
    offset_mask = torch.randn(2, out_h, out_w, GROUP * points * 3 + padding_channels, dtype=F64, generator=generator)
    grad_output = torch.randn(2, out_h, out_w, GROUP * GROUP_CHANNELS, dtype=F64, generator=generator)
    return x, offset_mask, grad_output


def _dcnv4_expected(x, offset_mask, grad_output, kernel, scale, remove_center, softmax):
    leaves = [t.detach().requires_grad_() for t in (x, offset_mask)]
    out = deform_conv.dcnv4(*leaves, kernel, (SH, SW), (PH, PW), (DH, DW), GROUP, scale, remove_center, softmax)
    return out.detach(), torch.autograd.grad(out, leaves, grad_output)


@pytest.mark.parametrize("softmax", [False, True], ids=["no_softmax", "softmax"])
@pytest.mark.parametrize("remove_center", [False, True], ids=["all_points", "remove_center"])
def test_dcnv4_extension_functions(no_dcnv4, softmax, remove_center):
    """DCNv4.ext.dcnv4_forward / dcnv4_backward with dcnv4_func.py's arguments (d_stride and block_thread
    accepted, whatever their values, and ignored); no graph recorded."""
    package = install_dcnv4()
    from DCNv4 import ext

    assert ext is package.ext is sys.modules["DCNv4.ext"]
    kernel = (3, 3) if remove_center else (KH, KW)
    x, offset_mask, grad_output = _dcnv4_case(kernel, remove_center)
    scale = 0.75
    head = [x.requires_grad_(), offset_mask, kernel[0], kernel[1], SH, SW, PH, PW, DH, DW, GROUP, GROUP_CHANNELS,
            scale, 256]
    expected, expected_grads = _dcnv4_expected(x, offset_mask, grad_output, kernel, scale, remove_center, softmax)
    for d_stride, block_thread in ((8, 96), (1, 0), (2, 256)):
        output = ext.dcnv4_forward(*head, int(remove_center), d_stride, block_thread, softmax)
        assert not output.requires_grad
        _close(output, expected, f"forward d_stride={d_stride}")
        grads = ext.dcnv4_backward(*head, grad_output, int(remove_center), d_stride, block_thread, softmax)
        assert len(grads) == 2
        for name, g, e in zip(("input", "offset_mask"), grads, expected_grads):
            _close(g, e, f"grad {name} d_stride={d_stride}")
    # Upstream's defaults for the tuning arguments, and softmax False by default.
    if not softmax:
        _close(ext.dcnv4_forward(*head, int(remove_center)), expected, "forward with defaults")


def _flash_case(seed=0, points=3):
    generator = torch.Generator().manual_seed(seed)
    shapes = torch.tensor([[5, 6], [3, 2]], dtype=torch.long)
    starts = torch.tensor([0, 30], dtype=torch.long)
    heads, channels, queries, levels = 2, 4, 5, 2
    value = torch.randn(2, 36, heads, channels, dtype=F64, generator=generator)
    locations = torch.rand(2, queries, heads, levels * points * 2, dtype=F64, generator=generator) * 1.2 - 0.1
    logits = torch.randn(2, queries, heads, levels * points, dtype=F64, generator=generator)
    grad_output = torch.randn(2, queries, heads * channels, dtype=F64, generator=generator)
    return value, shapes, starts, torch.cat([locations, logits], -1), grad_output


def test_flash_deform_attn_extension_functions(no_dcnv4):
    """DCNv4.ext.flash_deform_attn_forward / _backward with flash_deform_attn_func.py's arguments (im2col_step,
    K, d_stride, block_thread)."""
    ext = install_dcnv4().ext
    points = 3
    value, shapes, starts, sampling_loc_attn, grad_output = _flash_case(points=points)
    leaves = [value.detach().requires_grad_(), sampling_loc_attn.detach().requires_grad_()]
    expected = deform_conv.flash_deform_attn(leaves[0], shapes, starts, leaves[1], points)
    expected_grads = torch.autograd.grad(expected, leaves, grad_output)
    for d_stride, block_thread in ((8, 64), (1, 0)):
        output = ext.flash_deform_attn_forward(value, shapes, starts, sampling_loc_attn, 64, points, d_stride,
                                               block_thread)
        _close(output, expected.detach(), "forward")
        grads = ext.flash_deform_attn_backward(value, shapes, starts, sampling_loc_attn, grad_output, 64, points,
                                               d_stride, block_thread)
        assert len(grads) == 2
        for name, g, e in zip(("value", "sampling_loc_attn"), grads, expected_grads):
            _close(g, e, f"grad {name}")


def test_dcnv4_package_functions_and_modules(no_dcnv4):
    """DCNv4.DCNv4 / FlashDeformAttn are ours (also under DCNv4.modules); DCNv4Function.apply and
    FlashDeformAttnFunction.apply (also under DCNv4.functions) with upstream's arguments are deform_conv.dcnv4 and
    deform_conv.flash_deform_attn, differentiable."""
    package = install_dcnv4()
    import DCNv4
    import DCNv4.functions
    import DCNv4.modules
    from DCNv4.functions import DCNv4Function, FlashDeformAttnFunction

    assert DCNv4 is package
    assert DCNv4.DCNv4 is DCNv4.modules.DCNv4 is dnn.DCNv4
    assert DCNv4.FlashDeformAttn is DCNv4.modules.FlashDeformAttn is dnn.FlashDeformAttn
    assert DCNv4.DCNv4Function is DCNv4Function and DCNv4.FlashDeformAttnFunction is FlashDeformAttnFunction
    assert importlib.util.find_spec("DCNv4") is not None

    x, offset_mask, grad_output = _dcnv4_case(seed=2)
    expected, expected_grads = _dcnv4_expected(x, offset_mask, grad_output, (KH, KW), 1.0, False, False)
    leaves = [t.detach().requires_grad_() for t in (x, offset_mask)]
    out = DCNv4.DCNv4Function.apply(*leaves, KH, KW, SH, SW, PH, PW, DH, DW, GROUP, GROUP_CHANNELS, 1.0, 256, 0)
    _close(out, expected, "DCNv4Function forward")
    for name, g, e in zip(("input", "offset_mask"), torch.autograd.grad(out, leaves, grad_output), expected_grads):
        _close(g, e, f"DCNv4Function grad {name}")

    points = 3
    value, shapes, starts, sampling_loc_attn, grad_output = _flash_case(seed=3, points=points)
    leaves = [value.detach().requires_grad_(), sampling_loc_attn.detach().requires_grad_()]
    expected = deform_conv.flash_deform_attn(leaves[0], shapes, starts, leaves[1], points)
    expected_grads = torch.autograd.grad(expected, leaves, grad_output)
    leaves = [value.detach().requires_grad_(), sampling_loc_attn.detach().requires_grad_()]
    out = DCNv4.FlashDeformAttnFunction.apply(leaves[0], shapes, starts, leaves[1], 64, points)
    _close(out, expected.detach(), "FlashDeformAttnFunction forward")
    for name, g, e in zip(("value", "sampling_loc_attn"), torch.autograd.grad(out, leaves, grad_output),
                          expected_grads):
        _close(g, e, f"FlashDeformAttnFunction grad {name}")

    layer = DCNv4.DCNv4(channels=32, group=2).to(F64)
    assert layer(torch.randn(1, 25, 32, dtype=F64)).shape == (1, 25, 32)


def test_install_dcnv4_twice_returns_the_same_module(no_dcnv4):
    first = install_dcnv4()
    modules = {name: sys.modules[name] for name in DCNV4_NAMES}
    assert install_dcnv4() is first
    assert {name: sys.modules[name] for name in DCNV4_NAMES} == modules
    assert install_dcnv4(replace=True) is first


@pytest.mark.parametrize("taken", DCNV4_NAMES)
def test_install_dcnv4_refuses_another_module(no_dcnv4, monkeypatch, taken):
    other = types.ModuleType(taken)
    monkeypatch.setitem(sys.modules, taken, other)
    with pytest.raises(RuntimeError, match="replace=True"):
        install_dcnv4()
    assert sys.modules[taken] is other
    assert all(name not in sys.modules for name in DCNV4_NAMES if name != taken)
    package = install_dcnv4(replace=True)
    assert sys.modules["DCNv4"] is package and sys.modules[taken] is not other
    assert importlib.import_module("DCNv4.ext") is package.ext


def test_extension_functions_ignore_autocast_as_compiled_ones_do():
    """The extension's functions stand for compiled code, which autocast does not touch: under bfloat16 autocast
    float32 tensors give a float32 result, and the backward takes the float32 grad_output InternImage's
    DCNv3Function (custom_fwd) hands it."""
    import sys

    from deform_conv.compat import install_dcnv3

    saved = {name: sys.modules.pop(name) for name in ("DCNv3", "ops_dcnv3", "ops_dcnv3.functions",
                                                       "ops_dcnv3.modules") if name in sys.modules}
    try:
        extension = install_dcnv3()
        x, offset, mask = torch.randn(1, 5, 5, 4), torch.randn(1, 5, 5, 36), torch.rand(1, 5, 5, 18)
        args = (3, 3, 1, 1, 1, 1, 1, 1, 2, 2, 1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = extension.dcnv3_forward(x, offset, mask, *args, 64, 0)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, deform_conv.dcnv3(x, offset, mask, 3, 1, 1, 1, 2))
        grads = extension.dcnv3_backward(x, offset, mask, *args, torch.ones_like(out), 64, 0)
        assert [g.dtype for g in grads] == [torch.float32] * 3
    finally:
        for name in ("DCNv3", "ops_dcnv3", "ops_dcnv3.functions", "ops_dcnv3.modules"):
            sys.modules.pop(name, None)
        sys.modules.update(saved)
