"""Where the DCP backend's files live: a local directory, or prefixes of a jaxckpt ``Storage``.

Owns: ``LocalDcpFiles`` (a directory filled under ``.tmp-{name}`` and renamed into place)
and ``StorageDcpFiles`` (an object store's prefix written in place, data files streamed up
as DCP writes them through ``dcp.upload``, ``.metadata`` put once at its final name;
restores fetch the byte ranges their tensors occupy, or a whole file whose checksum is
checked, into one buffer, read by ``dcp.metadata``'s reader), behind the one interface
``DcpBackend`` uses; and DCP's ``FileSystemBase`` over a ``Storage``.

Must not import: jax, orbax. ``torch.distributed.checkpoint`` is imported on first use.

Concurrency: a ``*DcpFiles`` object holds nothing beyond its storage and is used from the
training thread and DCP's writer threads at once; each writer or reader it makes serves
one ``dcp.save``/``dcp.load``.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import functools
import os
import shutil
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from jaxckpt.commit.deferred_checks import DeferredChecks
from jaxckpt.core.checksum import RunningChecksum, extend, file_checksum
from jaxckpt.core.layout import OBJECTS_FILE, TMP_PREFIX
from jaxckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointWriteError,
)
from jaxckpt.storage.base import Storage
from jaxckpt.storage.buffers import fresh_blocks
from jaxckpt.storage.posix import fsync_dir
from jaxckpt.storage.readers import SeekableReader
from torch_bridge.dcp import metadata as dcp_metadata
from torch_bridge.dcp.incremental import CONTENT_FILE, incremental_writer_class
from torch_bridge.dcp.local_writer import checksumming_writer_class
from torch_bridge.dcp.upload import UploadStream

__all__ = ["DCP_METADATA", "LocalDcpFiles", "StorageDcpFiles"]

DCP_METADATA = ".metadata"
#: ranges of one file closer than this are fetched as one (a GET costs more than the gap).
_MERGE_GAP = 1 << 20
#: a fetched range longer than this is split into GETs of this size run in parallel.
_FETCH_PIECE = 32 << 20
_FETCH_THREADS = 8
#: files of a local directory checked at once before a restore loads them.
_CHECK_THREADS = 4


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


def _missing(directory: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(f"no checkpoint at {directory}: the directory does not "
                                   "exist")


def _without_objects(directory: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{directory} has no {OBJECTS_FILE}: it was not written by jaxckpt's DCP backend, "
        "or its write did not finish. Fix: point at a checkpoint directory that DcpBackend "
        "wrote completely.")


def _without_metadata(directory: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{directory} has no DCP {DCP_METADATA} file: its write "
                                  "did not finish. Fix: restore an older checkpoint.")


def _exists_error(directory: str) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"checkpoint directory {directory} already exists; the DCP backend only writes into "
        "new directories. Fix: write to a fresh directory, or delete the stale one first.")


# ------------------------------------------------------------------------- local disk


class LocalDcpFiles:
    """A local directory: filled under ``.tmp-{name}`` and renamed into place by the
    primary once every process's data and DCP's metadata are written, so it only ever
    appears complete."""

    @staticmethod
    def staging_path(directory: str) -> str:
        parent, name = os.path.split(os.path.normpath(directory))
        return os.path.join(parent, f"{TMP_PREFIX}{name}")

    def prepare(self, directory: str, staging: str, document: bytes, writer: Any) -> None:
        """Primary: refuse an existing ``directory``, clear a crashed attempt's staging
        directory, create it and write ``objects.json`` there (the commit checksums and
        fsyncs it: ``writer`` records nothing of it)."""
        if os.path.lexists(directory):
            raise _exists_error(directory)
        if os.path.lexists(staging):  # debris of an attempt that crashed
            shutil.rmtree(staging)
        # exist_ok: another process's DCP writer may have created it already.
        os.makedirs(staging, exist_ok=True)
        with open(os.path.join(staging, OBJECTS_FILE), "wb") as stream:
            stream.write(document)

    @staticmethod
    def writer(staging: str, *, sync_files: bool, in_process: bool = True) -> Any:
        """A writer that checksums and fsyncs each file as it writes it
        (``dcp.local_writer``), so that the commit reads nothing back, and hashes each tensor
        for the next incremental save (``dcp.incremental``); DCP's plain writer where
        ``in_process`` is False (DCP's checkpoint process writes with a copy of the writer,
        whose checksums this process would never see: the commit reads the files)."""
        if in_process:
            return incremental_writer_class(checksumming_writer_class())(staging)
        return _dcp().FileSystemWriter(staging, sync_files=sync_files)

    @staticmethod
    def known_checksums(writer: Any, directory: str) -> dict[str, dict[str, Any]] | None:
        """Manifest entries of the files ``writer`` wrote and fsynced (computed from the
        bytes written), by path relative to the directory it filled; None from DCP's plain
        writer, whose files the commit reads back."""
        written = getattr(writer.fs, "written", None)
        if not written:
            return None
        base = str(writer.path)
        return {os.path.relpath(path, base).replace(os.sep, "/"): entry
                for path, entry in written.items()}

    @staticmethod
    def publish(staging: str, directory: str) -> None:
        """Primary: move the finished staging directory to its final name."""
        os.rename(staging, directory)
        fsync_dir(os.path.dirname(directory) or ".")

    @staticmethod
    def read_document(directory: str) -> bytes:
        """``objects.json``'s bytes, once the directory is known to hold DCP's metadata."""
        if not os.path.isdir(directory):
            raise _missing(directory)
        file = os.path.join(directory, OBJECTS_FILE)
        if not os.path.exists(file):
            raise _without_objects(directory)
        if not os.path.exists(os.path.join(directory, DCP_METADATA)):
            raise _without_metadata(directory)
        with open(file, "rb") as stream:
            return stream.read()

    @staticmethod
    def read_content(directory: str) -> bytes | None:
        """``directory``'s content.json (``dcp.incremental``), None where it has none."""
        try:
            with open(os.path.join(directory, CONTENT_FILE), "rb") as stream:
                return stream.read()
        except FileNotFoundError:
            return None

    @staticmethod
    def reader(directory: str, claims: DeferredChecks | None = None, partial: bool = False,
               references: Mapping[str, Any] | None = None) -> Any:
        """The safe reader of ``directory``. With ``claims``, first claims every offered file
        of the directory and checks it (its checksum from the disk, before DCP loads
        anything), then closes them; the reader's ``damaged`` names the files that do not
        match (load nothing then). ``partial`` changes nothing here: a local restore checks
        every data file, as it did before the read when the manager checked them.
        ``references``: the keys (relative to ``recover/``) its records may point into."""
        reader = dcp_metadata.safe_reader(directory)  # looked up per call: tests count reads
        reader.references = dict(references or {})
        reader.damaged = _check_local_claims(directory, claims) if claims is not None else []
        return reader


