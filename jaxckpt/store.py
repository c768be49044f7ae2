"""The on-disk lifecycle of checkpoints under one root.

Owns: directory naming (``recover/step_{global_step:08d}``, ``export/epoch{E}epochstep{S}
globalstep{G}``), the commit protocol (a ``COMMITTED`` manifest of every file's size and
checksum, written last, atomically and durably), listing and verifying checkpoints, "latest valid",
retention deletion that tolerates races, start-up cleanup of partial directories, and the
root lock that keeps a second job out.

A checkpoint directory is valid iff its ``COMMITTED`` manifest exists, parses, names only
paths inside the directory, and every listed file has the listed size (and checksum, when
asked). Anything else is partial or corrupt and is never restored.

Verification can be split in two for a restore (``verify(defer_over=...)`` then
``verify_deferred``): everything but the checksums of large bulk-data files up front, those
checksums while the backend reads the same bytes. See ``DEFER_CHECKSUMS_OVER``.

Concurrency contract: ``commit``, ``delete``, ``cleanup_partial`` and ``quarantine`` are
called only by the primary process. ``delete`` takes an exclusive, non-blocking ``flock`` on
the victim's marker and ``reading`` holds a shared one, so a checkpoint being restored (in
this or another process on the same host) is never deleted; deletion first removes the
marker (making the directory "partial" atomically), then the files, and treats files that
are already gone as success.

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from .checksum import ALGORITHMS, default_algorithm, file_checksum
from .errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointRootError,
    CheckpointWriteError,
    RootLockedError,
)

__all__ = [
    "COMMIT_MARKER",
    "DRIVER_FILE",
    "DEFER_CHECKSUMS_OVER",
    "CheckpointStore",
    "Manifest",
    "Entry",
    "RootLock",
    "ReadClaims",
    "fsync_dir",
    "fsync_file",
    "atomic_write",
    "export_dirname",
    "foreign_entries",
    "check_root",
    "classify_path",
    "PathKind",
]

COMMIT_MARKER = "COMMITTED"
DRIVER_FILE = "driver.json"
# Format 2 records crc32c checksums (jaxckpt/checksum.py); format 1, crc32. Both are read.
MANIFEST_FORMAT = "jaxckpt.commit/2"
_READABLE_MANIFEST_FORMATS = ("jaxckpt.commit/1", MANIFEST_FORMAT)
RECOVER = "recover"
EXPORT = "export"
SUPERSEDED = "superseded"
ITEMS = "items"
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_VERSION_RE = re.compile(r"^v(\d{6,})$")
_ITEM_DIR_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_EXPORT_RE = re.compile(r"^epoch(\d+)epochstep(\d+)globalstep(\d+)$")
_TMP_PREFIX = ".tmp-"
LOCK_FILE = ".lock"
# What jaxckpt itself writes directly under a root. Any other entry there (or under recover/
# and export/, see foreign_entries) means another tool owns the directory: jaxckpt then
# refuses the root rather than write beside, or clean up, files it does not understand. A
# new file or directory the store writes into a root must be added here.
_ROOT_NAMES = frozenset({RECOVER, EXPORT, LOCK_FILE})
# Entries the filesystem or the OS put into any directory (a mount point's lost+found).
_SYSTEM_NAMES = frozenset({"lost+found", ".DS_Store"})
# Names by which another tool's checkpoint is recognised, for a hint in the error: Orbax's
# step directories are plain numbers (or prefix_number) holding _CHECKPOINT_METADATA.
_ORBAX_HINTS = frozenset({"_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt",
                          "commit_success.txt"})

#: Files larger than this many bytes may have their checksum checked while a backend reads the
#: checkpoint instead of before (``verify(defer_over=...)``, ``verify_deferred``).
#: Why only those: readers act on metadata (shapes to allocate, names to open, offsets to
#: cut at), so a metadata file that is damaged yet still parses must never be interpreted.
#: Every file up to this size, and every file named like metadata whatever its size
#: (``_is_metadata``), is therefore checksummed before anything is read. What is left is
#: bulk array bytes: damaged, they can only decode to wrong numbers, which the manager
#: drops when their checksum fails. Why 1 MiB: the metadata written here (driver.json,
#: tree.json, zarr.json, Orbax's _METADATA, DCP's .metadata, objects.json) stays far below
#: it for ordinary models, and it equals OrbaxBackend's default ``pack_leaf_bytes``, so
#: every array file of a default Orbax checkpoint but the smallest packs is above it and the
#: up-front pass is a handful of small reads.
DEFER_CHECKSUMS_OVER = 1024 * 1024
# Names of files that are metadata whatever their size (the tree.json of a state with
# about ten thousand leaves passes 1 MiB): never deferred.
_METADATA_SUFFIXES = (".json", ".txt", ".pbtxt", ".ocdbt")
_METADATA_NAMES = frozenset({COMMIT_MARKER, "_METADATA", "_CHECKPOINT_METADATA", "_sharding"})

Status = Literal["committed", "partial", "corrupt"]
#: What a path given to a command is (see ``classify_path``).
PathKind = Literal["missing", "unreadable", "file", "empty", "foreign", "root", "checkpoint"]


def export_dirname(epoch: int, epoch_step: int, global_step: int) -> str:
    return f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"


def fsync_file(path: str) -> None:
    """Make a file's data (written by someone else, or already closed) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, and
    the new one survives a power loss once this returns: temp file, fsync, rename, dir fsync."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f"{_TMP_PREFIX}{os.path.basename(path)}.{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(directory)


def _is_metadata(rel: str) -> bool:
    """Whether a manifest path names a file that some reader parses (rather than bulk data)."""
    name = rel.rsplit("/", 1)[-1]
    return (name.startswith(".") or name in _METADATA_NAMES
            or name.endswith(_METADATA_SUFFIXES))


def _deferrable(rel: str, info: dict[str, Any], over: int) -> bool:
    """Whether ``rel``'s checksum may wait until its bytes are being read (see
    ``DEFER_CHECKSUMS_OVER``)."""
    return info["size"] > over and not _is_metadata(rel)


def _check_file(path: str, inside: str, rel: str, info: dict[str, Any], *,
                checksums: bool) -> str | None:
    """What is wrong with one manifest entry on disk (None: nothing): a path that leaves the
    checkpoint, a missing or unreadable file, a size or (when asked) checksum mismatch."""
    full = os.path.join(path, *rel.split("/"))
    if os.path.islink(full) or not os.path.realpath(full).startswith(inside + os.sep):
        return (f"{rel}: resolves outside the checkpoint (a symlink); refusing to read "
                f"data that does not belong to it")
    try:
        size = os.path.getsize(full)
    except FileNotFoundError:
        return f"{rel}: missing"
    except OSError as exc:
        return f"{rel}: unreadable ({exc})"
    if size != info["size"]:
        return f"{rel}: size {size} bytes, manifest says {info['size']} (truncated or overwritten)"
    if checksums:
        algorithm = _algorithm_of(info)
        try:
            _, crc = file_checksum(full, algorithm)
        except OSError as exc:
            return f"{rel}: unreadable ({exc})"
        if crc != info[algorithm]:
            return (f"{rel}: {algorithm} {crc}, manifest says {info[algorithm]} "
                    f"(contents altered)")
    return None


def _run_checks(check: Callable[[tuple[str, dict[str, Any]]], str | None],
                entries: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The problems ``check`` finds in manifest ``entries``, in order, a few at a time
    (checksums release the GIL and overlap I/O)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return [problem for problem in pool.map(check, entries) if problem]


def _algorithm_of(info: dict[str, Any]) -> str:
    """The checksum algorithm of one (parsed, hence valid) manifest entry."""
    return next(name for name in ALGORITHMS if name in info)


def _listed_files(path: str) -> list[str]:
    """Every file under a checkpoint directory that a commit would list, as manifest paths
    (symlinked directories are reported as entries, never followed)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = os.path.relpath(os.path.join(dirpath, name), path).replace(os.sep, "/")
            if rel != COMMIT_MARKER and not name.startswith(_TMP_PREFIX):
                found.append(rel)
    return found


def _safe_relpath(rel: Any) -> bool:
    """A manifest path must stay inside its checkpoint directory."""
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or "\x00" in rel:
        return False
    parts = rel.split("/")
    return all(p not in ("", ".", "..") for p in parts)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """The content of a ``COMMITTED`` marker."""

    step: int
    """Global step of the checkpoint."""
    files: dict[str, dict[str, Any]]
    """Relative path -> {"size": int, "crc32c": "8 hex digits"} for every file written
    ("crc32" instead of "crc32c" in format-1 manifests; see jaxckpt/checksum.py)."""
    created: float
    """Unix time of the commit."""

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    def to_bytes(self) -> bytes:
        body = {"format": MANIFEST_FORMAT, "step": self.step, "created": self.created,
                "total_bytes": self.total_bytes, "files": self.files}
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> Manifest:
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(f"{where}: commit marker is not valid JSON ({exc})") from exc
        if not isinstance(body, dict) or body.get("format") not in _READABLE_MANIFEST_FORMATS:
            raise CheckpointCorruptError(
                f"{where}: commit marker has format {body.get('format') if isinstance(body, dict) else body!r}, "
                f"expected one of {', '.join(_READABLE_MANIFEST_FORMATS)}")
        # Format 1 knows crc32 only; format 2 entries carry crc32c, or crc32 where the
        # writer had no crc32c extension.
        allowed = ("crc32",) if body["format"] == "jaxckpt.commit/1" else ALGORITHMS
        files = body.get("files")
        if not isinstance(files, dict):
            raise CheckpointCorruptError(f"{where}: commit marker has no file list")
        for rel, info in files.items():
            if not _safe_relpath(rel):
                raise CheckpointCorruptError(
                    f"{where}: commit marker names {rel!r}, a path outside the checkpoint; "
                    f"refusing to trust this checkpoint")
            if (not isinstance(info, dict) or not isinstance(info.get("size"), int)
                    or [isinstance(info.get(name), str) for name in allowed].count(True) != 1):
                raise CheckpointCorruptError(f"{where}: malformed manifest entry for {rel!r}")
        step, created = body.get("step"), body.get("created", 0.0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointCorruptError(f"{where}: commit marker has step {step!r}, not an int >= 0")
        if (isinstance(created, bool) or not isinstance(created, (int, float))
                or not math.isfinite(created)):
            raise CheckpointCorruptError(f"{where}: commit marker has created={created!r}, not a time")
        if not files:
            raise CheckpointCorruptError(
                f"{where}: commit marker lists no files; a real checkpoint always has some, so "
                f"this marker cannot vouch for anything")
        return cls(step=step, files=files, created=float(created))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One checkpoint directory as found on disk."""

    step: int
    path: str
    status: Status
    problems: tuple[str, ...] = ()
    manifest: Manifest | None = None


class ReadClaims:
    """The deferred checksums of one restore, shared between the thread that checks them
    and a backend that checks some of them itself while it reads the same bytes.

    The manager offers the deferred entries of each directory being restored, before the
    read starts. A backend that reads a file whole ``claim``s it (it then computes the
    checksum of what it read and ``settle``s it, which records a mismatch) and ``close``s
    once it knows which files it claims; the checking thread waits for that, then checks
    the ``unclaimed`` rest. Each file is checked exactly once. ``close`` is idempotent; the
    manager also calls it when the read ends, so the checking thread never waits forever.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # realpath of the file -> (directory it was offered with, manifest path, entry)
        self._offered: dict[str, tuple[str, str, dict[str, Any]]] = {}
        self._claimed: dict[str, tuple[str, str, dict[str, Any]]] = {}
        self._settled: set[str] = set()
        self._problems: dict[str, list[str]] = {}

    def offer(self, path: str, entries: list[tuple[str, dict[str, Any]]]) -> None:
        with self._lock:
            for rel, info in entries:
                full = os.path.realpath(os.path.join(path, *rel.split("/")))
                self._offered[full] = (path, rel, info)

    def claim(self, file: str) -> tuple[str, str] | None:
        """Take over the check of ``file``: its (algorithm, expected checksum), or None when
        it is not offered (not deferred, already claimed, or claiming has closed)."""
        with self._lock:
            if self._closed.is_set():
                return None
            full = os.path.realpath(file)
            item = self._offered.pop(full, None)
            if item is None:
                return None
            self._claimed[full] = item
            algorithm = _algorithm_of(item[2])
            return algorithm, item[2][algorithm]

    def settle(self, file: str, checksum: str) -> None:
        """The checksum of what was read from a claimed ``file``."""
        with self._lock:
            full = os.path.realpath(file)
            path, rel, info = self._claimed[full]
            self._settled.add(full)
            algorithm = _algorithm_of(info)
            if checksum != info[algorithm]:
                self._problems.setdefault(path, []).append(
                    f"{rel}: {algorithm} {checksum}, manifest says {info[algorithm]} "
                    "(contents altered)")

    def close(self) -> None:
        """No more claims: the checking thread may start on what is left."""
        with self._lock:
            self._closed.set()

    def unclaimed(self, path: str) -> list[tuple[str, dict[str, Any]]]:
        """Once claiming has closed: the entries of ``path`` that nobody claimed."""
        self._closed.wait()
        with self._lock:
            return sorted((rel, info) for owner, rel, info in self._offered.values()
                          if owner == path)

    def problems(self, path: str) -> list[str]:
        """Once the read ended: mismatches in the claimed files of ``path``, and claimed
        files whose checksum never came (a read that stopped half way vouches for nothing)."""
        with self._lock:
            unsettled = sorted(rel for full, (owner, rel, _) in self._claimed.items()
                               if owner == path and full not in self._settled)
            return list(self._problems.get(path, [])) + [
                f"{rel}: claimed by the reader but its checksum was never computed"
                for rel in unsettled]


class RootLock:
    """An exclusive ``flock`` on ``{root}/.lock`` held for a job's lifetime.

    The kernel releases it when the holder dies (SIGKILL included), so a crashed job never
    leaves a stale lock. ``flock`` locks are per open file, so a second manager in the same
    process is refused too. On network filesystems without flock support, locking degrades
    to a no-op with nothing to protect against; use one root per job there.
    """

    def __init__(self, root: str):
        self.path = os.path.join(root, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise RootLockedError(
                f"checkpoint root {os.path.dirname(self.path)!r} is in use by another running "
                f"job ({holder}). Two jobs writing one root would delete each other's "
                f"checkpoints. Give this run its own root (e.g. a new trial directory), or stop "
                f"the other job first.") from None
        info = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "since": time.strftime("%Y-%m-%dT%H:%M:%S")})
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None


class CheckpointStore:
    """Checkpoint directories of one root: ``{root}/recover`` and ``{root}/export``."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = os.fspath(root)
        self.recover_dir = os.path.join(self.root, RECOVER)
        self.export_dir = os.path.join(self.root, EXPORT)

    # --- naming -------------------------------------------------------------------------
    def step_path(self, step: int) -> str:
        return os.path.join(self.recover_dir, f"step_{step:08d}")

    def item_path(self, name: str, version: int) -> str:
        """Directory of one version of an auxiliary item (e.g. a GRPO reference policy)."""
        return os.path.join(self.recover_dir, ITEMS, name, f"v{version:06d}")

    def item_versions(self, name: str, *, committed_only: bool = True) -> list[int]:
        """Versions of an item on disk, oldest first (committed ones unless told otherwise)."""
        base = os.path.join(self.recover_dir, ITEMS, name)
        try:
            names = os.listdir(base)
        except FileNotFoundError:
            return []
        out = []
        for entry in names:
            match = _VERSION_RE.match(entry)
            if match and (not committed_only
                          or os.path.exists(os.path.join(base, entry, COMMIT_MARKER))):
                out.append(int(match.group(1)))
        return sorted(out)

    def item_names(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(os.path.join(self.recover_dir, ITEMS))
                          if _ITEM_DIR_RE.match(n))
        except FileNotFoundError:
            return []

    def ensure_dirs(self) -> None:
        for path in (self.root, self.recover_dir, self.export_dir):
            os.makedirs(path, exist_ok=True)

    # --- listing and verification ---------------------------------------------------------
    def _step_dirs(self) -> list[tuple[int, str]]:
        try:
            names = os.listdir(self.recover_dir)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = _STEP_RE.match(name)
            path = os.path.join(self.recover_dir, name)
            if match and os.path.isdir(path):
                found.append((int(match.group(1)), path))
        return sorted(found)

    def read_manifest(self, path: str) -> Manifest | None:
        """The manifest of a checkpoint directory, or None when it has no marker."""
        try:
            with open(os.path.join(path, COMMIT_MARKER), "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return None
        except OSError as exc:  # a directory in its place, no permission, I/O error
            raise CheckpointCorruptError(f"{path}: commit marker is unreadable ({exc})") from exc
        return Manifest.parse(data, path)

    def _committed_manifest(self, path: str) -> Manifest:
        """The manifest of ``path``; raises like :meth:`verify` when there is none."""
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"no checkpoint directory at {path!r}")
        manifest = self.read_manifest(path)
        if manifest is None:
            raise CheckpointCorruptError(
                f"{path}: no {COMMIT_MARKER} marker: this checkpoint never finished committing "
                f"(the job stopped while saving); it is not restorable")
        return manifest

    def verify(self, path: str, *, checksums: bool = True,
               defer_over: int | None = None) -> list[str]:
        """Problems found in a committed checkpoint (empty when it is valid).

        Every listed file must exist inside the directory with its listed size (and checksum
        with ``checksums``), and no file may be present that the manifest does not list.
        ``defer_over``: leave out the checksums of bulk-data files larger than this many bytes
        (see ``DEFER_CHECKSUMS_OVER``; everything else, their sizes included, is still
        checked); :meth:`verify_deferred` checks exactly those later. None (the default)
        checks every checksum here.

        Raises ``CheckpointNotFoundError`` when ``path`` is not a directory and
        ``CheckpointCorruptError`` when it has no or an unreadable commit marker.
        """
        manifest = self._committed_manifest(path)
        inside = os.path.realpath(path)

        def check(item: tuple[str, dict[str, Any]]) -> str | None:
            rel, info = item
            crc = checksums and (defer_over is None or not _deferrable(rel, info, defer_over))
            return _check_file(path, inside, rel, info, checksums=crc)

        problems = _run_checks(check, sorted(manifest.files.items()))
        for rel in sorted(set(_listed_files(path)) - set(manifest.files)):
            # A file the commit never vouched for could be read by a backend all the same.
            problems.append(f"{rel}: not in the manifest (added after the commit)")
        return problems

    def verify_deferred(self, path: str, *, over: int = DEFER_CHECKSUMS_OVER) -> list[str]:
        """The second half of ``verify(path, checksums=True, defer_over=over)``: problems in
        the files whose checksums it left out (their sizes are compared again too), empty when
        they match. Raises like :meth:`verify`."""
        return self.verify_entries(path, self.deferred_entries(path, over=over))

    def deferred_entries(self, path: str, *,
                         over: int = DEFER_CHECKSUMS_OVER) -> list[tuple[str, dict[str, Any]]]:
        """The manifest entries whose checksums ``verify(defer_over=over)`` leaves out, as
        (manifest path, entry). Raises like :meth:`verify`."""
        manifest = self._committed_manifest(path)
        return [(rel, info) for rel, info in sorted(manifest.files.items())
                if _deferrable(rel, info, over)]

    def verify_entries(self, path: str, entries: list[tuple[str, dict[str, Any]]]) -> list[str]:
        """Problems in these manifest entries of ``path`` (size and checksum), a few files
        at a time."""
        inside = os.path.realpath(path)
        return _run_checks(lambda item: _check_file(path, inside, *item, checksums=True),
                           entries)

    def _classify(self, step: int, path: str, *, checksums: bool,
                  defer_over: int | None = None) -> Entry:
        """One step directory with its status: partial (no marker), corrupt, or committed
        (``defer_over``: as in :meth:`verify`)."""
        try:
            manifest = self.read_manifest(path)
        except CheckpointCorruptError as exc:
            return Entry(step=step, path=path, status="corrupt", problems=(str(exc),))
        if manifest is None:
            return Entry(step=step, path=path, status="partial")
        problems = tuple(self.verify(path, checksums=checksums, defer_over=defer_over))
        return Entry(step=step, path=path, status="corrupt" if problems else "committed",
                     problems=problems, manifest=manifest)

    def entry(self, path: str, *, checksums: bool = False) -> Entry:
        """One checkpoint directory with its status, as :meth:`entries` reports it; its step
        is the manifest's, else the one in its name (``step_N``, ``vN``), else 0."""
        match = _STEP_RE.match(os.path.basename(path)) or _VERSION_RE.match(
            os.path.basename(path))
        entry = self._classify(int(match.group(1)) if match else 0, path, checksums=checksums)
        if entry.manifest is not None and entry.manifest.step != entry.step:
            entry = dataclasses.replace(entry, step=entry.manifest.step)
        return entry

    def entries(self, *, checksums: bool = False) -> list[Entry]:
        """Every step directory, oldest first, with its status."""
        return [self._classify(step, path, checksums=checksums)
                for step, path in self._step_dirs()]

    def committed_steps(self) -> list[int]:
        """Steps with a commit marker (not re-verified; cheap), oldest first."""
        steps = []
        for step, path in self._step_dirs():
            if os.path.exists(os.path.join(path, COMMIT_MARKER)):
                steps.append(step)
        return steps

    def latest_valid(self, *, checksums: bool = True, at_or_before: int | None = None,
                     defer_over: int | None = None) -> tuple[Entry | None, list[Entry]]:
        """The newest valid checkpoint and the newer ones skipped (partial or corrupt).

        With ``defer_over`` (see :meth:`verify`) the returned entry is valid except for the
        checksums left out, which the caller must check with :meth:`verify_deferred`."""
        skipped: list[Entry] = []
        for step, path in reversed(self._step_dirs()):
            if at_or_before is not None and step > at_or_before:
                continue
            entry = self._classify(step, path, checksums=checksums, defer_over=defer_over)
            if entry.status == "committed":
                return entry, skipped
            skipped.append(entry)
        return None, skipped

    # --- commit ---------------------------------------------------------------------------
    def commit(self, path: str, step: int, *, exclude: tuple[str, ...] = (),
               known: dict[str, dict[str, Any]] | None = None) -> Manifest:
        """Make ``path`` a valid checkpoint: checksum and fsync every file and directory in
        it, then write the marker atomically. Call only after every process's writes ended.

        ``known``: manifest entries (``{"size": n, algorithm: hex}``, by path relative to
        ``path``) of files whose writer computed their checksum from the bytes it wrote and
        made them durable itself (``zarr_io``): those are not read back, only their size is
        checked against the file's. Entries of another algorithm than this commit's, or of
        files that are not there, are refused (a writer's bug, never a valid manifest).
        """
        files = sorted(rel for rel in _listed_files(path) if rel not in exclude)
        dirs = [dirpath for dirpath, _, _ in os.walk(path)]
        algorithm = default_algorithm()
        known = dict(known or {})
        for rel, info in known.items():
            if rel not in files or set(info) != {"size", algorithm}:
                raise ValueError(f"commit of {path}: the writer's checksum entry for {rel!r} "
                                 f"({info!r}) names no file of the checkpoint or is not "
                                 f"{{'size', {algorithm!r}}}")

        def summarise(rel: str) -> tuple[int, str]:
            full = os.path.join(path, rel)
            if rel in known:
                size = os.lstat(full).st_size
                if size != known[rel]["size"]:
                    raise CheckpointWriteError(
                        f"{full} has {size} bytes but its writer wrote {known[rel]['size']}: "
                        "the file changed after it was written. This save is not committed.")
                return size, known[rel][algorithm]
            # Our writers never make links; one found here is recorded, never followed, and
            # verification refuses it.
            return (0, "link") if os.path.islink(full) else file_checksum(full, algorithm,
                                                                          fsync=True)

        unknown = [rel for rel in files if rel not in known]
        with ThreadPoolExecutor(max_workers=4) as pool:
            sums = dict(zip(unknown, pool.map(summarise, unknown)))
        sums.update((rel, summarise(rel)) for rel in known)
        sums_in_order = [sums[rel] for rel in files]
        # Deepest first, so that every rename inside the checkpoint is durable before its
        # parent's entry is.
        for directory in sorted(dirs, key=len, reverse=True):
            fsync_dir(directory)
        manifest = Manifest(step=step, created=time.time(),
                            files={rel: {"size": size, algorithm: crc}
                                   for rel, (size, crc) in zip(files, sums_in_order)})
        atomic_write(os.path.join(path, COMMIT_MARKER), manifest.to_bytes())
        fsync_dir(os.path.dirname(path))
        return manifest

    # --- reading and deletion ----------------------------------------------------------------
    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[None]:
        """Hold a shared lock on a checkpoint while restoring it, so retention skips it."""
        fd = None
        try:
            fd = os.open(os.path.join(path, COMMIT_MARKER), os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)
        except FileNotFoundError:
            fd = None
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)

    def delete(self, path: str) -> bool:
        """Delete one checkpoint directory; False when it is being read (try again later).

        Files already gone (another deleter, a user) count as deleted.
        """
        marker = os.path.join(path, COMMIT_MARKER)
        try:
            fd = os.open(marker, os.O_RDONLY)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            try:
                # Un-commit first: a crash from here on leaves a partial directory, never a
                # committed checkpoint with files missing.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(marker)
                with contextlib.suppress(FileNotFoundError):
                    fsync_dir(path)
            finally:
                os.close(fd)
        _rmtree_tolerant(path)
        return True

    def cleanup_partial(self) -> list[str]:
        """Remove recovery directories without a commit marker and stray temp entries, as a
        job starts (under the root lock, so no other job can be writing them)."""
        removed = []
        for step, path in self._step_dirs():
            if not os.path.exists(os.path.join(path, COMMIT_MARKER)):
                _rmtree_tolerant(path)
                removed.append(path)
        for name in self.item_names():
            for version in self.item_versions(name, committed_only=False):
                path = self.item_path(name, version)
                if not os.path.exists(os.path.join(path, COMMIT_MARKER)):
                    _rmtree_tolerant(path)
                    removed.append(path)
        for parent in (self.recover_dir, self.export_dir):
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(parent):
                    if name.startswith(_TMP_PREFIX):
                        full = os.path.join(parent, name)
                        _rmtree_tolerant(full)
                        removed.append(full)
        return removed

    def quarantine(self, path: str, reason: str) -> str:
        """Move a checkpoint that must not stay at its name (corrupt, or from a discarded
        future) to ``recover/superseded/``, keeping it for inspection instead of deleting."""
        target_dir = os.path.join(self.recover_dir, SUPERSEDED)
        os.makedirs(target_dir, exist_ok=True)
        target = os.path.join(target_dir, f"{os.path.basename(path)}.{reason}.{int(time.time())}"
                                          f".{uuid.uuid4().hex[:6]}")
        os.rename(path, target)
        fsync_dir(self.recover_dir)
        return target

    # --- exports ------------------------------------------------------------------------
    def export_entries(self) -> list[tuple[int, str]]:
        """(global_step, path) of every completed export, oldest first."""
        try:
            names = os.listdir(self.export_dir)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = _EXPORT_RE.match(name)
            if match:
                found.append((int(match.group(3)), os.path.join(self.export_dir, name)))
        return sorted(found)

    def export_tmp_path(self, name: str) -> str:
        return os.path.join(self.export_dir, f"{_TMP_PREFIX}{name}.{uuid.uuid4().hex[:8]}")

    def delete_export(self, path: str) -> None:
        """Delete an export: renamed to a temp name first (so a crash midway leaves debris
        that start-up cleanup removes, never a half model under a valid name)."""
        doomed = self.export_tmp_path(os.path.basename(path) + ".deleting")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return
        _rmtree_tolerant(doomed)


def _rmtree_tolerant(path: str) -> None:
    """Remove a tree, treating entries that vanish meanwhile (a racing deleter) as removed."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    for dirpath, dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(dirpath, name))
        for name in dirnames:
            full = os.path.join(dirpath, name)
            with contextlib.suppress(FileNotFoundError):
                if os.path.islink(full):
                    os.unlink(full)
                else:
                    os.rmdir(full)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise
        shutil.rmtree(path, ignore_errors=True)  # a writer raced us; one more sweep


# --- whose directory is this? ----------------------------------------------------------------
def _listdir(path: str) -> list[str] | None:
    """Names in ``path``; None when it is not a directory (missing, a file)."""
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return None


def foreign_entries(root: str) -> list[str]:
    """Entries under ``root`` that jaxckpt never writes, as paths relative to it (sorted;
    directories end in '/'). Empty for a missing or empty directory and for one that holds
    only what jaxckpt writes: ``.lock``, ``recover/`` (step directories, ``items/``,
    ``superseded/``, temporary ``.tmp-*`` entries) and ``export/`` (export directories,
    temporary entries). Reads names only, never contents; writes nothing."""
    names = _listdir(root)
    if names is None:
        return []
    allowed = {RECOVER: (lambda n: bool(_STEP_RE.match(n)) or n in (ITEMS, SUPERSEDED)),
               EXPORT: (lambda n: bool(_EXPORT_RE.match(n)))}
    found = []
    for name in names:
        full = os.path.join(root, name)
        is_dir = os.path.isdir(full) and not os.path.islink(full)
        shown = name + "/" if is_dir else name
        if name in _SYSTEM_NAMES or name.startswith(_TMP_PREFIX):
            continue
        if name not in _ROOT_NAMES or (name in allowed) != is_dir:
            found.append(shown)
            continue
        if name in allowed:  # a directory of ours: check one level down too
            for child in _listdir(full) or []:
                if not (child.startswith(_TMP_PREFIX) or child in _SYSTEM_NAMES
                        or allowed[name](child)):
                    found.append(f"{name}/{child}")
    return found


def _describe_foreign(path: str, found: list[str]) -> str:
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    looks_orbax = any(entry.rstrip("/") in _ORBAX_HINTS for entry in found) or any(
        re.fullmatch(r"(?:\w+_)?\d+/", entry)
        and os.path.exists(os.path.join(path, entry, "_CHECKPOINT_METADATA"))
        for entry in found)
    hint = (f" It looks like an Orbax checkpoint: `jaxckpt import-orbax {path} NEW_ROOT` (or "
            f"jaxckpt.import_orbax(src, new_root)) turns it into a jaxckpt checkpoint without "
            f"changing it." if looks_orbax else "")
    return f"{path!r} holds entries jaxckpt never writes: {shown}.{hint}"


def check_root(root: str) -> None:
    """Raise ``CheckpointRootError`` when ``root`` holds entries jaxckpt did not write (see
    ``foreign_entries``), naming some and the fix, or cannot be listed (what it holds is
    unknown, so nothing may be written there either). Reads names only; writes nothing."""
    try:
        found = foreign_entries(root)
    except OSError as exc:
        raise CheckpointRootError(
            f"checkpoint root {root!r} cannot be used: listing it failed: {exc.strerror or exc} "
            f"({exc.filename}). Fix: pass another root, or give this user read and write "
            f"access to it (chmod/chown).") from exc
    if found:
        raise CheckpointRootError(
            f"refusing checkpoint root: {_describe_foreign(root, found)} jaxckpt writes into "
            f"and deletes under its root, so it never shares one with other files. Fix: pass "
            f"a new or empty directory as the root (e.g. a subdirectory of this one).")


def _looks_like_checkpoint(path: str, names: list[str]) -> bool:
    """A jaxckpt checkpoint directory, committed or not: it has the marker or driver state,
    or is named and placed like one (``recover/step_N``, ``items/NAME/vN``), even if empty
    (a job killed right after creating it)."""
    if COMMIT_MARKER in names or DRIVER_FILE in names:
        return True
    name, parent = os.path.basename(path), os.path.dirname(path)
    return bool((_STEP_RE.match(name) and os.path.basename(parent) == RECOVER)
                or (_VERSION_RE.match(name)
                    and os.path.basename(os.path.dirname(parent)) == ITEMS))


def classify_path(path: str) -> tuple[PathKind, str]:
    """What ``path`` is, and a sentence saying so for the user: "missing", "unreadable"
    (no permission), "file", "empty" (a directory with nothing in it), "foreign" (holds
    entries jaxckpt never writes), "checkpoint" (one checkpoint directory, committed or
    partial) or "root"."""
    if not os.path.lexists(path):
        return "missing", f"no such file or directory: {path!r}"
    try:
        names = _listdir(path)
        found = foreign_entries(path)
    except OSError as exc:
        return "unreadable", f"cannot read {path!r}: {exc.strerror or exc} ({exc.filename})"
    if names is None:
        return "file", f"{path!r} is a file, not a jaxckpt checkpoint or root (a directory)"
    if _looks_like_checkpoint(path, names):
        return "checkpoint", f"{path!r} is a checkpoint directory"
    if not [name for name in names if name not in _SYSTEM_NAMES]:
        return "empty", (f"{path!r} is an empty directory: not a jaxckpt checkpoint or root "
                         f"(nothing was ever saved here)")
    if found:
        return "foreign", f"not a jaxckpt checkpoint or root: {_describe_foreign(path, found)}"
    return "root", f"{path!r} is a checkpoint root"
