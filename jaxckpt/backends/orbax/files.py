"""Where the native Orbax-layout writer and reader keep their files: a local directory, or
objects of a ``jaxckpt.storage.base.Storage``.

Owns: ``ArrayFiles``, the few operations the native writer (``write``, ``shards``) and reader
(``read``) need from the place an ``arrays/`` directory lives, and its implementations:
``LocalArrayFiles`` (``chunk_io`` on a local filesystem, written under a temporary directory
renamed into place once complete, its small files, directories and chunk files made durable
on side threads while the chunk files are written), ``SharedLocalArrayFiles`` (the same in
place, for the ``arrays/`` several processes write together) and ``StorageArrayFiles`` (an
object per file, written at its final name: a store has no rename, and the commit marker
written after them makes them count; big chunk files read in ranged GETs). ``StoragePath``
lets the backend's code for a checkpoint directory run on such a location. Both write the
same bytes under the same names, so a checkpoint copied between a disk and an object store
stays valid.

Must not import: jax, orbax, torch.

Concurrency contract: every method may be called from several threads at once on different
paths (the writer and reader run one file per I/O thread).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from jaxckpt.backends.orbax import chunk_io, zarr_format
from jaxckpt.core.checksum import default_algorithm, extend
from jaxckpt.errors import CheckpointCorruptError
from jaxckpt.storage import buffers
from jaxckpt.storage.base import Storage
from jaxckpt.storage.posix import fsync_dir, fsync_file
from jaxckpt.storage.threads import SharedThreads

__all__ = [
    "RANGED_READ_OVER",
    "ArrayFiles",
    "LocalArrayFiles",
    "ReadableFiles",
    "SharedLocalArrayFiles",
    "StorageArrayFiles",
    "StoragePath",
    "WRITTEN",
    "WrittenBytes",
]

#: Chunk objects larger than this are read in ranged GETs of at most this size (equal
#: parts), several at once. Not smaller: some servers (moto among them) read a whole object
#: for every range of it.
RANGED_READ_OVER = 64 << 20

#: fsyncs of small files and directories one process keeps in flight beside its chunk
#: writes: enough for a write's names to go out together (flushes of the device's cache in
#: flight together are merged by the block layer; one at a time they would each stall the
#: chunk writes).
_SYNC_THREADS = 16
_syncer = SharedThreads(_SYNC_THREADS, "jaxckpt-names")
"""The process's threads that fsync names and small files during a local write."""


class WrittenBytes:
    """A running count of the bytes the native writer handed to files and objects (chunk
    files and the small metadata files of ``arrays/``), for tests and benchmarks that check
    what a save wrote rather than what a directory holds (an incremental save, issue 32).
    ``WRITTEN.total()`` before and after a save: the difference. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0

    def add(self, count: int) -> None:
        with self._lock:
            self._total += count

    def total(self) -> int:
        with self._lock:
            return self._total


#: Every byte written through an ``ArrayFiles`` of this process (``WrittenBytes``).
WRITTEN = WrittenBytes()


class ReadableFiles(Protocol):
    """What the native reader needs from where an ``arrays/`` directory lives (its two
    reads; ``incremental.Redirected`` adds the files a checkpoint refers to)."""

    def read_small(self, path: str, limit: int) -> bytes:
        """The first ``limit`` bytes of a small file; ``OSError`` when it cannot be read."""

    def read_chunk(self, path: str, nbytes: int, *, algorithm: str | None,
                   offset: int) -> tuple[np.ndarray, str | None]:
        """A chunk file whole, in an aligned buffer, and its checksum (``chunk_io.read_chunk``)."""


class ArrayFiles(Protocol):
    """What the native writer and reader need from where an ``arrays/`` directory lives.
    Paths are locations of that place (a filesystem path, or a URL of the storage)."""

    def start(self, final: str) -> str:
        """Where to write the files of the directory ``final`` (a new temporary directory,
        or ``final`` itself where nothing can be renamed)."""

    def finish(self, base: str, final: str) -> None:
        """Make what was written under ``base`` appear at ``final``."""

    def abandon(self, base: str) -> None:
        """A write into ``base`` failed: remove what it wrote, where that is cheap."""

    def chunk_offset(self, array: np.ndarray, base: str) -> int:
        """Where ``array``'s bytes start in its chunk file (``chunk_io.data_offset``)."""

    def make_parent(self, path: str) -> None:
        """Prepare the directories above ``path`` (nothing on an object store)."""

    def write_small(self, path: str, text: str) -> tuple[int, str] | None:
        """Write a small metadata file; its (size, checksum) when it is checksummed and
        durable once ``finish`` returns (then the commit neither reads nor syncs it), else
        None. It may still be on its way when this returns."""

    def entries_made(self, directory: str) -> bool:
        """Every entry of ``directory`` (below a directory from ``start``) is there now:
        make its names durable by the time ``finish`` returns, where this place has
        directories of its own to sync (True), else False (the commit syncs them)."""

    def names_made(self) -> None:
        """Every file and directory of the write exists (the last chunk file is being
        written): start the syncs of the small files and directories told so far, all at
        once. Those told later start at once; ``finish`` starts any left."""

    def write_chunk(self, path: str, array: np.ndarray, *, algorithm: str, offset: int,
                    created: Callable[[], None] | None = None) -> tuple[int, str]:
        """Write one array's chunk file, durable once ``finish`` returns (or on return,
        where ``finish`` waits for nothing); (size, checksum with ``algorithm``).
        ``created``: called once the file is at its name, before its bytes go out (each
        time it is made: ``chunk_io.write_chunk``), where files have names to sync."""

    def read_small(self, path: str, limit: int) -> bytes:
        """The first ``limit`` bytes of a small file; ``OSError`` when it cannot be read."""

    def read_chunk(self, path: str, nbytes: int, *, algorithm: str | None,
                   offset: int) -> tuple[np.ndarray, str | None]:
        """A chunk file whole, in an aligned buffer, and its checksum (``chunk_io.read_chunk``)."""


