"""The kernel cache as two users of one machine see it: nothing another user could have written is loaded, and
nothing is written through a path another user could have planted (README: the trust model)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

import deform_conv
from deform_conv._jit import cache as _cache

from helpers.loader import IMPORT_AND_REPORT, child_env, fast_compiler

PLANTED_SOURCE = r"""
#include <stdio.h>
/* Runs the moment the library is loaded: proof that it was. */
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen(MARKER, "w");
  if (f) { fputs("the planted library ran\n", f); fclose(f); }
}
"""

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates two throwaway users: needs root (CI runs as root)")


class User:
    """A throwaway account, removed when the test ends."""

    def __init__(self, role: str) -> None:
        self.name = f"dc{role[:3]}{uuid.uuid4().hex[:8]}"
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", self.name], check=True,
                       capture_output=True)
        entry = pwd.getpwnam(self.name)
        self.uid, self.gid = entry.pw_uid, entry.pw_gid

    def chown(self, *paths: Path) -> None:
        for path in paths:
            for p in [path, *(path.rglob("*") if path.is_dir() and not path.is_symlink() else [])]:
                os.lchown(p, self.uid, self.gid)

    def run(self, code: str, env: dict) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                              user=self.uid, group=self.gid, extra_groups=[], cwd="/")

    def remove(self) -> None:
        subprocess.run(["userdel", self.name], capture_output=True)


def _closed_ancestors() -> list:
    """Directories above this Python, its packages and this checkout that other users cannot enter (e.g. /root,
    where pyenv keeps the interpreter)."""
    import torch

    paths = {Path(os.path.realpath(sys.executable)), Path(torch.__file__).resolve(), Path(__file__).resolve()}
    closed = set()
    for path in paths:
        for parent in path.parents:
            if not os.stat(parent).st_mode & 0o001:
                closed.add(parent)
    return sorted(closed)


@pytest.fixture
def machine():
    """A directory every user can reach (mode 0755 under a sticky /tmp), a victim and an attacker. Where this
    Python lives below a directory others cannot enter, the two accounts (only they) get an ACL to enter it
    for the test's duration."""
    if shutil.which("useradd") is None:
        pytest.skip("no useradd on this machine")
    closed = _closed_ancestors()
    if closed and shutil.which("setfacl") is None:
        pytest.skip(f"other users cannot reach this Python ({closed[0]} is closed) and setfacl (Debian: acl) is "
                    "not installed to let the test's accounts in")
    base = Path(tempfile.mkdtemp(prefix="dc-trust-"))
    base.chmod(0o755)
    users = [User("victim"), User("attacker")]
    try:
        for directory in closed:
            for user in users:
                subprocess.run(["setfacl", "-m", f"u:{user.uid}:x", str(directory)], check=True)
        probe = users[0].run("import torch, importlib.util; assert importlib.util.find_spec('deform_conv')",
                            dict(os.environ))
        if probe.returncode != 0:
            pytest.skip(f"another user cannot import torch and this package from here: {probe.stderr[-300:]}")
        yield base, users[0], users[1]
    finally:
        for directory in closed:
            for user in users:
                subprocess.run(["setfacl", "-x", f"u:{user.uid}", str(directory)], capture_output=True)
        for user in users:
            user.remove()
        shutil.rmtree(base, ignore_errors=True)


def marker_path(base: Path) -> Path:
    """Where the planted library's constructor writes: a directory anyone may write to, so that any user loading
    it leaves the marker."""
    markers = base / "markers"
    markers.mkdir()
    markers.chmod(0o1777)
    return markers / "planted-library-ran"


def plant_library(directory: Path, marker: Path) -> Path:
    """A library whose constructor writes ``marker``, built into ``directory``."""
    source = directory / "planted.c"
    source.write_text(PLANTED_SOURCE)
    library = directory / "planted.so"
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(source), "-o", str(library)], check=True)
    return library


