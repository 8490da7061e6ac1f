"""Where cache entries live, whether they may be trusted, and every write the loader makes there.

Layout under the cache root (see :func:`deform_conv._jit.settings.cache_dir`)::

    <tag>-torch<version>-<environment hash>-<toolchain hash>/   one complete entry: key.json, the library, build.log
    .build-<entry>-XXXX/                                         a build in progress (private; renamed when done)
    .trash-<entry>-XXXX/                                         something moved out of the way, being deleted
    .locks/<entry>.lock                                          OS-level lock (released by the kernel if its holder dies)
    logs/<entry>.log                                             the log of a failed build
    toolchains.json                                              compiler versions, so warm imports never run them

Trust, as ssh's for its keys: a library runs with the user's rights, so it is loaded only if the root, its
entry directory, ``key.json`` and the library itself are owned by this user (or root) and writable by nobody
else, none of them a symlink (the root may be one: its target is checked), the library named by a plain file
name inside its entry, and nothing on the way to the root lets another user swap it (each directory above it,
as given and as resolved, is owned by this user or root and writable by others only with the sticky bit, as
/tmp; each symlink on the way is this user's or root's). A checksum beside the file it
checks proves integrity, not origin: the owner and the modes do. Everything the package creates is writable by
its owner only (directories 0700, files 0600); see the README for a cache a team shares read-only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import time
from pathlib import Path
from typing import BinaryIO, Dict, Iterable, Iterator, List, Optional, Tuple

from .variant import ENTRY_NAME

KEY_FILE = "key.json"
TOOLCHAINS_FILE = "toolchains.json"
STALE_BUILD_SECONDS = 12 * 3600  # a private build directory untouched this long belongs to a dead build

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# key.json's fields and their types, exactly: anything else is not a key this package wrote.
_CACHE_KEY_FIELDS = {"environment": dict, "toolchain": dict, "toolchain_fingerprints": dict, "library": str,
                     "library_sha256": str, "build_seconds": (int, float), "unit_seconds": dict,
                     "reused_units": list, "unit_sha256": dict}
_BUNDLED_KEY_FIELDS = {"environment": dict, "toolchain": dict, "library": str, "library_sha256": str}


def _owner_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _owned_by_us_or_root(st: os.stat_result) -> bool:
    return st.st_uid in (os.geteuid(), 0)


def _writers(mode: int) -> str:
    return " and ".join(w for bit, w in ((0o020, "its group"), (0o002, "others")) if mode & bit)


def ownership_problem(st: os.stat_result, what: str) -> Optional[str]:
    """Why a file or directory with this stat may not be trusted, or None."""
    if not _owned_by_us_or_root(st):
        return f"{what} is owned by {_owner_name(st.st_uid)}, not by you or root"
    if st.st_mode & 0o022:
        return f"{what} is writable by {_writers(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _path_problem(path: Path) -> Optional[str]:
    """Why another user could make ``path`` (absolute) lead elsewhere, or None: every component above it must be
    ours or root's and writable by others only with the sticky bit, and every symlink on the way ours or root's
    (in a sticky /tmp, the owner of a symlink can still point it elsewhere)."""
    for component in [path, *path.parents]:
        st = os.lstat(component)
        if stat.S_ISLNK(st.st_mode):
            if not _owned_by_us_or_root(st):
                return f"the symlink {component} is owned by {_owner_name(st.st_uid)}, not by you or root"
            continue
        if component == path:
            continue  # the root itself is judged by ownership_problem
        if not _owned_by_us_or_root(st):
            return f"its parent {component} is owned by {_owner_name(st.st_uid)}, not by you or root"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"its parent {component} is writable by {_writers(st.st_mode)} (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}) without the sticky bit, so they could rename the cache away "
                    "and put their own in its place")
    return None


def root_problem(root: Path) -> Optional[str]:
    """Why the cache root (which exists) may not be trusted, or None. A symlinked root is judged by its target, and
    both the path as given and the path it resolves to must be safe from other users (:func:`_path_problem`)."""
    try:
        real = Path(os.path.realpath(root))
        st = os.stat(real)
        if not stat.S_ISDIR(st.st_mode):
            return f"the cache root {root} is not a directory"
        return (ownership_problem(st, f"the cache root {real}") or _path_problem(root)
                or (_path_problem(real) if real != root else None))
    except OSError as exc:
        return f"the cache root {root} cannot be inspected ({exc.strerror})"


def make_root(root: Path) -> None:
    """Creates the root, and any missing directory above it, 0700 (with mkdir -p's modes, a umask of 002 would make
    a parent group-writable, and the root untrusted); raises OSError if it cannot."""
    missing = []
    path = root
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass  # another process made it at the same moment: root_problem judges it


def can_write(root: Path) -> bool:
    """Whether a build could write into ``root`` (existing or creatable): a read-only mount or mode says no."""
    target = root
    while not os.path.lexists(target):
        target = target.parent
    return os.access(target, os.W_OK | os.X_OK)


# -------------------------------------------------------------------------------------------- reading entries

@dataclasses.dataclass(frozen=True)
class EntryState:
    """What lies at an entry's path: a usable entry (``key`` set), something absent, incomplete or untrusted."""

    path: Path
    key: Optional[dict] = None
    problem: Optional[str] = None   # why it cannot be used (None with key None: nothing there)
    untrusted: bool = False          # the problem is one of trust, worth a warning, not just an unfinished build

    @property
    def usable(self) -> bool:
        return self.key is not None


