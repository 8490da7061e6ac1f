"""Every environment variable the package reads is validated: a bad value is an error naming the variable, the
value and what it accepts, never silently ignored; the README lists them all."""

from __future__ import annotations

import subprocess
import sys

import pytest

import deform_conv
from deform_conv import BuildError
from deform_conv._jit import compile as _compile, settings as _settings, variant as _variant

from helpers.loader import ROOT, child_env

BAD_VALUES = [
    ("MAX_JOBS", "0", _settings.max_jobs),  # not "unlimited": it would let ninja start every job at once
    ("MAX_JOBS", "-2", _settings.max_jobs),
    ("MAX_JOBS", "four", _settings.max_jobs),
    ("MAX_JOBS", "\u00b2", _settings.max_jobs),  # a superscript two: str.isdigit() says yes, int() says no
    ("DEFORM_CONV_FALLBACK", "1", _settings.fallback_to_reference),
    ("DEFORM_CONV_FALLBACK", "yes", _settings.fallback_to_reference),
    ("DEFORM_CONV_VERBOSE", "true", _settings.verbose),
    ("DEFORM_CONV_CUDA", "off", _settings.cuda_wanted),
    ("DEFORM_CONV_AOT", "yes", _settings.ahead_of_time),
    ("DEFORM_CONV_SANITIZE", "adress", _settings.sanitizers),
    ("TORCH_CUDA_ARCH_LIST", "9.0;Hopper", _settings.cuda_archs),
    ("TORCH_CUDA_ARCH_LIST", "sm_90", _settings.cuda_archs),
    ("DEFORM_CONV_CPU_HALF_GEMM", "native", _settings.cpu_half_gemm),
]


@pytest.mark.parametrize("name, value, reader", BAD_VALUES, ids=[f"{n}={v}" for n, v, _ in BAD_VALUES])
def test_a_bad_value_names_the_variable_its_value_and_what_it_accepts(monkeypatch, name, value, reader):
    monkeypatch.setenv(name, value)
    with pytest.raises(BuildError) as raised:
        reader()
    accepts = _settings.VARIABLES[name][1]
    assert str(raised.value).startswith(f"{name} must be {accepts}; got {value!r}.")


@pytest.mark.parametrize("name, value, reader, expected", [
    ("MAX_JOBS", "3", _settings.max_jobs, 3),
    ("MAX_JOBS", "", _settings.max_jobs, None),
    ("DEFORM_CONV_FALLBACK", "reference", _settings.fallback_to_reference, True),
    ("DEFORM_CONV_FALLBACK", "0", _settings.fallback_to_reference, False),
    ("DEFORM_CONV_VERBOSE", "1", _settings.verbose, True),
    ("DEFORM_CONV_CUDA", "0", _settings.cuda_wanted, False),
    ("DEFORM_CONV_CUDA", "", _settings.cuda_wanted, True),
    ("TORCH_CUDA_ARCH_LIST", "9.0a 8.0+PTX,8.0", _settings.cuda_archs, ("8.0", "8.0+PTX", "9.0a")),
    ("DEFORM_CONV_CPU_HALF_GEMM", "", _settings.cpu_half_gemm, "auto"),
    ("DEFORM_CONV_CPU_HALF_GEMM", "portable", _settings.cpu_half_gemm, "portable"),
])
def test_good_values_are_read(monkeypatch, name, value, reader, expected):
    monkeypatch.setenv(name, value)
    assert reader() == expected


def test_the_build_honours_max_jobs_and_refuses_zero(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "3")
    assert _compile._build_environment(_variant.Variant("cpu"))["MAX_JOBS"] == "3"
    monkeypatch.setenv("MAX_JOBS", "0")
    with pytest.raises(BuildError, match=r"^MAX_JOBS must be a positive integer"):
        _compile._build_environment(_variant.Variant("cpu"))


def test_the_cli_arch_option_is_validated_under_its_own_name(monkeypatch):
    monkeypatch.setattr(_variant.torch.version, "cuda", "13.0")
    with pytest.raises(BuildError, match=r"^--cuda-arch must be archs by number such as"):
        _variant.requested_cuda_archs("ninety")


def test_import_refuses_a_bad_value_and_warns_about_an_unknown_variable(tmp_path):
    bad = subprocess.run([sys.executable, "-c", "import deform_conv"], capture_output=True, text=True,
                         env=child_env(tmp_path, DEFORM_CONV_FALLBACK="1"))
    assert bad.returncode != 0 and "DEFORM_CONV_FALLBACK must be `reference`" in bad.stderr
    code = "import warnings; warnings.simplefilter('error'); import deform_conv"
    typo = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env(tmp_path, DEFORM_CONV_CACHEDIR="/tmp/x", DEFORM_CONV_CUDA="0"))
    assert typo.returncode != 0
    assert "unknown environment variable(s) DEFORM_CONV_CACHEDIR ignored; known: DEFORM_CONV_CACHE_DIR" in typo.stderr


def test_a_warm_import_still_refuses_a_bad_value(tmp_path):
    """Nothing is built, so DEFORM_CONV_VERBOSE and MAX_JOBS are not used: their mistakes are reported all the
    same."""
    entry = deform_conv.libraries[0].entry
    for name, value in (("DEFORM_CONV_VERBOSE", "true"), ("MAX_JOBS", "0")):
        result = subprocess.run([sys.executable, "-c", "import deform_conv"], capture_output=True, text=True,
                                env=child_env(entry.parent, **{name: value}))
        assert result.returncode != 0 and f"{name} must be" in result.stderr, (name, result.stderr[-500:])


def test_the_readme_lists_every_variable_with_its_default():
    text = (ROOT / "README.md").read_text()
    table = text.split("| variable | default | accepts |\n", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = (cells[1], cells[2])
    assert rows == {name: (default, accepts) for name, (default, accepts) in _settings.VARIABLES.items()}
