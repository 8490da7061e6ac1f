"""Whatever lies in the cache root (stray or hand-edited JSON, symlinks, files at an entry's name, entries from
another compiler, relative paths), import, `doctor` and `clean` neither crash nor write through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import deform_conv
from deform_conv._jit import cache as _cache, toolchain as _toolchain

from helpers.loader import (IMPORT_AND_REPORT, child_env, compile_lines, copy_current_cpu_entry, fast_compiler,
                            read_only_command, run_python)

# Well-formed JSON of the wrong shape, and worse: each must count as absent.
BAD_JSON = ["[]", '"str"', "null", "1", '{"toolchain_fingerprints": []}', "{", "", '{"a": 1}', "[" * 100000]


@pytest.fixture
def fast_cxx(tmp_path_factory) -> str:
    return str(fast_compiler(tmp_path_factory.mktemp("tools")))


def valid_key() -> dict:
    key = _cache.inspect_entry(deform_conv.libraries[0].entry).key
    assert key is not None
    return key


@pytest.mark.parametrize("text", BAD_JSON + [
    json.dumps({**valid_key(), "extra": 1}),
    json.dumps({k: v for k, v in valid_key().items() if k != "build_seconds"}),
    json.dumps({**valid_key(), "library_sha256": 7}),
    json.dumps({**valid_key(), "toolchain": {"cxx": 12}}),
    json.dumps({**valid_key(), "build_seconds": True}),
])
def test_a_key_that_is_not_exactly_ours_counts_as_absent(text):
    assert _cache.parse_key(text.encode()) is None


def test_our_own_key_parses():
    assert _cache.parse_key(json.dumps(valid_key()).encode()) == valid_key()


@pytest.mark.parametrize("text", BAD_JSON + ['{"fp": 1}', '{"fp": ["v"]}'])
def test_a_compiler_memo_that_is_not_a_map_of_strings_is_empty(tmp_path, text):
    memo = tmp_path / "toolchains.json"
    memo.write_text(text)
    memo.chmod(0o600)
    assert _toolchain.read_memo(memo) == {}


def test_import_doctor_and_clean_survive_stray_json(tmp_path, fast_cxx):
    """A stray key.json of the wrong type where the entry belongs, and a toolchains.json of the wrong type: the
    import rebuilds the entry, doctor reports, clean removes both (the memo too, so the next import is clean)."""
    entry = tmp_path / deform_conv.libraries[0].entry.name
    entry.mkdir(mode=0o700)
    (entry / "key.json").write_text('{"toolchain_fingerprints": []}')
    (tmp_path / "toolchains.json").write_text('{"toolchain_fingerprints": []}')
    env = child_env(tmp_path, CXX=fast_cxx)
    imported = run_python(IMPORT_AND_REPORT, env)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.split()[:2] == ["False", str(entry)] and _cache.inspect_entry(entry).usable
    (entry / "key.json").unlink()
    (entry / "key.json").write_text("[]")
    for command in ("doctor", "clean"):
        result = subprocess.run([sys.executable, "-m", "deform_conv", command], capture_output=True, text=True,
                                env=env)
        assert "Traceback" not in result.stderr, result.stderr
    assert not os.path.lexists(entry) and not (tmp_path / "toolchains.json").exists()


@pytest.mark.parametrize("kind", ["dangling symlink", "plain file", "symlink to a real entry"])
def test_something_else_at_the_entrys_name_is_replaced_without_a_failed_compile(tmp_path, fast_cxx, kind):
    entry = tmp_path / "cache" / deform_conv.libraries[0].entry.name
    entry.parent.mkdir(mode=0o700)
    if kind == "dangling symlink":
        entry.symlink_to(tmp_path / "gone")
    elif kind == "plain file":
        entry.write_text("not an entry")
    else:  # an entry elsewhere, even a good one, is not loaded through a link: it is not the cache's
        entry.symlink_to(copy_current_cpu_entry(tmp_path / "elsewhere"))
    result = run_python(IMPORT_AND_REPORT, child_env(entry.parent, CXX=fast_cxx))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["False", str(entry)]
    assert entry.is_dir() and not entry.is_symlink() and _cache.inspect_entry(entry).usable
    assert len(compile_lines(result.stderr)) == 1


def test_symlinks_at_every_path_the_loader_writes_are_replaced_not_followed(tmp_path):
    """In the user's own cache: a failed build (its log), the compiler memo, the logs and lock directories, each
    name a symlink to a file or directory elsewhere. Nothing elsewhere changes."""
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    cache.mkdir(mode=0o700)
    outside.mkdir()
    precious = outside / "precious.txt"
    precious.write_text("keep me\n")
    broken = tmp_path / "broken-c++"
    broken.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "broken-c++ 1.0"; exit 0; }\necho no >&2; exit 1\n')
    broken.chmod(0o755)
    (cache / "logs").symlink_to(outside)
    (cache / ".locks").symlink_to(outside)
    (cache / _cache.TOOLCHAINS_FILE).symlink_to(precious)
    result = run_python("import deform_conv", child_env(cache, CXX=str(broken)))
    assert result.returncode != 0 and "compiling deform_conv's CPU kernels failed" in result.stderr
    assert precious.read_text() == "keep me\n"
    assert [p.name for p in outside.iterdir()] == ["precious.txt"]  # no log or lock written through the links
    log = next(line.split("Full log: ", 1)[1] for line in result.stderr.splitlines() if line.startswith("Full log: "))
    assert Path(log).parent == cache / "logs" and not (cache / "logs").is_symlink() and Path(log).is_file()
    assert not (cache / _cache.TOOLCHAINS_FILE).is_symlink()  # replaced by the memo itself
    for path in [cache, *cache.rglob("*")]:
        assert not path.lstat().st_mode & 0o022, f"{path} is writable by its group or others"


def test_a_planted_symlink_at_the_failed_builds_log_is_replaced(tmp_path):
    cache = tmp_path / "cache"
    (cache / "logs").mkdir(parents=True)
    cache.chmod(0o700)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me\n")
    broken = tmp_path / "broken-c++"
    broken.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "broken-c++ 1.0"; exit 0; }\necho no >&2; exit 1\n')
    broken.chmod(0o755)
    first = run_python("import deform_conv", child_env(cache, CXX=str(broken)))
    log = Path(next(line.split("Full log: ", 1)[1] for line in first.stderr.splitlines() if line.startswith("Full log: ")))
    log.unlink()
    log.symlink_to(precious)
    second = run_python("import deform_conv", child_env(cache, CXX=str(broken)))
    assert second.returncode != 0 and f"Full log: {log}" in second.stderr
    assert precious.read_text() == "keep me\n" and log.is_file() and not log.is_symlink()


def test_a_relative_cache_dir_is_made_absolute(tmp_path, fast_cxx):
    """The compile runs in the build directory: a relative root used to compile into a nested copy of itself."""
    result = run_python(IMPORT_AND_REPORT, child_env(Path("rel/cache"), CXX=fast_cxx), cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[1] == str(tmp_path / "rel" / "cache" / deform_conv.libraries[0].entry.name)
    assert not list((tmp_path / "rel" / "cache").glob("*/rel"))


def test_a_relative_xdg_cache_home_is_ignored_as_the_spec_says(tmp_path):
    env = child_env(tmp_path, HOME=str(tmp_path / "home"), XDG_CACHE_HOME="relative/xdg")
    del env["DEFORM_CONV_CACHE_DIR"]
    code = "from deform_conv._jit import settings; print(settings.cache_dir())"
    result = subprocess.run([sys.executable, "-c", code],
                            capture_output=True, text=True, env={**env, "DEFORM_CONV_FALLBACK": "reference",
                                                                 "CXX": "/nonexistent"})
    assert result.stdout.split()[-1] == str(tmp_path / "home" / ".cache" / "deform_conv"), result.stderr


def test_an_entry_for_another_environment_at_the_exact_name_is_rebuilt(tmp_path, fast_cxx):
    """The build's re-check after taking the lock judges as the warm path does (one function): an entry whose
    key.json was written for another torch is not loaded on either path."""
    entry = copy_current_cpu_entry(tmp_path)
    key = json.loads((entry / "key.json").read_text())
    key["environment"]["torch_version"] = "0.0.0"
    (entry / "key.json").write_text(json.dumps(key))
    (entry / "key.json").chmod(0o600)
    result = run_python(IMPORT_AND_REPORT, child_env(tmp_path, CXX=fast_cxx))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["False", str(entry)]
    assert _cache.inspect_entry(entry).key["environment"]["torch_version"] != "0.0.0"


def test_a_library_that_fails_to_load_shows_the_dynamic_loaders_message(tmp_path):
    entry = copy_current_cpu_entry(tmp_path)
    key = json.loads((entry / "key.json").read_text())
    library = entry / key["library"]
    library.write_bytes(b"not an ELF file\n")
    key["library_sha256"] = _cache.file_sha256(library)
    (entry / "key.json").write_text(json.dumps(key))
    result = run_python("import deform_conv", child_env(tmp_path))
    assert result.returncode != 0
    message = next(line for line in result.stderr.splitlines() if f"loading {library} failed" in line)
    assert "invalid ELF header" in message or "file too short" in message, message
    assert f"Remedy: delete {entry}" in result.stderr


def test_clean_in_a_read_only_cache_says_what_it_cannot_remove(tmp_path):
    cache = tmp_path / "cache"
    entry = copy_current_cpu_entry(cache)
    code = "import sys; from deform_conv.__main__ import main; sys.exit(main(['clean']))"
    result = subprocess.run(read_only_command(cache, code), capture_output=True, text=True, env=child_env(cache))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"could not remove {entry}: " in result.stderr and entry.is_dir()


def test_a_root_created_under_umask_002_is_private_with_its_parents(tmp_path, fast_cxx):
    """mkdir -p under a umask of 002 makes group-writable parents, which would make the root untrusted."""
    root = tmp_path / "new" / "nested" / "cache"
    code = "import os; os.umask(0o002)\n" + IMPORT_AND_REPORT
    result = run_python(code, child_env(root, CXX=fast_cxx))
    assert result.returncode == 0, result.stderr
    for directory in (root, root.parent, root.parent.parent):
        assert oct(directory.stat().st_mode & 0o777) == "0o700", directory
    # The linker followed the umask (0775); the published entry must pass the loader's own trust check.
    entry = Path(result.stdout.split()[1])
    for path in [entry, *entry.iterdir()]:
        assert not path.lstat().st_mode & 0o022, f"{path} is group-writable"


def test_a_read_only_cache_loads_its_entry_whatever_compiler_is_on_path(tmp_path):
    """The compiler matters only when building: a complete trusted entry in a cache that cannot be written loads
    even though the compiler on PATH is another version (which would build an entry of another name)."""
    cache = tmp_path / "cache"
    entry = copy_current_cpu_entry(cache)
    other = tmp_path / "other-c++"
    other.write_text('#!/bin/sh\necho "c++ (Other) 99.1.0"\n')
    other.chmod(0o755)
    result = subprocess.run(read_only_command(cache, IMPORT_AND_REPORT), capture_output=True, text=True,
                            env=child_env(cache, CXX=str(other)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["True", str(entry)]