def _open_trusted(path: Path, what: str, judge=None) -> Tuple[Optional[BinaryIO], Optional[str], bool]:
    """(the open file, None, False) if ``path`` is a regular file that ``judge`` (ownership_problem by default)
    trusts, else (None, why not, whether that is a matter of trust rather than of a missing or unreadable file).
    Opened without following a symlink, and judged by the open file's own stat: nothing can be swapped between
    the check and the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, f"{what} {path} is a symlink", True
        return None, f"{what} {path} cannot be read ({exc.strerror})", False
    f = os.fdopen(fd, "rb")
    st = os.fstat(f.fileno())
    problem = (f"{what} {path} is not a regular file" if not stat.S_ISREG(st.st_mode)
               else (judge or ownership_problem)(st, f"{what} {path}"))
    if problem:
        f.close()
        return None, problem, True
    return f, None, False


def _read_trusted_file(path: Path, what: str, judge=None) -> Tuple[Optional[bytes], Optional[str]]:
    """(contents, None), or (None, why it may not be read as trusted): see :func:`_open_trusted`."""
    f, problem, _untrusted = _open_trusted(path, what, judge)
    if f is None:
        return None, problem
    with f:
        return f.read(), None


def _bundled_problem(st: os.stat_result, what: str) -> Optional[str]:
    """The library installed with the package (DEFORM_CONV_AOT=1) is as trustworthy as the package's own Python
    files beside it, which run anyway: it must be owned by their owner (or you, or root) and writable by no one
    who cannot also write them (pip applies the umask, so under 002 both are group-writable)."""
    package = os.stat(Path(__file__).resolve().parents[1] / "__init__.py")  # deform_conv/__init__.py
    if st.st_uid not in (os.geteuid(), 0, package.st_uid):
        return f"{what} is owned by {_owner_name(st.st_uid)}, not by the package's owner, you or root"
    extra = st.st_mode & 0o022 & ~package.st_mode
    if extra:
        return f"{what} is writable by {_writers(extra)}, unlike the package's own files"
    return None


def parse_key(data: bytes, bundled: bool = False) -> Optional[dict]:
    """The key if ``data`` is exactly a key this package writes (fields and their types), else None: a stray or
    hand-edited key.json counts as absent. Whether its library name is a plain file name is checked apart
    (:func:`is_plain_file_name`): a key that points elsewhere is not merely broken but suspect."""
    try:
        key = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: '[' * 100000 is valid JSON
        return None
    fields = _BUNDLED_KEY_FIELDS if bundled else _CACHE_KEY_FIELDS
    if not isinstance(key, dict) or set(key) != set(fields):
        return None
    if not all(isinstance(key[name], kind) and not isinstance(key[name], bool) for name, kind in fields.items()):
        return None
    tool_maps = [key["toolchain"]] + ([] if bundled else [key["toolchain_fingerprints"]])
    if not all(isinstance(k, str) and isinstance(v, str) for m in tool_maps for k, v in m.items()):
        return None
    return key if _SHA256.match(key["library_sha256"]) else None


def is_plain_file_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _sha256_of(f) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return _sha256_of(f)


def inspect_entry(directory: Path, environment: Optional[Dict[str, object]] = None, key_file: str = KEY_FILE,
                  bundled: bool = False, hash_library: bool = True) -> EntryState:
    """Whether the entry at ``directory`` may be loaded: the one judgement that the warm path, the build's
    re-check after taking the lock, ``doctor`` and ``clean --stale`` all use. ``environment``, when given, must
    equal the key's. ``bundled``: the library installed with the package (see :func:`_bundled_problem`).
    ``hash_library=False`` trusts the key without reading the library (to learn what built an entry, not to
    load it)."""
    judge = _bundled_problem if bundled else ownership_problem
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return EntryState(directory)
    except OSError as exc:
        return EntryState(directory, problem=f"{directory} cannot be inspected ({exc.strerror})", untrusted=True)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(directory)
        dangling = "" if os.path.exists(directory) else " (dangling)"
        return EntryState(directory, problem=f"{directory} is a symlink{dangling} to {target}", untrusted=True)
    if not stat.S_ISDIR(st.st_mode):
        return EntryState(directory, problem=f"{directory} is not a directory", untrusted=True)
    problem = judge(st, f"the entry {directory}")
    if problem:
        return EntryState(directory, problem=problem, untrusted=True)
    if not os.path.lexists(directory / key_file):
        return EntryState(directory, problem=f"{directory} is incomplete (no {key_file}: a build in progress or "
                                             "killed)")
    data, problem = _read_trusted_file(directory / key_file, "the key", judge)
    if data is None:
        return EntryState(directory, problem=problem, untrusted=True)
    key = parse_key(data, bundled)
    if key is None:
        return EntryState(directory, problem=f"{directory / key_file} is not a key this package wrote")
    if not is_plain_file_name(key["library"]):
        return EntryState(directory, problem=f"{directory / key_file} names the library {key['library']!r}, which is "
                                             "not a file inside its entry", untrusted=True)
    if environment is not None and key["environment"] != environment:
        return EntryState(directory, problem=f"{directory} was built for another torch, source or flags")
    library = directory / key["library"]
    if not hash_library:
        return EntryState(directory, key=key)
    f, problem, untrusted = _open_trusted(library, "the library", judge)
    if f is None:
        return EntryState(directory, problem=problem, untrusted=untrusted)
    with f:
        if _sha256_of(f) != key["library_sha256"]:
            return EntryState(directory, problem=f"the library {library} is truncated or overwritten (its SHA-256 "
                                                 "differs from the key's)")
    return EntryState(directory, key=key)


def entries(root: Path) -> List[Path]:
    """Every path in ``root`` named like an entry (directories, and whatever else lies at such a name)."""
    try:
        return sorted(p for p in root.iterdir() if _is_entry_name(p.name))
    except OSError:
        return []


def _is_entry_name(name: str) -> bool:
    return bool(ENTRY_NAME.match(name))


def read_trusted_json(path: Path) -> object:
    """The JSON in ``path`` if it is a trusted regular file, else None (missing, untrusted or not JSON)."""
    data, _problem = _read_trusted_file(path, "the file")
    if data is None:
        return None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


# ------------------------------------------------------------------------------------------------- writing

def write_new_file(path: Path, data: bytes) -> None:
    """Creates ``path`` (0600) and writes ``data``: fails rather than write through anything already there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def replace_file(path: Path, data: bytes) -> None:
    """Writes ``data`` to a new temporary file beside ``path`` (mkstemp: O_EXCL, 0600) and renames it over
    ``path``: a symlink planted at ``path`` is replaced, never written through."""
    import tempfile  # here: the warm import never writes

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def own_directory(root: Path, name: str) -> Path:
    """``root/name`` as a real directory of ours, writable by us only: anything else at that name (a symlink, a
    file, someone else's directory) is moved out of the way first."""
    path = root / name
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            return path
        discard(path, root)
    except FileNotFoundError:
        pass
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:  # another process made it meanwhile
        return own_directory(root, name)
    return path