class LocalArrayFiles:
    """``ArrayFiles`` on a local filesystem: ``chunk_io`` with O_DIRECT where ``direct``.

    The small files, and the directories the writer says are complete (``entries_made``),
    are fsynced on side threads together once every name exists (``names_made``: while
    the last chunk files are written), and ``finish`` waits for them: their flushes of
    the device's cache overlap the data instead of following its last byte in the commit,
    and go out as one burst rather than one by one among the chunk writes (each flush
    stalls them). The checksum of a small file is of the bytes written.

    Each chunk file's fsync runs on a side thread too, started as soon as its last byte
    is written (``chunk_io.write_chunk``'s ``sync_later``), so that the I/O thread starts
    its next file meanwhile, and ``finish`` waits for it like the others.

    Concurrency contract: as the module's; one instance serves one write (the syncs it
    started are that write's, waited for by its ``finish``)."""

    #: Whether chunk files are fsynced on a side thread and waited for by ``finish``
    #: (not where ``finish`` does not wait: ``SharedLocalArrayFiles``).
    sync_chunks_aside = True

    def __init__(self, *, direct: bool):
        self.direct = direct
        self._syncs: list[concurrent.futures.Future[None]] = []
        self._pending: list[tuple[Callable[[str], None], str]] | None = []  # None: released
        self._syncs_lock = threading.Lock()

    def start(self, final: str) -> str:
        base = f"{final}.tmp-{os.getpid()}-{time.time_ns()}"
        os.mkdir(base)
        return base

    def finish(self, base: str, final: str) -> None:
        self.names_made()
        self._wait_synced()
        os.rename(base, final)

    def abandon(self, base: str) -> None:
        with self._syncs_lock:
            self._pending = []  # never started: nothing of a failed write needs them
        with contextlib.suppress(Exception):
            self._wait_synced()  # nothing of a failed write outlives it
        shutil.rmtree(base, ignore_errors=True)

    def names_made(self) -> None:
        with self._syncs_lock:
            pending, self._pending = self._pending or [], None
            self._syncs += [_syncer.get().submit(fsync, path) for fsync, path in pending]

    def _sync_soon(self, fsync: Callable[[str], None], path: str) -> None:
        with self._syncs_lock:
            if self._pending is not None:
                self._pending.append((fsync, path))
            else:
                self._syncs.append(_syncer.get().submit(fsync, path))

    def _wait_synced(self) -> None:
        """Wait for every fsync started so far; raise the first one's error."""
        with self._syncs_lock:
            futures, self._syncs = self._syncs, []
        errors = [future.exception() for future in futures]
        for error in errors:
            if error is not None:
                raise error

    def chunk_offset(self, array: np.ndarray, base: str) -> int:
        return chunk_io.data_offset(array, base, direct=self.direct)

    def make_parent(self, path: str) -> None:
        os.makedirs(os.path.dirname(path))

    def write_small(self, path: str, text: str) -> tuple[int, str] | None:
        data = text.encode("utf-8")
        with open(path, "xb") as stream:
            stream.write(data)
        WRITTEN.add(len(data))
        self._sync_soon(fsync_file, path)
        return len(data), f"{extend(default_algorithm(), 0, data):08x}"

    def entries_made(self, directory: str) -> bool:
        self._sync_soon(fsync_dir, directory)
        return True

    def write_chunk(self, path: str, array: np.ndarray, *, algorithm: str, offset: int,
                    created: Callable[[], None] | None = None) -> tuple[int, str]:
        aside = self._sync_aside if self.sync_chunks_aside else None
        size, crc = chunk_io.write_chunk(path, array, algorithm=algorithm,
                                         direct=self.direct, offset=offset, created=created,
                                         sync_later=aside)
        WRITTEN.add(size)
        return size, crc

    def _sync_aside(self, sync: Callable[[], None]) -> None:
        """Start a chunk file's fsync now, on a side thread; ``finish`` waits for it."""
        with self._syncs_lock:
            self._syncs.append(_syncer.get().submit(sync))

    def read_small(self, path: str, limit: int) -> bytes:
        with open(path, "rb") as stream:
            return stream.read(limit)

    def read_chunk(self, path: str, nbytes: int, *, algorithm: str | None,
                   offset: int) -> tuple[np.ndarray, str | None]:
        return chunk_io.read_chunk(path, nbytes, algorithm=algorithm, direct=self.direct,
                                  offset=offset)

    def read_chunk_into(self, path: str, out: np.ndarray, *, algorithm: str | None,
                        offset: int) -> tuple[np.ndarray, str | None]:
        """The array's bytes of a chunk file put into ``out``; its shard index and checksum
        (``chunk_io.read_chunk_into``). Local files only: the reader asks for it by name."""
        return chunk_io.read_chunk_into(path, out, algorithm=algorithm, direct=self.direct,
                                        offset=offset)