def plant_entry(root: Path, name: str, library: Path, library_field: str = "") -> Path:
    """An entry at ``name`` whose key.json matches this environment and the planted library's SHA-256."""
    entry = root / name
    entry.mkdir(parents=True)
    if not library_field:
        shutil.copy(library, entry / library.name)
        library_field = library.name
    key = _cache.inspect_entry(deform_conv.libraries[0].entry).key
    planted_key = {**key, "library": library_field, "library_sha256": _cache.file_sha256(library)}
    (entry / _cache.KEY_FILE).write_text(json.dumps(planted_key))
    for path in [entry, *entry.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # modes that pass: only the owner gives it away
    return entry


def victims_copy_of_the_real_entry(root: Path, victim: User) -> Path:
    entry = root / deform_conv.libraries[0].entry.name
    shutil.copytree(deform_conv.libraries[0].entry, entry)
    victim.chown(entry)
    return entry


def environment(home: Path, cache: Path, *, compiler: str = "", **extra: str) -> dict:
    env = child_env(cache, HOME=str(home), **extra)
    if not compiler:
        env.update(CXX="/nonexistent/c++", PATH=os.path.dirname(sys.executable) + ":/usr/bin:/bin")
    else:
        env["CXX"] = compiler
    return env


def home_of(base: Path, user: User) -> Path:
    home = base / f"home-{user.name}"
    home.mkdir(mode=0o700)
    user.chown(home)
    return home


@needs_root
def test_an_entry_planted_in_a_shared_root_is_never_loaded(machine):
    """The README once suggested a shared directory for DEFORM_CONV_CACHE_DIR: there, another user can plant an
    entry with a key whose SHA-256 matches. With a compiler present, the victim refuses the whole root."""
    base, victim, attacker = machine
    shared = base / "shared-cache"
    shared.mkdir()
    shared.chmod(0o1777)  # world-writable with the sticky bit, as a scratch directory would be
    marker = marker_path(base)
    plant_entry(shared, deform_conv.libraries[0].entry.name, plant_library(base, marker))
    attacker.chown(shared / deform_conv.libraries[0].entry.name)
    tools = base / "tools"
    result = victim.run(IMPORT_AND_REPORT, environment(home_of(base, victim), shared,
                                                      compiler=str(fast_compiler(tools))))
    assert not marker.exists(), "the victim ran the planted library"
    assert result.returncode != 0
    assert f"the kernel cache {shared} may not be trusted: the cache root {shared} is writable by its group and others " \
           "(mode 1777)" in result.stderr
    assert "Remedy: set DEFORM_CONV_CACHE_DIR to a directory of your own" in result.stderr


@needs_root
def test_a_root_planted_under_xdg_cache_home_is_refused_without_a_compiler(machine):
    """XDG_CACHE_HOME=/tmp/...: the attacker creates <it>/deform_conv first, owned by them, with a planted
    entry. A deployment box (no compiler on PATH) loads nothing from it."""
    base, victim, attacker = machine
    xdg = base / "xdg"
    xdg.mkdir(mode=0o1777)
    xdg.chmod(0o1777)
    root = xdg / "deform_conv"
    marker = marker_path(base)
    plant_entry(root, deform_conv.libraries[0].entry.name, plant_library(base, marker))
    attacker.chown(root)
    env = environment(home_of(base, victim), root, XDG_CACHE_HOME=str(xdg))
    del env["DEFORM_CONV_CACHE_DIR"]
    result = victim.run(IMPORT_AND_REPORT, env)
    assert not marker.exists(), "the victim ran the planted library"
    assert result.returncode != 0
    assert f"the cache root {root} is owned by {attacker.name} (uid {attacker.uid}), not by you or root" in result.stderr


@needs_root
def test_without_a_compiler_the_victims_own_entry_wins_over_a_planted_one(machine):
    """A cache a team shares read-only (root's), holding the victim's entry and one planted by another user under
    a name that sorts after it (which the loader used to prefer): the victim loads hers, says why she skips the
    other, and the planted library never runs."""
    base, victim, attacker = machine
    root = base / "team-cache"
    root.mkdir(mode=0o755)
    own = victims_copy_of_the_real_entry(root, victim)
    marker = marker_path(base)
    planted = plant_entry(root, own.name[:-8] + "ffffffff", plant_library(base, marker))
    attacker.chown(planted)
    result = victim.run(IMPORT_AND_REPORT, environment(home_of(base, victim), root))
    assert not marker.exists(), "the victim ran the planted library"
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["True", str(own)]
    warnings = [line for line in result.stderr.splitlines() if "not loading" in line]
    assert len(warnings) == 1 and f"not loading {planted}: the entry {planted} is owned by {attacker.name}" in warnings[0]


@needs_root
def test_a_key_naming_a_library_outside_its_entry_is_not_followed(machine):
    """The victim's own entry, but its key.json names the attacker's library by absolute path (with the right
    SHA-256): skipped with a warning and rebuilt; without a compiler, refused with the path named."""
    base, victim, attacker = machine
    root = base / "victims-cache"
    root.mkdir(mode=0o700)
    attackers = base / "attackers"
    attackers.mkdir()
    marker = marker_path(base)
    library = plant_library(attackers, marker)
    attacker.chown(attackers)
    entry = plant_entry(root, deform_conv.libraries[0].entry.name, library, library_field=str(library))
    victim.chown(root)
    home = home_of(base, victim)

    refused = victim.run(IMPORT_AND_REPORT, environment(home, root))
    assert not marker.exists(), "the victim ran the planted library"
    assert refused.returncode != 0
    assert f"names the library {str(library)!r}, which is not a file inside its entry" in refused.stderr
    assert "Skipped as untrusted" in refused.stderr and "no C++ compiler found" in refused.stderr

    rebuilt = victim.run(IMPORT_AND_REPORT, environment(home, root, compiler=str(fast_compiler(base / "tools"))))
    assert not marker.exists(), "the victim ran the planted library"
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert rebuilt.stdout.split()[:2] == ["False", str(entry)]
    rebuilt_key = json.loads((entry / _cache.KEY_FILE).read_text())  # the victim's now (this process is root)
    assert _cache.is_plain_file_name(rebuilt_key["library"]) and (entry / rebuilt_key["library"]).is_file()


@needs_root
def test_symlinks_planted_at_every_path_the_loader_writes_leave_their_targets_alone(machine):
    """In a shared root the attacker points each name the loader writes (the failed build's log, its directory,
    the compiler memo, the entry itself) at a file of the victim's. Her import refuses the root and writes
    nothing; her precious file is unchanged."""
    base, victim, attacker = machine
    home = home_of(base, victim)
    precious = home / "thesis.tex"
    precious.write_text("years of work\n")
    victim.chown(precious)
    shared = base / "shared-cache"
    shared.mkdir()
    shared.chmod(0o1777)
    name = deform_conv.libraries[0].entry.name
    (shared / "logs").mkdir()
    links = [shared / "logs" / f"{name}.log", shared / _cache.TOOLCHAINS_FILE, shared / name]
    for link in links:
        link.symlink_to(precious)
    attacker.chown(shared / "logs", *links)
    broken = base / "broken-c++"
    broken.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "broken-c++ 1.0"; exit 0; }\necho no >&2; exit 1\n')
    broken.chmod(0o755)
    result = victim.run(IMPORT_AND_REPORT, environment(home, shared, compiler=str(broken)))
    assert result.returncode != 0 and "may not be trusted" in result.stderr
    assert precious.read_text() == "years of work\n"
    assert all(link.is_symlink() for link in links)


@needs_root
def test_a_root_reached_through_another_users_symlink_is_refused(machine):
    """The attacker plants a predictable name in a sticky scratch directory as a symlink to the victim's own cache:
    its target passes every check, but the attacker can point it elsewhere between the check and the load."""
    base, victim, attacker = machine
    scratch = base / "scratch"
    scratch.mkdir()
    scratch.chmod(0o1777)
    own = base / "victims-cache"
    own.mkdir(mode=0o700)
    victims_copy_of_the_real_entry(own, victim)
    victim.chown(own)
    planted = scratch / "dcn-cache"
    planted.symlink_to(own)
    attacker.chown(planted)
    result = victim.run(IMPORT_AND_REPORT, environment(home_of(base, victim), planted))
    assert result.returncode != 0
    assert f"the symlink {planted} is owned by {attacker.name} (uid {attacker.uid}), not by you or root" in result.stderr
