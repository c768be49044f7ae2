"""The storage seam: what the commit protocol needs from the place checkpoints are kept.

Owns: ``Storage``, the small interface the store (jaxckpt/commit/store.py) does its I/O through
(its POSIX implementation is ``jaxckpt.storage.posix``), and the pieces the object stores
share: ``object_name`` (a location to an object name inside a bucket and prefix),
``ReadHolds`` (per-process read holds), ``RootLock`` (a held root lock) and ``ObjectWriter``.

Locations are strings: a filesystem path for ``PosixStorage``, and for an object store a URL
(``s3://bucket/prefix/...``). Names below a location are joined with "/". The interface has
no rename: object stores cannot rename a prefix atomically (or cheaply), so the protocol
never relies on it. Atomic whole-object writes, create-only writes and a durability barrier
are what it relies on instead. The interface also has, with defaults that serve
a filesystem: ``copy`` (server-side on an object store), ``read_into`` (streaming into a
caller's buffer), ``write_checked`` (a write that hands the server the caller's crc32c),
``discard_incomplete_uploads``, ``concurrent_requests`` and ``open_writer`` (an object
written as a stream, ``ObjectWriter``; by default gathered in memory and written at close).

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Protocol

from jaxckpt.core.checksum import extend

__all__ = ["Storage", "ReadHolds", "object_name", "ObjectWriter", "RootLock"]

_READ_PIECE = 8 * 1024 * 1024


class RootLock(Protocol):
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
    def sync(self, prefix: str, *, data: bool = True, skip: Collection[str] = ()) -> None:
        """Durability barrier: everything written below ``prefix`` so far (by this process
        or another, through this interface or not), and ``prefix``'s own entry, survives a
        crash once this returns. ``data=False`` makes only the names durable (the directory
        entries), the caller having made the contents durable already (``checksum(sync=True)``,
        or a writer that fsyncs). ``skip``: directories below ``prefix`` (paths relative to
        it, "/"-separated) whose entries the caller made durable after the last of them was
        made: their names are not synced again (their files still are, with ``data``). A
        no-op where every write is durable on return."""

    # --- concurrency ---------------------------------------------------------------------
    @abc.abstractmethod
    def lock_root(self, root: str) -> RootLock:
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
