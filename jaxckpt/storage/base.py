"""The storage seam: what the commit protocol needs from the place checkpoints are kept.

Owns: ``Storage``, the small interface the store (jaxckpt/commit/store.py) does its I/O through,
and ``PosixStorage``, its implementation on a local or network filesystem, with the POSIX
helpers it is made of (``fsync_file``, ``fsync_dir``, ``atomic_write``) and ``RootLock``;
and the two pieces the object stores share: ``object_name`` (a location to an object name
inside a bucket and prefix) and ``ReadHolds`` (per-process read holds).

Locations are strings: a filesystem path for ``PosixStorage``, and for an object store a URL
(``s3://bucket/prefix/...``). Names below a location are joined with "/". The interface has
no rename: object stores cannot rename a prefix atomically (or cheaply), so the protocol
never relies on it. Atomic whole-object writes, create-only writes and a durability barrier
are what it relies on instead. ``PosixStorage`` uses temp + rename internally where a
filesystem needs it for atomicity, and offers moving a directory (``rename_posix``) only as
a POSIX-only extra, outside the interface. The interface also has, with defaults that serve
a filesystem: ``copy`` (server-side on an object store), ``read_into`` (streaming into a
caller's buffer), ``write_checked`` (a write that hands the server the caller's crc32c),
``discard_incomplete_uploads``, ``concurrent_requests`` and ``open_writer`` (an object
written as a stream, ``ObjectWriter``; by default gathered in memory and written at close).

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from jaxckpt.core.checksum import extend, file_checksum
from jaxckpt.core.layout import LOCK_FILE, tmp_name
from jaxckpt.errors import RootLockedError

__all__ = ["Storage", "PosixStorage", "ReadHolds", "object_name", "ObjectWriter", "RootLease",
           "RootLock", "fsync_file", "fsync_dir", "atomic_write"]

_READ_PIECE = 8 * 1024 * 1024
#: fsyncs ``PosixStorage.sync`` keeps in flight at once.
_SYNC_THREADS = 8


class RootLease(Protocol):
    """A held root lock (``Storage.lock_root``); ``release`` gives it up, idempotently."""

    def release(self) -> None: ...


class ObjectWriter(Protocol):
    """One object written as a stream (``Storage.open_writer``), by one thread: ``write``
    takes bytes in order; ``close`` stores the object as ``Storage.write`` would (atomic,
    durable when it returns: before it, no object or the old one is seen); ``abort`` stores
    nothing and frees what was held. After either, the writer takes nothing more."""

    def write(self, data: bytes | bytearray | memoryview) -> int: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class _GatheredWriter:
    """``ObjectWriter`` for any storage: the bytes are gathered in one growing buffer (each
    copied once: the caller may reuse its own) and written whole, with ``Storage.write``,
    at ``close``."""

    def __init__(self, storage: Storage, path: str):
        self._storage = storage
        self._path = path
        self._data: bytearray | None = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._data is None:
            raise ValueError(f"write to {self._path} after close or abort")
        view = memoryview(data).cast("B")
        self._data += view
        return len(view)

    def close(self) -> None:
        if self._data is not None:
            data, self._data = self._data, None
            self._storage.write(self._path, data)

    def abort(self) -> None:
        self._data = None


class Storage(abc.ABC):
    """What the commit protocol needs from a storage, and nothing more.

    Every method is safe to call from several threads of one process at once, on different
    locations; concurrent calls on one location behave as the method's docstring says.
    Errors are the built-in ``OSError`` subclasses: ``FileNotFoundError`` for a location
    that holds nothing, ``FileExistsError`` for a create-only write that found something.
    """

    #: How many whole-object operations (checksums, small reads) callers should run at
    #: once: a few on a disk, more where each one waits on a network round trip.
    concurrent_requests: int = 4

    # --- whole objects -------------------------------------------------------------------
    @abc.abstractmethod
    def write(self, path: str, data: bytes | bytearray) -> None:
        """Store ``data`` at ``path``, replacing what was there (``path``'s prefix prepared
        with ``make_prefix``).

        Atomic: a reader sees the old object or the whole new one, never a part. Durable when
        this returns (a crash afterwards keeps it). Two concurrent writers: one of them wins.
        """

    def write_checked(self, path: str, data: bytes | bytearray, *, crc32c: int) -> None:
        """``write``, with the crc32c of ``data`` that the caller computed: a storage that
        can send it along (S3: ``x-amz-checksum-crc32c``) has the server check the bytes it
        received against it, and computes no checksum of its own; others just write."""
        self.write(path, data)

    def write_joined(self, path: str, pieces: Sequence[bytes | bytearray | memoryview], *,
                     crc32c: int) -> None:
        """``write_checked`` of the concatenation of ``pieces`` (``crc32c``: of all of it).
        A storage that can send them in turn as one object's bytes does, without joining
        them (S3: one PUT whose body reads each piece in place); others join them first."""
        self.write_checked(path, b"".join(pieces), crc32c=crc32c)

    @abc.abstractmethod
    def create(self, path: str, data: bytes) -> None:
        """Store ``data`` at ``path`` only if nothing is there (``if-none-match: *``), else
        raise ``FileExistsError``. Used for the commit marker.

        Atomic and durable like ``write``; also makes the entry of ``path`` in its parent
        durable. Against a concurrent creator of the same location, see the implementation
        (an object store decides it on the server; ``PosixStorage`` relies on the root lock).
        """

    @abc.abstractmethod
    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """The bytes of the object at ``path`` (``length`` bytes from ``offset``, or to its
        end; fewer at the end of the object). ``FileNotFoundError`` when there is none."""

    def read_into(self, path: str, out: memoryview, *, offset: int = 0,
                  progress: Callable[[int], None] | None = None) -> int:
        """Read the object at ``path`` from ``offset`` into the writable buffer ``out`` (up
        to its length; fewer bytes at the end of the object); returns how many were read.
        ``FileNotFoundError`` when there is none. Object stores stream into ``out`` without
        an intermediate copy; this default reads, then copies. ``progress(count)``, called
        on the reading thread: the first ``count`` bytes of ``out`` are in (as often as the
        storage can tell; here once, at the end); what it raises stops the read."""
        data = self.read(path, offset=offset, length=len(out))
        out[:len(data)] = data
        if progress is not None:
            progress(len(data))
        return len(data)

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """The size in bytes of the object at ``path``; ``FileNotFoundError`` when none."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether something is stored at ``path`` (an object; on a filesystem any entry)."""

    def checksum(self, path: str, algorithm: str, *, sync: bool = False) -> tuple[int, str]:
        """(size, checksum as 8 hex digits) of the object at ``path``, in ``algorithm`` (one
        of ``checksum.ALGORITHMS``); ``sync`` also makes the object durable in the same pass
        (its writer may not have). This default reads it in pieces through ``read``."""
        crc = size = 0
        while True:
            piece = self.read(path, offset=size, length=_READ_PIECE)
            if not piece:
                break
            crc = extend(algorithm, crc, piece)
            size += len(piece)
        return size, f"{crc:08x}"

    def copy(self, src: str, dst: str) -> None:
        """Store at ``dst`` (replacing what is there) the bytes of the object at ``src``, as
        ``write`` would; ``FileNotFoundError`` when ``src`` holds nothing. Object stores
        copy on the server; this default reads and writes."""
        self.write(dst, self.read(src))

    def open_writer(self, path: str) -> ObjectWriter:
        """A writer that stores at ``path`` the bytes written to it, once closed (what
        ``write`` promises, from then on). This default keeps them in memory until then; an
        object store may send them while they come (S3: parts of a multipart upload)."""
        return _GatheredWriter(self, path)

    def discard_incomplete_uploads(self, prefix: str) -> list[str]:
        """Abort the uploads below ``prefix`` that were started and never finished (an
        object store's multipart uploads of a killed writer: invisible, but stored and
        billed); returns their locations. Call only under the root lock. Nothing to do on a
        filesystem (temporary files are found by listing)."""
        return []

    def resolves_inside(self, path: str, prefix: str) -> bool:
        """Whether reading ``path`` reads bytes stored under ``prefix``: False for a symbolic
        link, or a path through one, that leads elsewhere. Always True where there are no
        links (object stores)."""
        return True

    # --- prefixes ------------------------------------------------------------------------
    @abc.abstractmethod
    def list_names(self, prefix: str) -> list[str]:
        """Names directly under ``prefix``, sorted; a name that has entries below it (a
        directory) ends with "/". Empty when nothing is under ``prefix``. A listing taken
        while others write may or may not show their new entries."""

    @abc.abstractmethod
    def list_files(self, prefix: str) -> dict[str, int]:
        """Every object below ``prefix``, at any depth, as {path relative to ``prefix`` with
        "/" separators: size in bytes}. Links are listed (with their own size), never
        followed. Empty when nothing is under ``prefix``."""

    @abc.abstractmethod
    def is_prefix(self, path: str) -> bool:
        """Whether ``path`` is a prefix that may hold objects: a directory (even an empty
        one) on a filesystem, a prefix with at least one object below it on an object store."""

    def make_prefix(self, prefix: str) -> None:  # noqa: B027 - a no-op unless overridden
        """Prepare ``prefix`` to have objects written below it (a filesystem creates the
        directories; object stores need nothing). Idempotent."""

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Delete the object at ``path``; nothing there counts as deleted."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete everything below ``prefix`` (and ``prefix`` itself). Entries that vanish
        meanwhile (a racing deleter) count as deleted; nothing there is no error. Not atomic:
        a crash midway leaves some entries (delete the commit marker first)."""

    @abc.abstractmethod
    def sync(self, prefix: str, *, data: bool = True) -> None:
        """Durability barrier: everything written below ``prefix`` so far (by this process
        or another, through this interface or not), and ``prefix``'s own entry, survives a
        crash once this returns. ``data=False`` makes only the names durable (the directory
        entries), the caller having made the contents durable already (``checksum(sync=True)``,
        or a writer that fsyncs). A no-op where every write is durable on return."""

    # --- concurrency ---------------------------------------------------------------------
    @abc.abstractmethod
    def lock_root(self, root: str) -> RootLease:
        """Take the lock that keeps a second job out of ``root`` for this job's lifetime;
        ``RootLockedError`` (naming the holder) when another live job holds it. A holder that
        dies loses it (at once, or when its lease expires)."""

    @abc.abstractmethod
    def reading(self, path: str) -> contextlib.AbstractContextManager[None]:
        """Hold the object at ``path`` (a commit marker) against ``delete_unless_reading``
        while the context lasts: a shared hold, any number of readers. Nothing there: the
        context holds nothing."""

    @abc.abstractmethod
    def delete_unless_reading(self, path: str) -> bool:
        """Delete the object at ``path`` durably unless a ``reading`` context holds it; False
        when one does (nothing deleted). Nothing there counts as deleted (True)."""


def object_name(path: str, split: tuple[str, str], bucket: str, prefix: str,
                owner: object) -> str:
    """The object name of location ``path`` (``split``: its bucket and name) in an object
    store serving ``bucket`` below ``prefix``; ``ValueError`` naming ``owner`` outside it."""
    found, name = split
    inside = not prefix or name == prefix or name.startswith(prefix + "/")
    if found != bucket or not inside or "//" in name:
        raise ValueError(f"{path!r} is not a location of {owner!r}")
    return name


class ReadHolds:
    """Per-process ``reading`` holds by key, for stores with no server-side read lock (the
    object stores): ``hold(key)`` while a checkpoint is read; deleting under ``lock`` while
    ``counts`` has no entry for the key keeps a hold from starting in between."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
        try:
            yield
        finally:
            with self.lock:
                self.counts[key] -= 1
                if not self.counts[key]:
                    del self.counts[key]


