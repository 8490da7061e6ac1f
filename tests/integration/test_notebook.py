"""A build in a Jupyter kernel: its progress is one output updated in place, so an executed notebook (nbclient,
as nbconvert --execute and papermill run it) saves a few lines of it rather than one per second."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

from deform_conv._jit import progress as _progress

from helpers.loader import child_env, fast_compiler

MISSING = [name for name in ("nbclient", "nbformat", "ipykernel") if importlib.util.find_spec(name) is None]
needs_jupyter = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (pip install -e '.[test]')")

# Long enough for several ticks of the progress, which without the display handle are outputs of their own.
LINK_SECONDS = 6


def _slow_link_compiler(directory: Path) -> Path:
    fast = fast_compiler(directory)
    wrapper = directory / "slow-link-c++"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -shared "*) sleep {LINK_SECONDS} ;; esac\nexec "{fast}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _lines(output) -> list:
    """The lines a notebook shows for one output: '\\r' rewrites a line, it does not start one."""
    if output["output_type"] == "stream":
        text = output["text"]
    else:
        text = output.get("data", {}).get("text/plain", "")
    return [line for line in text.split("\n") if line.strip("\r ")]


@needs_jupyter
def test_an_executed_notebook_keeps_at_most_three_lines_of_a_build(tmp_path):
    import nbclient
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_code_cell(
        "import deform_conv\nprint('entry', deform_conv.libraries[0].from_cache)"))
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=600)
    # The kernel's whole environment: a fresh cache and a build that takes LINK_SECONDS and a few more.
    client.execute(env=child_env(tmp_path / "cache", CXX=str(_slow_link_compiler(tmp_path / "tools"))))
    nbformat.write(notebook, tmp_path / "executed.ipynb")

    outputs = nbformat.read(tmp_path / "executed.ipynb", as_version=4).cells[0].outputs
    build = [line for output in outputs for line in _lines(output) if "deform_conv:" in line]
    assert "entry False" in "".join(output.get("text", "") for output in outputs), outputs  # it did build
    assert len(build) <= 3, f"{len(build)} lines of build output saved:\n" + "\n".join(map(repr, build))
    assert "compiled the CPU kernels in" in build[-1], build
    shown = [output for output in outputs if output["output_type"] == "display_data"]
    assert len(shown) == 1 and "compiling the CPU kernels:" in shown[0]["data"]["text/plain"], outputs


def _ipython(monkeypatch, shell) -> None:
    """ipykernel imported, and IPython.get_ipython() returning ``shell`` (None: IPython cannot be imported)."""
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    ipython = types.ModuleType("IPython")
    if shell is not None:
        ipython.get_ipython = lambda: shell
    monkeypatch.setitem(sys.modules, "IPython", ipython)


def test_only_a_kernels_shell_gets_the_display(monkeypatch):
    _ipython(monkeypatch, types.SimpleNamespace(kernel=object()))
    assert _progress._mode() == "display"
    # A terminal IPython, or a script that imported ipykernel, has no kernel: judged by its stderr (a pipe here).
    _ipython(monkeypatch, types.SimpleNamespace())
    assert _progress._mode() == "log"


def test_a_kernel_without_a_working_ipython_rewrites_one_line(monkeypatch, capsys):
    _ipython(monkeypatch, None)  # `from IPython import get_ipython` fails
    assert _progress._mode() == "inline"
    with _progress.Elapsed("compiling something", period=0.05):
        __import__("time").sleep(0.2)
    err = capsys.readouterr().err
    assert err.startswith("\rdeform_conv: compiling something:") and "\n" not in err, repr(err)