# ---------------------------------------------------------------------- object storage


class StorageDcpFiles:
    """Prefixes (URLs) of ``storage``: written in place, no staging name, no rename."""

    def __init__(self, storage: Storage):
        self.storage = storage

    @staticmethod
    def staging_path(directory: str) -> str:
        return directory

    def prepare(self, directory: str, staging: str, document: bytes, writer: Any) -> None:
        """Primary: put ``objects.json`` create-only, which refuses a prefix that an
        earlier write filled (each one puts it first; the manager moves an earlier attempt
        aside before), in the one request instead of a listing and a put; its manifest
        entry goes with ``writer``'s, so that the commit does not fetch it back. An
        ``objects.json`` with the very same bytes (a state of the same structure) passes,
        as the storage takes it for a retry of this put."""
        path = f"{directory}/{OBJECTS_FILE}"
        try:
            self.storage.create(path, document)
        except FileExistsError:
            raise _exists_error(directory) from None
        writer.fs.written[path] = _entry(document)

    def writer(self, staging: str, *, sync_files: bool, in_process: bool = True) -> Any:
        # sync_files has no meaning here: an upload is durable once it returns; async saves
        # to a store always run on a thread of this process (in_process).
        return incremental_writer_class(_storage_writer_class())(staging, self.storage)

    @staticmethod
    def publish(staging: str, directory: str) -> None:
        """Nothing: the data was written at its final location."""

    @staticmethod
    def known_checksums(writer: Any, directory: str) -> dict[str, dict[str, Any]] | None:
        """Manifest entries of the files ``writer`` uploaded below ``directory`` (computed
        from the bytes sent; an upload is durable once it returns), by relative path: the
        commit takes them instead of reading the files back."""
        prefix = directory.rstrip("/") + "/"
        return {path[len(prefix):]: entry for path, entry in writer.fs.written.items()
                if path.startswith(prefix)} or None

    def read_document(self, directory: str) -> bytes:
        try:
            document = self.storage.read(f"{directory}/{OBJECTS_FILE}")
        except FileNotFoundError:
            if not self.storage.is_prefix(directory):
                raise _missing(directory) from None
            raise _without_objects(directory) from None
        try:
            # A read, not a HEAD: the manager's verification just fetched this small object,
            # and the storage answers from the bytes it kept, with no request.
            self.storage.read(f"{directory}/{DCP_METADATA}")
        except FileNotFoundError:
            raise _without_metadata(directory) from None
        return document

    def read_content(self, directory: str) -> bytes | None:
        """``directory``'s content.json (``dcp.incremental``), None where it has none."""
        try:
            return self.storage.read(f"{directory}/{CONTENT_FILE}")
        except FileNotFoundError:
            return None

    def reader(self, directory: str, claims: DeferredChecks | None = None,
               partial: bool = False, references: Mapping[str, Any] | None = None) -> Any:
        """The reader of ``directory``: it fetches each data file's needed ranges once; with
        ``claims``, it fetches every claimed file whole and checks it against its checksum
        before DCP copies anything into the live tensors (``damaged`` then names the files
        that failed, and nothing is loaded). ``partial``: the offered files it does not read
        are withdrawn (nothing restored comes from them). ``references``: the keys
        (relative to ``recover/``) its records may point into."""
        reader = _storage_reader_class()(directory, self.storage, claims, partial)
        reader.references = dict(references or {})
        return reader