class SharedLocalArrayFiles(LocalArrayFiles):
    """``LocalArrayFiles`` for a directory that several processes write together (each its
    own chunk files): written in place, since no one process knows when the others are
    done; the checkpoint's commit marker, written once all are, makes the files count."""

    sync_chunks_aside = False  # nobody waits for them: each chunk file synced in place

    def start(self, final: str) -> str:
        os.makedirs(final, exist_ok=True)
        return final

    def finish(self, base: str, final: str) -> None:
        """Nothing to move: the files are at their names."""

    def abandon(self, base: str) -> None:
        """Left to the manager, which removes an uncommitted checkpoint whole."""

    def make_parent(self, path: str) -> None:
        # Chunks of one array share directories, and other processes make them too.
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def write_small(self, path: str, text: str) -> tuple[int, str] | None:
        # No fsync of its own: the primary's commit fsyncs (and checksums) every such file.
        with open(path, "x", encoding="utf-8") as stream:
            WRITTEN.add(len(text.encode("utf-8")))
            stream.write(text)
        return None

    def entries_made(self, directory: str) -> bool:
        """Other processes add entries to the same directories: the commit syncs them."""
        return False


class StorageArrayFiles:
    """``ArrayFiles`` as objects of ``storage`` (see the module docstring).

    ``read_threads``: ranged GETs in flight for one big chunk object. The pool is this
    object's own (the reader calls ``read_chunk`` from its pool's threads already, and a
    task waiting on tasks of its own pool can starve it)."""

    def __init__(self, storage: Storage, *, read_threads: int = 8):
        self.storage = storage
        self._read_threads = read_threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._small_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._sending: dict[str, concurrent.futures.Future[None]] = {}
        self._pool_lock = threading.Lock()

    def shutdown(self, wait: bool = True) -> None:
        """Stop the ranged-read and small-write threads (later calls start new ones)."""
        with self._pool_lock:
            pools = [self._pool, self._small_pool]
            self._pool = self._small_pool = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=wait)

    def start(self, final: str) -> str:
        return final

    def finish(self, base: str, final: str) -> None:
        """Nothing to move: the objects are at their names, and only the checkpoint's commit
        marker (written later, by the store) makes them count. Waits for the small files
        still being sent (``write_small``) below the directory that holds ``base`` (the
        state directory: its ``tree.json`` goes up beside ``arrays/``)."""
        self._wait_sent(base.rsplit("/", 1)[0])

    def abandon(self, base: str) -> None:
        """Left to the manager, which removes an uncommitted checkpoint whole; the small
        files still being sent are waited for first, so that none lands after."""
        with contextlib.suppress(Exception):
            self._wait_sent(base.rsplit("/", 1)[0])

    def chunk_offset(self, array: np.ndarray, base: str) -> int:
        return 0  # no O_DIRECT on a network write: tensorstore's own layout

    def make_parent(self, path: str) -> None:
        """Object stores have no directories."""

    def entries_made(self, directory: str) -> bool:
        """No directories, nothing to sync: an object is durable when its PUT returns."""
        return False

    def names_made(self) -> None:
        """Nothing waits for it: small objects go up as they are written."""

    def write_small(self, path: str, text: str) -> tuple[int, str]:
        """Sent on this object's own threads, so that a small PUT holds up neither the
        chunk uploads of the I/O thread that calls it nor the next small file (a round
        trip each, all in flight at once); ``finish`` waits for them. The checksum is
        of the bytes sent."""
        data = text.encode("utf-8")
        WRITTEN.add(len(data))
        future = self._threads().submit(self.storage.write, path, data)
        with self._pool_lock:
            self._sending[path] = future
        return len(data), f"{extend(default_algorithm(), 0, data):08x}"

    def _wait_sent(self, base: str) -> None:
        """Wait for every small write below ``base``; raise the first one's error."""
        with self._pool_lock:
            below = sorted(path for path in self._sending if path.startswith(base + "/"))
            futures = [self._sending.pop(path) for path in below]
        errors = [future.exception() for future in futures]
        for error in errors:
            if error is not None:
                raise error

    def write_chunk(self, path: str, array: np.ndarray, *, algorithm: str, offset: int,
                    created: Callable[[], None] | None = None) -> tuple[int, str]:
        # ``created`` is not called: an object has no name to sync. The object is the
        # array's bytes then the shard index, sent from where they are
        # (``Storage.write_joined``: a copy into one fresh buffer cost here about the CPU
        # of the PUT itself); its checksum is taken from exactly those bytes.
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        index = zarr_format.shard_index(flat.size, offset)
        pieces: list[bytes | memoryview] = [bytes(offset), flat.data, index]
        crc = 0
        for piece in pieces:
            crc = extend(algorithm, crc, piece)
        if algorithm == "crc32c":  # the server checks what it received against it
            self.storage.write_joined(path, pieces, crc32c=crc)
        else:
            self.storage.write(path, b"".join(pieces))
        WRITTEN.add(offset + flat.size + len(index))
        return offset + flat.size + len(index), f"{crc:08x}"

    def read_small(self, path: str, limit: int) -> bytes:
        return self.storage.read(path, length=limit)

    def read_chunk(self, path: str, nbytes: int, *, algorithm: str | None,
                   offset: int) -> tuple[np.ndarray, str | None]:
        size = offset + nbytes + zarr_format.INDEX_BYTES
        # One byte more than expected is asked for: an object that is longer than its
        # zarr.json says shows up without a separate size request.
        wanted = size + 1
        buffer = buffers.fresh_blocks(wanted)  # streamed into and handed over: no copy
        view = buffer.data
        part = -(-wanted // -(-wanted // RANGED_READ_OVER))  # equal parts, none tiny
        ranges = [(start, min(part, wanted - start)) for start in range(0, wanted, part)]

        def fetch(piece: tuple[int, int]) -> int:
            start, length = piece
            return self.storage.read_into(path, view[start:start + length], offset=start)

        if len(ranges) == 1:
            counts = [fetch(ranges[0])]
        else:
            counts = list(self._readers().map(fetch, ranges))
        total = sum(counts)
        if total != size:
            raise CheckpointCorruptError(
                f"{path} has {total if total <= size else 'more than ' + str(size)} bytes; an "
                f"array of {nbytes} bytes at offset {offset} is stored in {size}. The "
                "checkpoint is damaged; restore another one.")
        content = buffer[:size]
        crc = None if algorithm is None else f"{extend(algorithm, 0, content):08x}"
        return content, crc

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._small_pool is None:
                self._small_pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.storage.concurrent_requests,
                    thread_name_prefix="jaxckpt-put")
            return self._small_pool

    def _readers(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._read_threads, thread_name_prefix="jaxckpt-get")
            return self._pool


