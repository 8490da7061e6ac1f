"""The loader: cache entry naming, cache hits, the first-build message, build failures, the wheel, the main job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import deform_conv
from deform_conv import _build

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update(extra)
    return env


def test_entry_name_changes_with_every_key_input():
    inputs = _build.key_inputs()
    name = _build.entry_name(inputs)
    changes = {
        "package_version": "9.9.9",
        "sources_sha256": "0" * 64,
        "cxx_flags": ["-O2"],
        "ld_flags": [],
        "torch_version": "2.99.0",
        "torch_cxx11_abi": not inputs["torch_cxx11_abi"],
        "torch_cuda": "99.9",
        "platform": "plan9-mips",
    }
    assert set(changes) == set(inputs), "every key input must be covered by this test"
    names = {name}
    for key, value in changes.items():
        names.add(_build.entry_name({**inputs, key: value}))
    assert len(names) == len(changes) + 1


def test_source_and_header_edits_change_the_key(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(_build.CSRC, csrc)
    monkeypatch.setattr(_build, "CSRC", csrc)
    before = _build.key_inputs()["sources_sha256"]
    with open(csrc / "sampling.h", "a") as f:
        f.write("// an edit\n")
    after_header = _build.key_inputs()["sources_sha256"]
    with open(csrc / "cpu" / "deform_conv_cpu.cpp", "a") as f:
        f.write("// an edit\n")
    after_source = _build.key_inputs()["sources_sha256"]
    assert len({before, after_header, after_source}) == 3


def test_cache_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("DEFORM_CONV_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _build.cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("DEFORM_CONV_CACHE_DIR")
    assert _build.cache_root() == tmp_path / "xdg" / "deform_conv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _build.cache_root() == tmp_path / "home" / ".cache" / "deform_conv"


def test_later_imports_load_from_the_cache_silently():
    entry = deform_conv.libraries[0].entry
    assert (entry / "key.json").is_file() and deform_conv.libraries[0].path.is_file()
    result = subprocess.run(
        [sys.executable, "-c", "import deform_conv; print(deform_conv.library.from_cache, deform_conv.libraries[0].entry)"],
        capture_output=True, text=True, env=_env(DEFORM_CONV_CACHE_DIR=str(entry.parent)), check=True,
    )
    assert result.stdout.split() == ["True", str(entry)]
    assert result.stderr == ""


def test_failed_build_raises_with_the_compiler_message(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "broken.cpp").write_text('#error "this source is deliberately broken"\n')
    monkeypatch.setattr(_build, "CSRC", csrc)
    monkeypatch.setattr(_build, "CPU_SOURCES", ("broken.cpp",))
    monkeypatch.setenv("DEFORM_CONV_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(_build.BuildError, match=r"(?s)failed:.*this source is deliberately broken.*Remedy: install"):
        _build.load()
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and not (entries[0] / "key.json").exists(), "a failed build must not look complete"


def test_main_job_builds_into_an_empty_cache_then_reuses_it(tmp_path):
    """`python -m deform_conv` on a fresh cache: one line saying what is built, where and that it happens once,
    the self-check passes; the second run loads from the cache."""
    env = _env(DEFORM_CONV_CACHE_DIR=str(tmp_path))
    first = subprocess.run([sys.executable, "-m", "deform_conv"], capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    build_lines = [line for line in first.stderr.splitlines() if line.startswith("deform_conv: compiling")]
    assert len(build_lines) == 1
    assert "CPU kernels" in build_lines[0] and str(tmp_path) in build_lines[0] and "once" in build_lines[0]
    assert "built now in" in first.stdout and first.stdout.rstrip().endswith("OK")
    assert "PASS vs reference" in first.stdout and "FAIL" not in first.stdout

    second = subprocess.run([sys.executable, "-m", "deform_conv"], capture_output=True, text=True, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "loaded from the cache" in second.stdout and "compiling" not in second.stderr


def test_wheel_is_pure_python_and_ships_the_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name.startswith("torch_deform_conv-") and wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = {str(p.relative_to(_build.CSRC.parent.parent)) for p in _build.CSRC.rglob("*") if p.is_file()}
    assert sources <= set(names), sources - set(names)
    assert not [n for n in names if n.endswith((".so", ".o", ".pyd"))], "pip wheel must not compile anything"