def _entry(data: bytes) -> dict[str, Any]:
    """The manifest entry of ``data`` in the commit's algorithm."""
    return RunningChecksum().add(data).entry()


class _RangeFile(SeekableReader):
    """A read-only, seekable view of one object: bytes inside the prefetched ranges come
    from memory, anything else is fetched by a ranged GET."""

    def __init__(self, storage: Storage, path: str, ranges: list[tuple[int, Any]]):
        super().__init__()
        self._storage = storage
        self._path = path
        # Views, so that a read slices without copying: each byte is copied once, into
        # the buffer DCP reads into.
        self._ranges = sorted(((start, memoryview(data)) for start, data in ranges),
                              key=lambda item: item[0])
        self._starts = [start for start, _ in self._ranges]

    def _end(self) -> int:
        return self._storage.size(self._path)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = len(view)
        index = bisect.bisect_right(self._starts, self._position) - 1
        data: Any = b""
        if index >= 0:
            start, held = self._ranges[index]
            inside = self._position - start
            if inside < len(held):
                data = held[inside:inside + wanted]
        if not len(data):
            data = self._storage.read(self._path, offset=self._position, length=wanted)
        view[:len(data)] = data
        self._position += len(data)
        return len(data)

    def readall(self) -> bytes:
        """The rest of the object in one GET (RawIOBase's would GET it 8 KiB at a time)."""
        data = self._storage.read(self._path, offset=self._position)
        self._position += len(data)
        return data


@functools.cache
def _storage_fs_class() -> type:
    """DCP's ``FileSystemBase`` over a jaxckpt ``Storage`` (paths are the storage's URLs),
    built on first use so that torch.distributed.checkpoint is imported only then."""
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    class _StorageFileSystem(FileSystemBase):
        def __init__(self, storage: Storage):
            self.storage = storage
            #: path -> [(offset, bytes)] fetched ahead of a read (_StorageReader.read_data).
            self.prefetched: dict[str, list[tuple[int, Any]]] = {}
            #: path -> manifest entry of each file uploaded (the commit need not read it back).
            self.written: dict[str, dict[str, Any]] = {}

        def create_stream(self, path: Any, mode: str) -> Any:
            # Unbuffered on purpose: a buffer's read-ahead would GET past the fetched ranges.
            if mode == "wb":
                return UploadStream(self.storage, str(path), self.written)
            if mode == "rb":
                return _RangeFile(self.storage, str(path), self.prefetched.get(str(path), []))
            raise ValueError(f"object storage streams are 'wb' or 'rb', not {mode!r}")

        def concat_path(self, path: Any, suffix: str) -> str:
            if "://" in suffix:  # a referenced file, resolved by the reader (dcp.incremental)
                return suffix
            return f"{str(path).rstrip('/')}/{suffix}"

        def rename(self, path: Any, new_path: Any) -> None:
            self.storage.copy(str(path), str(new_path))  # no rename on an object store
            self.storage.delete(str(path))

        def init_path(self, path: Any) -> str:
            return str(path).rstrip("/")

        def mkdir(self, path: Any) -> None:
            self.storage.make_prefix(str(path))

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return "://" in str(checkpoint_id)

        def exists(self, path: Any) -> bool:
            return self.storage.exists(str(path))

        def rm_file(self, path: Any) -> None:
            self.storage.delete(str(path))

        def ls(self, path: Any) -> list[str]:
            return [self.concat_path(path, name.rstrip("/"))
                    for name in self.storage.list_names(str(path))]

    return _StorageFileSystem


