"""The command line: help texts a terminal can show as they are, and the self-check's judgement of the op."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import deform_conv
from deform_conv import __main__ as cli

from helpers.loader import child_env

SUBCOMMANDS = ["check", "doctor", "build", "bench", "clean"]


@pytest.mark.parametrize("command", [[]] + [[name] for name in SUBCOMMANDS], ids=["deform-conv"] + SUBCOMMANDS)
def test_help_is_plain_text(command):
    """argparse prints its texts verbatim: reST's ``literal`` markup would reach the terminal as it is written."""
    env = child_env(deform_conv.libraries[0].entry.parent)
    result = subprocess.run([sys.executable, "-m", "deform_conv", *command, "--help"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: deform-conv {' '.join(command)}".rstrip()), result.stdout
    assert "``" not in result.stdout and "`" not in result.stdout, result.stdout
    assert "compiling" not in result.stderr, "the help built the kernels"


def _perturbed_float32_einsum(monkeypatch, error: float) -> None:
    """torch.einsum off by ``error`` in float32, as one platform's was (3e-2): the reference uses it."""
    einsum = torch.einsum

    def off(*args, **kwargs):
        out = einsum(*args, **kwargs)
        return out + error if out.dtype == torch.float32 else out

    monkeypatch.setattr(torch, "einsum", off)


def test_self_check_judges_float32_against_a_float64_reference(monkeypatch, capsys):
    _perturbed_float32_einsum(monkeypatch, 3e-2)
    assert cli.check() == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "cpu  torch.float32  PASS vs reference in float64" in out and out.rstrip().endswith("OK"), out


def test_self_check_fails_a_float32_op_off_by_1e_4(monkeypatch, capsys):
    """The float32 tolerance is float32's: an output off by 1e-4 (a few hundred ulps of its values) fails."""
    op = deform_conv.deform_conv2d

    def off(*args, **kwargs):
        out = op(*args, **kwargs)
        return out + 1e-4 if out.dtype == torch.float32 else out

    monkeypatch.setattr(deform_conv, "deform_conv2d", off)
    assert cli.check() == 1
    out = capsys.readouterr().out
    assert "cpu  torch.float32  FAIL" in out and "output 1.0e-04 (too far)" in out, out
    assert "cpu  torch.float64  PASS" in out, out
