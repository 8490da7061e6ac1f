"""Fixtures that import the unchanged upstream copies (upstream_models/) on deform_conv's shims.

Upstream's files import the compiled extensions at import time (``import DCNv3`` in InternImage's dcnv3_func.py,
``from ..functions import ...`` -> ``DCNv4.functions`` in our dcnv4_modules/functions). Each fixture installs the
shim into a sys.modules cleared of those names, imports the copy (which keeps its references to the shim's module
objects), then puts sys.modules back as it was, so no other test sees ``DCNv3``/``ops_dcnv3``/``DCNv4`` appear."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import pathlib
import sys
import types
from typing import Callable, Iterator, Sequence

import pytest
import torch

from deform_conv.compat import install_dcnv3, install_dcnv4

DCNV3_NAMES = ("DCNv3", "ops_dcnv3", "ops_dcnv3.functions", "ops_dcnv3.modules")
DCNV4_NAMES = ("DCNv4", "DCNv4.ext", "DCNv4.functions", "DCNv4.modules")
HERE = pathlib.Path(__file__).parent


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The tensors here are tiny: torch's intra-op threads only wait on each other (on a loaded 2-core machine a
    DCNv3 forward took 0.4 s with 2 threads, 2 ms with 1). Put back after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def shim_installed(names: Sequence[str], install: Callable[[], object]) -> Iterator[None]:
    """``install()`` into a sys.modules without ``names``; afterwards ``names`` are as they were before."""
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    try:
        install()
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


@pytest.fixture(scope="session")
def upstream_dcnv3() -> types.ModuleType:
    """InternImage's ops_dcnv3.modules.dcnv3 (``DCNv3`` on our ``DCNv3`` extension shim, ``DCNv3_pytorch`` pure)."""
    with shim_installed(DCNV3_NAMES, install_dcnv3):
        importlib.import_module("upstream_models.internimage_ops_dcnv3.functions")
        return importlib.import_module("upstream_models.internimage_ops_dcnv3.modules.dcnv3")


@pytest.fixture(scope="session")
def upstream_dcnv3_functions(upstream_dcnv3) -> types.ModuleType:
    """InternImage's ops_dcnv3.functions.dcnv3_func (``DCNv3Function`` on our shim, ``dcnv3_core_pytorch``)."""
    return importlib.import_module("upstream_models.internimage_ops_dcnv3.functions.dcnv3_func")


@pytest.fixture(scope="session")
def upstream_dcnv4() -> types.ModuleType:
    """The DCNv4 repository's DCNv4.modules package (``DCNv4``, ``FlashDeformAttn``), on our DCNv4.functions."""
    with shim_installed(DCNV4_NAMES, install_dcnv4):
        return importlib.import_module("upstream_models.dcnv4_modules.modules")


def load_intern_image(module_name: str, ops_dcnv3: types.ModuleType) -> types.ModuleType:
    """InternImage's classification/models/intern_image.py (unchanged copy) imported as ``module_name`` while
    sys.modules['ops_dcnv3'] is ``ops_dcnv3``: its ``from ops_dcnv3 import modules as opsm`` binds that package's
    modules, so the same file gives one model class on our shim and another on upstream's ops_dcnv3."""
    saved = sys.modules.get("ops_dcnv3")
    sys.modules["ops_dcnv3"] = ops_dcnv3
    try:
        spec = importlib.util.spec_from_file_location(module_name, HERE / "internimage_models" / "intern_image.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("ops_dcnv3", None)
        else:
            sys.modules["ops_dcnv3"] = saved
    return module


@pytest.fixture(scope="session")
def intern_image_models(upstream_dcnv3) -> types.SimpleNamespace:
    """``ours``: intern_image.py whose opsm is our shim's ops_dcnv3.modules; ``upstream``: the same file whose opsm
    is the upstream copy's modules (DCNv3 on our extension shim, DCNv3_pytorch pure). None without timm."""
    pytest.importorskip("timm", reason="InternImage's intern_image.py imports timm (pyproject's [test] extra)")
    import upstream_models.internimage_ops_dcnv3 as upstream_ops_dcnv3

    with shim_installed(DCNV3_NAMES, install_dcnv3):
        ours = load_intern_image("upstream_models._intern_image_on_deform_conv", sys.modules["ops_dcnv3"])
    upstream = load_intern_image("upstream_models._intern_image_on_upstream_ops_dcnv3", upstream_ops_dcnv3)
    return types.SimpleNamespace(ours=ours, upstream=upstream)


def load_flash_intern_image(module_name: str, dcnv4_package: types.ModuleType) -> types.ModuleType:
    """The DCNv4 repository's classification/models/flash_intern_image.py (unchanged copy in dcnv4_models/)
    imported as ``module_name`` while sys.modules['DCNv4'] is ``dcnv4_package``: its ``import DCNv4`` binds that
    package (``getattr(DCNv4, core_op)`` then picks the module class), after which sys.modules is put back."""
    saved = sys.modules.get("DCNv4")
    sys.modules["DCNv4"] = dcnv4_package
    try:
        spec = importlib.util.spec_from_file_location(module_name, HERE / "dcnv4_models" / "flash_intern_image.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("DCNv4", None)
        else:
            sys.modules["DCNv4"] = saved
    return module


@pytest.fixture(scope="session")
def flash_intern_image_models(upstream_dcnv4) -> types.SimpleNamespace:
    """``ours``: flash_intern_image.py on install_dcnv4()'s ``DCNv4`` package (DCNv4.DCNv4 is deform_conv.nn.DCNv4);
    ``upstream``: the same file on a ``DCNv4`` package whose DCNv4 is the upstream module copy (dcnv4_modules/, on
    our DCNv4Function); ``shim``: the installed package. Skipped without timm."""
    pytest.importorskip("timm", reason="flash_intern_image.py imports timm (pyproject's [test] extra)")
    with shim_installed(DCNV4_NAMES, install_dcnv4):
        shim = sys.modules["DCNv4"]
        ours = load_flash_intern_image("upstream_models._flash_intern_image_on_deform_conv", shim)
    upstream_package = types.ModuleType("DCNv4")
    upstream_package.DCNv4 = upstream_dcnv4.DCNv4
    upstream_package.FlashDeformAttn = upstream_dcnv4.FlashDeformAttn
    upstream = load_flash_intern_image("upstream_models._flash_intern_image_on_upstream_dcnv4", upstream_package)
    return types.SimpleNamespace(ours=ours, upstream=upstream, shim=shim)