@functools.cache
def _storage_writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    class _StorageWriter(FileSystemWriter):
        """FileSystemWriter over a Storage; ``.metadata`` goes up once at its final name."""

        def __init__(self, path: str, storage: Storage):
            super().__init__(path, sync_files=False)
            self.fs = _storage_fs_class()(storage)
            self.path = self.fs.init_path(path)

        def _metadata_exists(self) -> bool:
            # DCP asks only to warn before overwriting; this prefix is new (prepare refused
            # a filled one), so the answer is known without a HEAD request.
            return False

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            # DCP's finish writes ".metadata.tmp" and renames it: a copy and a delete here.
            metadata.version = CURRENT_DCP_VERSION
            metadata.storage_data = {result.index: result.storage_data
                                     for batch in results for result in batch}
            metadata.storage_meta = self.storage_meta()
            rank = self.rank if not self.use_collectives and self.rank is not None else None
            path = str(self._get_metadata_path(rank))
            data = dcp_metadata.dump_metadata(metadata)
            fs: Any = self.fs  # the _StorageFileSystem set in __init__
            fs.storage.write(path, data)
            fs.written[path] = _entry(data)

    return _StorageWriter


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted (offset, end) spans merged where they overlap or lie within ``_MERGE_GAP``."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start - merged[-1][1] <= _MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _fetch(storage: Storage, pool: concurrent.futures.Executor, path: str,
           start: int, end: int, *, piece: int = _FETCH_PIECE) -> memoryview:
    """Bytes [start, end) of ``path`` streamed into one fresh buffer (``read_into``: on an
    object store straight from the socket, no body object joined and copied), in pieces of
    ``piece`` bytes fetched on ``pool``; shorter where the object ends sooner."""
    # A map of our own in 4 KiB pages, as the JAX reader's (every byte is written before it
    # is read): numpy's np.empty asks for huge pages, whose cost on a VM that hands freed
    # memory back to its host swings with the memory's history
    # (benchmarks/results/dcp-s3-speed_cpu2core_2026-11-25.md).
    buffer = fresh_blocks(end - start)[:end - start]
    view = buffer.data
    spans = [(offset, min(end, offset + piece)) for offset in range(start, end, piece)]

    def fetch(span: tuple[int, int]) -> int:
        return storage.read_into(path, view[span[0] - start:span[1] - start], offset=span[0])

    counts = [fetch(spans[0])] if len(spans) == 1 else list(pool.map(fetch, spans))
    filled = 0
    for (low, high), count in zip(spans, counts, strict=True):
        filled += count
        if count < high - low:  # the object ends here: what follows was never written
            break
    return view[:filled]


def _fetch_whole(storage: Storage, pool: concurrent.futures.Executor, path: str,
                 size: int) -> memoryview:
    """The object ``path`` whose DCP metadata says it holds ``size`` bytes, into one
    buffer by one GET (as a raw download of it: some servers, moto among them, read a
    whole object for every range of it). One byte more is asked for, so that a longer
    object shows without a size request; such an object (not DCP's writing) is then read
    whole as it is."""
    data = _fetch(storage, pool, path, 0, size + 1, piece=size + 1)
    if len(data) > size:
        return memoryview(storage.read(path))
    return data


def _checksum_problem(claims: DeferredChecks, path: str, claimed: tuple[str, str],
                      data: Any) -> bool:
    """Settle the claim of ``path`` with the checksum of ``data`` (its bytes, or a
    ``(size, checksum)`` computed elsewhere); whether it does not match."""
    algorithm, expected = claimed
    if isinstance(data, tuple):
        actual = data[1]
    else:
        actual = f"{extend(algorithm, 0, memoryview(data)):08x}"
    claims.settle(path, actual)
    return actual != expected


def _check_local_claims(directory: str, claims: DeferredChecks) -> list[str]:
    """Claim every offered file of the local ``directory``, check each one (a few at a
    time), close the claims; the names of the files that do not match."""
    paths = sorted(os.path.join(directory, name) for name in os.listdir(directory))
    claimed = {path: found for path in paths if (found := claims.claim(path)) is not None}
    claims.close()

    def damaged(path: str) -> bool:
        algorithm = claimed[path][0]
        return _checksum_problem(claims, path, claimed[path], file_checksum(path, algorithm))

    with concurrent.futures.ThreadPoolExecutor(_CHECK_THREADS) as pool:
        flags = list(pool.map(damaged, claimed))
    return [os.path.basename(path) for path, bad in zip(claimed, flags, strict=True) if bad]


