"""``Storage`` on a POSIX filesystem (local disk, NFS, Lustre...): paths are locations.

Owns: ``PosixStorage``, the only implementation that fsyncs, renames and ``flock``s; the
POSIX helpers it is made of (``fsync_file``, ``fsync_dir``, ``atomic_write``); and
``FlockLock``, the ``flock`` on ``{root}/.lock`` that is its root lock.

Concurrency: any thread; ``reading`` / ``delete_unless_reading`` exclude each other through
``flock`` on the marker across processes of a host.

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Collection, Iterator

from jaxckpt.core.checksum import file_checksum
from jaxckpt.core.layout import LOCK_FILE, tmp_name
from jaxckpt.errors import RootLockedError
from jaxckpt.storage.base import Storage
from jaxckpt.storage.threads import SharedThreads

__all__ = ["PosixStorage", "FlockLock", "fsync_file", "fsync_dir", "atomic_write"]

#: fsyncs ``PosixStorage.sync`` keeps in flight at once.
_SYNC_THREADS = 8
#: The process's threads for ``PosixStorage.sync``: single fsyncs that wait for nothing
#: else, so callers share them.
_syncer = SharedThreads(_SYNC_THREADS, "jaxckpt-fsync")


class PosixStorage(Storage):
    """``Storage`` on a POSIX filesystem (local disk, NFS, Lustre...): paths are locations.

    Guarantees as ``Storage`` states them, with these means: atomic writes are a temp file
    in the same directory, fsync, ``rename``, fsync of the directory; durability of files
    written by others is ``fsync`` of each file and each directory, several at once; the
    root lock is ``flock`` on ``{root}/.lock`` (``FlockLock``); ``reading`` and
    ``delete_unless_reading`` are shared and exclusive non-blocking ``flock`` on the marker,
    which exclude readers in any process of the same host (and across hosts where the
    filesystem supports flock). ``create`` checks for an existing entry, then renames:
    atomic for readers, but exclusive only against a creator holding the root lock.
    """

    def write(self, path: str, data: bytes | bytearray) -> None:
        atomic_write(path, data)

    def create(self, path: str, data: bytes) -> None:
        # rename(2) replaces silently, so "create only" is checked first; only the holder of
        # the root lock (one job, its primary process) creates markers, so nobody can come
        # in between.
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "already exists", path)
        atomic_write(path, data)

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        with open(path, "rb") as handle:
            if offset:
                handle.seek(offset)
            return handle.read() if length is None else handle.read(length)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def checksum(self, path: str, algorithm: str, *, sync: bool = False) -> tuple[int, str]:
        return file_checksum(path, algorithm, fsync=sync)

    def resolves_inside(self, path: str, prefix: str) -> bool:
        if os.path.islink(path):
            return False
        # Without a link between prefix and path, path resolves below prefix's real path:
        # checking the few directories in between for links is much cheaper than resolving
        # both (os.path.realpath costs about 40 us a call, a lot for ten thousand files).
        head = prefix.rstrip(os.sep) + os.sep
        if path.startswith(head):
            parts = path[len(head):].split(os.sep)
            if all(part not in ("", ".", "..") for part in parts):
                current = head
                for part in parts[:-1]:
                    current += part
                    if os.path.islink(current):
                        break
                    current += os.sep
                else:
                    return True
        return os.path.realpath(path).startswith(os.path.realpath(prefix) + os.sep)

    def list_names(self, prefix: str) -> list[str]:
        try:
            names = os.listdir(prefix)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(name + "/" if os.path.isdir(os.path.join(prefix, name)) else name
                      for name in names)

    def list_files(self, prefix: str) -> dict[str, int]:
        found = {}
        for dirpath, dirnames, filenames in os.walk(prefix):
            # os.walk lists a symlinked directory among dirnames but does not enter it: it is
            # reported as an entry of its own.
            links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
            for name in filenames + links:
                full = os.path.join(dirpath, name)
                try:
                    size = os.lstat(full).st_size
                except FileNotFoundError:
                    continue
                found[os.path.relpath(full, prefix).replace(os.sep, "/")] = size
        return found

    def is_prefix(self, path: str) -> bool:
        return os.path.isdir(path)

    def make_prefix(self, prefix: str) -> None:
        os.makedirs(prefix, exist_ok=True)

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def delete_prefix(self, prefix: str) -> None:
        _rmtree_tolerant(prefix)

    def sync(self, prefix: str, *, data: bool = True, skip: Collection[str] = ()) -> None:
        walked = list(os.walk(prefix))
        files = [] if not data else [
            full for dirpath, _, filenames in walked for name in filenames
            if not os.path.islink(full := os.path.join(dirpath, name))]
        synced = {os.path.normpath(os.path.join(prefix, *rel.split("/"))) for rel in skip}
        directories = [dirpath for dirpath, _, _ in walked
                       if os.path.normpath(dirpath) not in synced]
        directories.append(os.path.dirname(os.path.normpath(prefix)) or ".")
        # All at once: every fsync here ends in a flush of the device's cache, even for a
        # directory with nothing left to write, and flushes in flight together are merged
        # by the block layer, so a commit's ~130 directory fsyncs cost a fraction of their
        # serial time (benchmarks/results/cold-restore-hugepages_cpu2core_2026-11-25.md).
        # The order does not matter:
        # nothing relies on a prefix before this returns (the commit marker comes after),
        # and a crash in between leaves it uncommitted whichever fsyncs landed.
        pool = _syncer.get()
        list(pool.map(fsync_file, files))
        list(pool.map(fsync_dir, directories))

    def lock_root(self, root: str) -> FlockLock:
        lock = FlockLock(root)
        lock.acquire()
        return lock

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[None]:
        fd = None
        try:
            fd = os.open(path, os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_SH)
        except FileNotFoundError:
            fd = None
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)

    def delete_unless_reading(self, path: str) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            with contextlib.suppress(FileNotFoundError):
                fsync_dir(os.path.dirname(path))
        finally:
            os.close(fd)
        return True

    # --- POSIX only: not part of Storage ----------------------------------------------------
    def rename_posix(self, src: str, dst: str) -> None:
        """Move the directory ``src`` to ``dst`` atomically (``rename``), creating ``dst``'s
        parent, and make the move durable in ``src``'s parent. ``FileNotFoundError`` when
        ``src`` is gone. Not part of ``Storage``: an object store has no atomic rename, so
        only POSIX-only features (quarantine, export replacement) use it."""
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.rename(src, dst)
        fsync_dir(os.path.dirname(src))


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


def atomic_write(path: str, data: bytes | bytearray) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, and
    the new one survives a power loss once this returns: temp file, fsync, rename, dir fsync."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, tmp_name(os.path.basename(path), uuid.uuid4().hex))
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


class FlockLock:
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