def discard(path: Path, root: Path) -> None:
    """Removes ``path`` (an entry, a symlink, a leftover): first renamed into a private directory, so that the
    name is free at once and nothing half-deleted is ever seen under it; rmtree follows no symlink."""
    import tempfile

    trash = Path(tempfile.mkdtemp(prefix=f".trash-{path.name}-", dir=root))
    try:
        os.rename(path, trash / "old")
    except FileNotFoundError:
        pass
    shutil.rmtree(trash, ignore_errors=True)


# ninja's records of how and when each output of a build was made (kept in the entry).
NINJA_RECORDS = (".ninja_log", ".ninja_deps")
# The libraries' generated translation units (_sources.write_units), named by their content.
UNITS_DIR = ".units"


def seed_build(entry: Path, private: Path, unit_files: Iterable[str]) -> List[str]:
    """Copies into ``private`` (a fresh build directory of ours) the objects of the units ``unit_files`` (their
    file names) from ``entry`` -- a trusted entry of the same variant, flags, torch and toolchain whose key shows
    these units unchanged (_variant.unit_sha256) -- with ninja's records, keeping their mtimes: ninja then compiles
    only the other units (and any whose sources look newer than their object). Each file is read as the library is
    (a regular file of ours or root's that no one else may write, never through a symlink) and written anew, never
    through anything already there. Returns the file names of the units whose object was copied."""
    wanted = set(NINJA_RECORDS)
    for unit_file in unit_files:
        stem = unit_file.rsplit(".", 1)[0]
        wanted |= {f"{stem}.o", f"{stem}.cuda.o"}
    copied = []
    for path in sorted(entry.iterdir()):
        if path.name not in wanted:
            continue
        f, _problem, _untrusted = _open_trusted(path, "a file of the earlier build")
        if f is None:
            continue  # not ours to reuse: that unit is compiled afresh
        with f:
            st = os.fstat(f.fileno())
            write_new_file(private / path.name, f.read())
        os.utime(private / path.name, ns=(st.st_atime_ns, st.st_mtime_ns))
        if path.suffix == ".o":
            copied.append(path.name.split(".")[0])
    return [f for f in unit_files if f.rsplit(".", 1)[0] in copied]


def harden(directory: Path) -> None:
    """Drops group and other access from everything a build wrote (the linker follows the umask), so that the
    published entry passes :func:`ownership_problem`."""
    for path in [directory, *directory.rglob("*")]:
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode):
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)


def stale_builds(root: Path, entry_name: str) -> Iterator[Path]:
    """Private build directories for ``entry_name`` that nothing has touched for STALE_BUILD_SECONDS: left by a
    killed build. Judged by age, not by the lock, as on some file systems the lock does not exclude."""
    now = time.time()
    for path in root.glob(f".build-{entry_name}-*"):
        try:
            newest = max(os.lstat(p).st_mtime for p in [path, *path.rglob("*")])
        except OSError:
            continue
        if now - newest > STALE_BUILD_SECONDS:
            yield path