class StoragePath:
    """A location of a ``Storage`` with the few members of ``epath.Path`` the Orbax backend
    uses on a checkpoint directory (``/``, ``exists``, ``iterdir``, ``mkdir``,
    ``read_bytes``, ``write_text``, ``os.fspath``), so that its code for a directory runs
    unchanged on an object store. Stateless; safe from any thread."""

    def __init__(self, storage: Storage, location: str):
        self.storage = storage
        self.location = location.rstrip("/")

    def __truediv__(self, name: str) -> StoragePath:
        return StoragePath(self.storage, f"{self.location}/{name}")

    def __fspath__(self) -> str:
        return self.location

    def __str__(self) -> str:
        return self.location

    def __repr__(self) -> str:
        return f"StoragePath({self.storage!r}, {self.location!r})"

    def exists(self) -> bool:
        """An object at this location, or objects below it. Asked in the likelier order
        first (a request each): a name with a dot (``tree.json``) as an object, one without
        (``state``, ``arrays``) as a prefix."""
        if "." in self.location.rsplit("/", 1)[-1]:
            return self.storage.exists(self.location) or self.storage.is_prefix(self.location)
        return self.storage.is_prefix(self.location) or self.storage.exists(self.location)

    def iterdir(self) -> Iterator[StoragePath]:
        for name in self.storage.list_names(self.location):
            yield self / name.rstrip("/")

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Object stores have no directories: nothing to make."""

    def read_bytes(self) -> bytes:
        return self.storage.read(self.location)

    def write_text(self, text: str) -> None:
        self.storage.write(self.location, text.encode("utf-8"))