def _fetch_files(storage: Storage, paths: dict[str, str],
                 spans: dict[str, list[tuple[int, int]]], sizes: dict[str, int],
                 claimed: dict[str, tuple[str, str]], claims: DeferredChecks | None,
                 ) -> tuple[dict[str, list[tuple[int, Any]]], dict[str, tuple[int, str]]]:
    """The needed bytes of each file (path -> [(offset, bytes)]; ``paths``: relative path
    -> URL): a claimed file whole, as the manager fetched it ahead (its checksum, computed
    as it came, goes in the second mapping) or by one GET here; the others' merged
    ranges."""
    fetched: dict[str, list[tuple[int, Any]]] = {}
    sums: dict[str, tuple[int, str]] = {}
    # Whole ranges on one pool, their pieces on another: no pool waits on itself.
    with concurrent.futures.ThreadPoolExecutor(_FETCH_THREADS) as pool, \
            concurrent.futures.ThreadPoolExecutor(_FETCH_THREADS) as pieces:
        jobs = {}
        for relative, ranges in spans.items():
            path = paths[relative]
            if path in claimed:
                ahead = None if claims is None else claims.fetched(path)
                if ahead is not None:
                    fetched[path], sums[path] = [(0, ahead[0])], (len(ahead[0]), ahead[1])
                    continue
                # Whole, to check it, and as the storage reads a whole object (a raw
                # download through the same client): one pass, no range read again.
                jobs[path, 0] = pool.submit(_fetch_whole, storage, pieces, path, sizes[relative])
                continue
            for start, end in _merge(ranges):
                jobs[path, start] = pool.submit(_fetch, storage, pieces, path, start, end)
        for (path, start), job in jobs.items():
            fetched.setdefault(path, []).append((start, job.result()))
    return fetched, sums


def _let_go(fetched: dict[str, list[tuple[int, Any]]]) -> None:
    """Drop the fetched buffers (``fetched`` is emptied) on a thread of their own: handing
    the pages back to the system (the buffer's ``munmap``, which releases the GIL) takes
    time the restore need not wait for. The caller keeps no other
    reference to them."""
    buffers = [data for ranges in fetched.values() for _, data in ranges]
    fetched.clear()
    threading.Thread(target=buffers.clear, name="jaxckpt-let-go", daemon=True).start()


@functools.cache
def _storage_reader_class() -> type:
    SafeReader = dcp_metadata.safe_reader_class()

    class _StorageReader(SafeReader):  # type: ignore[misc, valid-type]
        """The safe reader over a Storage, fetching each file's needed ranges ahead."""

        def __init__(self, path: str, storage: Storage, claims: DeferredChecks | None = None,
                     partial: bool = False):
            super().__init__(path)
            self.fs = _storage_fs_class()(storage)
            self.path = self.fs.init_path(path)
            self._claims = claims
            self._partial = partial
            #: names of the claimed files whose bytes did not match (nothing was loaded).
            self.damaged: list[str] = []

        def _claim(self, relatives: Iterable[str]) -> dict[str, tuple[str, str]]:
            """Claim the offered files among those read (path -> algorithm, checksum), and
            close the claims; a partial read withdraws the offered files it does not read."""
            if self._claims is None:
                return {}
            paths = [self.fs.concat_path(self.path, relative) for relative in relatives]
            claimed = {path: found for path in paths
                       if (found := self._claims.claim(path)) is not None}
            if self._partial:
                self._claims.limit(str(self.path), [])
            self._claims.close()
            return claimed

        def read_data(self, plan: Any, planner: Any) -> Any:
            spans: dict[str, list[tuple[int, int]]] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                spans.setdefault(info.relative_path, []).append(
                    (info.offset, info.offset + info.length))
            # A DCP data file is its records back to back: it ends where its last one does.
            sizes: dict[str, int] = {}
            for info in self.storage_data.values():
                sizes[info.relative_path] = max(sizes.get(info.relative_path, 0),
                                                info.offset + info.length)
            claimed = self._claim(spans)
            paths = {relative: self.fs.concat_path(self.path, relative) for relative in spans}
            fetched, sums = _fetch_files(self.fs.storage, paths, spans, sizes, claimed,
                                         self._claims)
            claims = self._claims
            self.damaged = [] if claims is None else [
                path.rsplit("/", 1)[-1] for path, found in claimed.items()
                if _checksum_problem(claims, path, found, sums.get(path, fetched[path][0][1]))]
            if self.damaged:  # DCP copies nothing into the live tensors
                from torch.futures import Future

                done: Future[None] = Future()
                done.set_result(None)
                return done
            self.fs.prefetched = fetched
            try:
                return super().read_data(plan, planner)
            finally:
                self.fs.prefetched = {}
                _let_go(fetched)

    return _StorageReader