class PosixStorage(Storage):
    """``Storage`` on a POSIX filesystem (local disk, NFS, Lustre...): paths are locations.

    Guarantees as ``Storage`` states them, with these means: atomic writes are a temp file
    in the same directory, fsync, ``rename``, fsync of the directory; durability of files
    written by others is ``fsync`` of each file and each directory, several at once; the
    root lock is ``flock`` on ``{root}/.lock`` (``RootLock``); ``reading`` and
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

    def sync(self, prefix: str, *, data: bool = True) -> None:
        walked = list(os.walk(prefix))
        files = [] if not data else [
            full for dirpath, _, filenames in walked for name in filenames
            if not os.path.islink(full := os.path.join(dirpath, name))]
        directories = [dirpath for dirpath, _, _ in walked]
        directories.append(os.path.dirname(os.path.normpath(prefix)) or ".")
        # All at once: every fsync here ends in a flush of the device's cache, even for a
        # directory with nothing left to write, and flushes in flight together are merged
        # by the block layer, so a commit's ~130 directory fsyncs cost a fraction of their
        # serial time (benchmarks/results/cold-restore-hugepages_cpu2core_2026-11-25.md).
        # The order does not matter:
        # nothing relies on a prefix before this returns (the commit marker comes after),
        # and a crash in between leaves it uncommitted whichever fsyncs landed.
        with ThreadPoolExecutor(max_workers=_SYNC_THREADS,
                                thread_name_prefix="jaxckpt-fsync") as pool:
            list(pool.map(fsync_file, files))
            list(pool.map(fsync_dir, directories))

    def lock_root(self, root: str) -> RootLock:
        lock = RootLock(root)
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
