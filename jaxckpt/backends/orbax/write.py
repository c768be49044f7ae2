"""The Orbax backend's write path: staging host arrays, and writing them natively or by Orbax.

Owns: the handle a write returns (:class:`OrbaxWriteHandle`), the host buffers a save copies
into and reuses (:class:`HostBuffers`), the Orbax type handlers the backend writes with
(numpy arrays not deep-copied a second time), and the native writer: the files Orbax's
``PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)`` writes, written through a
``files.ArrayFiles`` (:func:`write_native`): locally with ``chunk_io``
(O_DIRECT, checksums computed on the way) under a temporary name renamed into place once
complete, on an object store as objects at their names. Also the small-file writers of the
state directory (``tree.json``).

Which writer runs, on which thread, is the backend's decision (``backend``); this
module only does the writing. Must not import: torch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
from etils import epath

from jaxckpt.backends.orbax import zarr_format
from jaxckpt.backends.orbax.files import ArrayFiles
from jaxckpt.backends.orbax.incremental import Reuse
from jaxckpt.backends.orbax.plan import WritePlan, fill_pack, pack_length
from jaxckpt.backends.orbax.tree import ARRAYS_DIR, TREE_FILE, ZARR_JSON
from jaxckpt.core.checksum import default_algorithm
from jaxckpt.core.content_hash import HASH_NAME
from jaxckpt.errors import CheckpointWriteError
from jaxckpt.storage.buffers import aligned_empty

__all__ = ["OrbaxWriteHandle", "HostBuffers", "Written", "host_arrays",
           "type_handler_registry", "create_directory", "entries_of", "write_native",
           "write_small", "write_durably"]


@dataclasses.dataclass(frozen=True, slots=True)
class Written:
    """What a native write made durable itself, relative to the state directory it wrote."""

    entries: dict[str, dict[str, Any]]
    """Manifest entries of the files it checksummed and made durable (``entries_of``)."""
    durable_dirs: tuple[str, ...] = ()
    """Directories whose names (entries) it made durable; the commit syncs the others."""


class OrbaxWriteHandle:
    """A write started by :meth:`OrbaxBackend.write`.

    Concurrency contract: ``wait`` may be called from any thread, any number of times; every
    call after the write finished returns at once or re-raises the same error. The handle
    holds no Orbax state itself: the backend serialises access to its checkpointers.
    """

    __slots__ = ("directory", "nbytes", "_finish", "_finished", "_error", "_future",
                 "_written", "_reuse")

    def __init__(self, directory: str, nbytes: int, *,
                 finish: Callable[[OrbaxWriteHandle], None] | None = None,
                 future: concurrent.futures.Future[Any] | None = None,
                 written: Written | None = None,
                 reuse: Reuse | None = None):
        #: the checkpoint directory this write fills.
        self.directory = directory
        #: bytes of array data handed to Orbax (logical sizes, plus tree.json); known at
        #: staging time, so nobody needs to walk the directory to report a save's size.
        self.nbytes = nbytes
        # Single process: the backend's writer thread runs the write and ``future`` holds
        # its outcome. Otherwise Orbax's AsyncCheckpointer runs it: ``finish`` (the
        # backend's) waits for it and records the outcome here (``record_outcome``).
        # Neither: the write finished before the handle was made.
        self._finish = finish
        self._future = future
        self._finished = finish is None and future is None
        self._error: BaseException | None = None
        self._written = written  # a native sync write's outcome (an async one: ``future``)
        self._reuse = reuse  # an incremental write's decisions (``incremental.Reuse``)

    @property
    def references(self) -> dict[str, dict[str, Any]] | None:
        """The files of the write's ``IncrementalBase`` used instead of writing them
        (``{key: the base's entry}``); None without a base, or while (or when) the write
        has not succeeded. Known once ``wait`` returned; never blocks."""
        if self._reuse is None or self.checksums is None:
            return None
        return dict(self._reuse.references)

    @property
    def checksums(self) -> dict[str, dict[str, Any]] | None:
        """Manifest entries (``{"size": n, algorithm: hex}``) of the files this write made
        durable and checksummed itself, by path relative to ``directory``; None when Orbax
        wrote the arrays, or while (or when) the write has not succeeded. Known once
        ``wait`` returned; never blocks."""
        written = self._outcome()
        return None if written is None else written.entries

    @property
    def durable_dirs(self) -> tuple[str, ...]:
        """Directories below ``directory`` (relative paths) whose names this write made
        durable itself; the commit fsyncs the others. Empty while (or when) the write has
        not succeeded. Known once ``wait`` returned; never blocks."""
        written = self._outcome()
        return () if written is None else written.durable_dirs

    def _outcome(self) -> Written | None:
        future = self._future
        if future is not None:
            if future.done() and not future.cancelled() and future.exception() is None:
                result = future.result()  # None where Orbax wrote the arrays
                return result if isinstance(result, Written) else None
            return None
        return self._written

    def done(self) -> bool:
        """Whether the write is known to have finished (successfully or not)."""
        return self._future.done() if self._future is not None else self._finished

    def wait(self) -> None:
        """Block until Orbax finished this write; re-raise whatever made it fail."""
        if self._future is not None:
            self._future.result()
            return
        if not self._finished and self._finish is not None:
            self._finish(self)
        if self._error is not None:
            raise self._error

    def record_outcome(self, error: BaseException | None) -> None:
        """The backend's: the write Orbax ran for this handle finished, failing with
        ``error`` (None: it succeeded). Called with the backend's lock held."""
        self._error = error
        self._finished = True


# ------------------------------------------------------------------------------- staging


class _Staging:
    """Marks reused host buffers as taken by the write being staged."""

    @staticmethod
    def done() -> bool:
        return False


_STAGING = _Staging()

#: One reusable host buffer: ``[array, the write that last used it]`` (a handle, _STAGING
#: while a write is being staged, or None). Refilled only once that write is done.
_Slot = list[Any]


def host_view(array: Any) -> np.ndarray:
    """``np.asarray(array)`` of a CPU jax.Array (a read-only view, no copy) or a host array.

    For a dtype numpy has no buffer format for (bfloat16, the float8s, int4: ml_dtypes),
    ``np.asarray`` finds no buffer, falls back to ``jax.Array.__array__``, which returns
    ``np.asarray(array._value)``: the same array, dearer than asking for ``_value``
    directly, the more so under load (benchmarks/results/leaves-per-leaf_cpu2core_2026-11-25.md).
    Those dtypes ask for it; where it is missing, or for any other dtype, ``np.asarray``.
    For an array on one device, ``_value`` itself is skipped: it asks jaxlib for the same
    view after a profiler annotation and a replication check, which cost as much again
    (7 against 12.5 us a bfloat16 leaf; benchmarks/results/, first-save-leaves)."""
    if array.dtype.isbuiltin != 1:  # 2: a dtype of another library (ml_dtypes)
        if type(getattr(array, "sharding", None)) is _ONE_DEVICE:
            to_host = getattr(array, "_single_device_array_to_np_array_did_copy", None)
            if to_host is not None:
                value = to_host()[0]
                if type(value) is np.ndarray:
                    return value
        value = getattr(array, "_value", None)
        if type(value) is np.ndarray:
            return value
    return np.asarray(array)


_ONE_DEVICE = jax.sharding.SingleDeviceSharding


def host_arrays(arrays: list[jax.Array]) -> list[np.ndarray]:
    """Host numpy arrays of fully addressable jax.Arrays. On CPU a view (no copy; read-only,
    and the array cannot be donated while the view lives: ``host_view``); elsewhere one
    batched transfer. np.asarray is half the cost of jax.device_get per array, which shows
    at 10,000 leaves."""
    if jax.default_backend() == "cpu":
        return [host_view(array) for array in arrays]
    return jax.device_get(arrays)


def _fill_from(buffer: np.ndarray, pack: Any, members: list[Any], views: bool) -> None:
    """Fill ``buffer`` with the pack's ``members`` (host arrays, or with ``views`` CPU
    jax.Arrays and host arrays, viewed here: ``host_view``)."""
    fill_pack(buffer, pack, [host_view(member) for member in members] if views else members)


class HostBuffers:
    """The host buffers saves copy into (packs; numpy leaves of async saves), kept between
    saves when ``reuse`` (fresh buffers cost page faults that take longer than the copy
    itself).

    Concurrency contract: not thread-safe; the backend calls it with its lock held. A buffer
    is handed out again only once the write that last used it is done (its handle says so).
    """

    def __init__(self, *, reuse: bool):
        self._reuse = reuse
        # (storage name, shape, dtype) -> slots of that key.
        self._slots: dict[tuple[str, tuple[int, ...], np.dtype], list[_Slot]] = {}

    def clear(self) -> None:
        self._slots.clear()

    def stage(self, plan: WritePlan, sources: list[Any], *, copy_numpy: bool,
              defer_fill: bool = False,
              ) -> tuple[dict[str, Any], list[_Slot], dict[str, Callable[[], None]]]:
        """The flat ``{storage name: array}`` dict Orbax writes, the reused-buffer slots
        it fills (the caller marks them with the write's handle), and the packs left to
        fill. Packs are filled; numpy leaves are copied when the caller may change them
        during the write (``copy_numpy``); the jax.Arrays the plan names come to the host
        (a view, no copy, on CPU: they are immutable), the others stay as they are.

        ``defer_fill`` (a write that finishes before the caller gets its arrays back: a
        sync one): the packs are not filled here but by the functions returned, one per
        pack, which the native writer runs on its I/O threads just before writing each
        pack, so that filling one pack overlaps writing the others; on CPU the host views
        of the packed jax.Arrays are taken there too. With thousands of small leaves this
        is most of a save's cost per leaf."""
        used: list[_Slot] = []
        # Device arrays come to the host in one batch (transfers started together), not one
        # blocking transfer per leaf; on CPU this copies nothing.
        host = list(sources)
        views_later = defer_fill and jax.default_backend() == "cpu"
        fetch = plan.on_device
        if views_later:  # only the leaves written as arrays of their own, now
            own = {index for index, _ in plan.unpacked}
            fetch = [index for index in fetch if index in own]
        fetched = host_arrays([sources[index] for index in fetch])
        for index, array in zip(fetch, fetched, strict=True):
            host[index] = array
        arrays: dict[str, Any] = {}
        fills: dict[str, Callable[[], None]] = {}
        for name, pack in plan.packs.items():
            buffer = self._take(used, name, (pack_length(pack.size),), pack.dtype)
            if pack.size == 0:
                buffer[...] = 0  # the padding of a pack of zero-size leaves only
            members = [host[index] for index in pack.members]
            if defer_fill:
                fills[name] = functools.partial(_fill_from, buffer[:pack.size], pack, members,
                                                views_later)
            else:
                fill_pack(buffer[:pack.size], pack, members)
            arrays[name] = buffer
        for index, name in plan.unpacked:
            source = sources[index]
            if copy_numpy and isinstance(source, np.ndarray):  # the caller's, mutable
                copy = self._take(used, name, source.shape, source.dtype)
                np.copyto(copy, source)
                arrays[name] = copy
            else:
                arrays[name] = host[index]
        self._drop_idle(used)
        for slot in used:
            slot[1] = None  # a sync write is finished when write() returns
        return arrays, used, fills

    def _take(self, used: list[_Slot], name: str, shape: tuple[int, ...],
              dtype: np.dtype) -> np.ndarray:
        """A buffer for ``name`` that no write in flight uses (a new one if none is free)."""
        slots = self._slots.setdefault((name, shape, dtype), [])
        for slot in slots:
            if slot[1] is None or slot[1].done():
                break
        else:
            slot = [aligned_empty(shape, dtype), None]  # written without a copy
            if self._reuse:
                slots.append(slot)
        used.append(slot)
        slot[1] = _STAGING  # not reusable within this write either
        return slot[0]

    def _drop_idle(self, used: list[_Slot]) -> None:
        """Drop the buffers that neither this write nor one in flight uses: a layout that
        changed must not pin memory for the rest of the run."""
        taken = {id(slot) for slot in used}
        for key in list(self._slots):
            busy = [slot for slot in self._slots[key] if id(slot) in taken or
                    (slot[1] is not None and not slot[1].done())]
            if busy:
                self._slots[key] = busy
            else:
                del self._slots[key]


# ------------------------------------------------------------------------- Orbax writing


class _QuietOcdbtMerge(logging.Filter):
    """Drops Orbax's "Skipping merge of OCDBT checkpoints" line: we turn OCDBT off on purpose
    (measured faster here), so that message would print on every save and say nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT" not in record.getMessage()


_QUIET = _QuietOcdbtMerge()
for _logger_name in ("absl", "orbax"):
    if _QUIET not in logging.getLogger(_logger_name).filters:
        logging.getLogger(_logger_name).addFilter(_QUIET)


def type_handler_registry() -> Any:
    """Orbax's handlers, except that numpy arrays are not deep-copied again at save time.

    Orbax's NumpyHandler copies every numpy array it is given, in case the caller changes
    it during an async write. We hand it only arrays nobody changes meanwhile: packs and
    copies of the caller's numpy leaves made at staging time (async), views of immutable CPU
    jax.Arrays, or the caller's arrays during a write that finishes before write() returns
    (sync). A second copy would only double the staging time and the host memory.
    """
    import orbax.checkpoint as ocp

    return ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)),
    )


def create_directory(root: epath.Path, directory: str) -> None:
    """Create the checkpoint directory ``root``; refuse one that exists with content. One
    listing answers both (on an object store a request each)."""
    try:
        occupied = any(root.iterdir())
    except FileNotFoundError:
        occupied = False
    if occupied:
        raise CheckpointWriteError(
            f"checkpoint directory {directory} already exists and is not empty; the "
            "Orbax backend only writes into new directories. Fix: write to a fresh "
            "directory, or delete the stale one first.")
    root.mkdir(parents=True, exist_ok=True)


# ------------------------------------------------------------------------ native writing


def write_native(root: epath.Path | str, arrays: dict[str, np.ndarray], *,
                 pool: concurrent.futures.ThreadPoolExecutor, files: ArrayFiles,
                 fills: dict[str, Callable[[], None]] | None = None,
                 reuse: Reuse | None = None, tree_json: str | None = None) -> Written:
    """Write ``arrays`` as the Orbax checkpoint ``root/arrays`` through ``files``: the same
    files PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True) writes, the array files
    on ``pool``'s threads. Array files are durable on return; small metadata files are too
    where ``files`` says so (an object store), else they are left to the commit's fsync.
    Locally, like Orbax, writes under a temporary name renamed into place at the end, so
    that ``arrays/`` exists only complete (a failed write removes what it wrote); on an
    object store the objects go to their names and the commit marker vouches for them.
    Returns the manifest entries of the files written durably, relative to ``root``, and
    the directories below it whose names were made durable (``Written``).
    ``tree_json``: ``root``'s tree.json, written through ``files`` too (first).
    ``fills``: by storage name, what fills an array not filled yet (``HostBuffers.stage``
    with ``defer_fill``), run on the I/O thread that writes it, just before.
    ``reuse`` (an incremental write): each chunk file's content hash is computed on the I/O
    thread, the chunk files the base already holds are not written (``Reuse.consider``),
    and the entries of those written carry their hash (``xxh128``)."""
    state = os.fspath(root).rstrip('/')
    final = f"{state}/{ARRAYS_DIR}"
    started_ns = time.time_ns()
    tree = None if tree_json is None else files.write_small(f"{state}/{TREE_FILE}", tree_json)
    base = files.start(final)
    try:
        written = _write_native_into(base, final, arrays, started_ns, pool=pool, files=files,
                                     fills=fills or {}, reuse=reuse)
        files.finish(base, final)  # may fail too: a file's or directory's fsync
    except BaseException:
        files.abandon(base)
        raise
    if tree is not None:
        written.entries[TREE_FILE] = {"size": tree[0], default_algorithm(): tree[1]}
    return written


def _write_native_into(base: str, final: str, arrays: dict[str, np.ndarray],
                       started_ns: int, *, pool: concurrent.futures.ThreadPoolExecutor,
                       files: ArrayFiles, fills: dict[str, Callable[[], None]],
                       reuse: Reuse | None) -> Written:
    algorithm = default_algorithm()
    # Largest first, so that the threads finish together.
    jobs = sorted(arrays.items(), key=lambda job: -job[1].nbytes)
    known: dict[str, tuple[int, str]] = {}
    unstarted = [len(jobs)]
    unstarted_lock = threading.Lock()
    names = _DurableNames(files, base, len(jobs))

    def small(relative: str, text: str) -> None:
        entry = files.write_small(f"{base}/{relative}", text)
        if entry is not None:
            known[relative] = entry

    def orbax_metadata() -> None:
        # Sent as the last array's write begins, not after it ends: on an object store
        # each is a round trip that would otherwise follow the data (``write_small``
        # sends it alongside, and ``finish`` waits for it). The "commit" time Orbax
        # records is then that of the last array's start; the checkpoint's own commit is
        # the marker, later still.
        small("_METADATA", zarr_format.tree_metadata_text(list(arrays)))
        small("_CHECKPOINT_METADATA",
              zarr_format.checkpoint_metadata_text(started_ns, time.time_ns()))
        small("commit_success.txt", zarr_format.commit_success_text(final))
        # Every array's directory was made before the last one got here.
        names.complete([""])

    def write(job: tuple[str, np.ndarray]) -> tuple[str, int, str | None, str | None]:
        # Each array's directories and zarr.json are made on the I/O threads too: made on
        # the caller's thread, one mkdir or create per array delayed the first large
        # write by their sum.
        name, array = job
        relative = f"{name}/{zarr_format.chunk_relpath(array.ndim)}"
        chunk = f"{base}/{relative}"
        if reuse is not None:  # filled, placed and hashed ahead (see below)
            offset, digest, referred = decided[name].result()
        else:
            digest, referred = None, False
            fill = fills.get(name)
            if fill is not None:
                fill()
            # Large arrays start where their memory lines up with the file's blocks, and
            # are written from it without a copy (chunk_io.data_offset).
            offset = files.chunk_offset(array, base)
        files.make_parent(f"{base}/{name}/{ZARR_JSON}" if referred else chunk)
        small(f"{name}/{ZARR_JSON}",
              zarr_format.metadata_text(array.shape, array.dtype.name, offset))
        with unstarted_lock:
            unstarted[0] -= 1
            last = not unstarted[0]
        if last:
            orbax_metadata()
        own = _array_dirs(name, relative)
        if referred:
            names.complete(own[:1], job=name)  # it holds zarr.json only
            return relative, 0, None, digest
        size, crc = files.write_chunk(chunk, array, algorithm=algorithm, offset=offset,
                                      created=functools.partial(names.complete, own,
                                                                job=name))
        return relative, size, crc, digest

    # An incremental write decides each file on the hashing threads, in the order the I/O
    # threads take the files: while one file is written the next ones are hashed, so the
    # hash adds to a file's write only where the disk is faster than the hash.
    decided = {} if reuse is None else {
        name: reuse.ahead(_decide, name, array, reuse, fills.get(name),
                          files.chunk_offset, base) for name, array in jobs}
    try:
        results = list(pool.map(write, jobs))
    finally:
        for future in decided.values():
            future.cancel()
    if not jobs:
        orbax_metadata()
    return Written(entries_of(results, known, algorithm), names.durable())


class _DurableNames:
    """The directories of one native write whose names ``files`` makes durable, each told
    (``complete``) as soon as its last entry exists (an array's chunk file created, the
    last top-level entry written); once every one of the ``jobs`` arrays' files exists,
    ``files.names_made`` starts their syncs together, beside the last chunk writes.

    Concurrency contract: ``complete`` from any I/O thread; ``durable`` once they ended."""

    def __init__(self, files: ArrayFiles, base: str, jobs: int):
        self._files, self._base, self._jobs = files, base, jobs
        self._made: set[str] = set()
        self._done: set[str] = set()  # arrays whose files exist
        self._lock = threading.Lock()

    def complete(self, relatives: list[str], *, job: str | None = None) -> None:
        """These directories below the write's base ("": the base) have all their entries;
        ``job``: they are the directories of that array, whose files all exist now."""
        made = [relative for relative in relatives
                if self._files.entries_made(f"{self._base}/{relative}" if relative
                                            else self._base)]
        with self._lock:
            self._made.update(made)
            every = False
            if job is not None and job not in self._done:
                self._done.add(job)
                every = len(self._done) == self._jobs
        if every:  # the last top-level entries were written before the last array's file
            self._files.names_made()

    def durable(self) -> tuple[str, ...]:
        """The directories made durable, relative to the state directory (``arrays/...``)."""
        with self._lock:
            return tuple(sorted(ARRAYS_DIR if not relative else f"{ARRAYS_DIR}/{relative}"
                                for relative in self._made))


def _array_dirs(name: str, relative: str) -> list[str]:
    """The directories of array ``name`` whose chunk file is at ``relative`` (below
    ``arrays/``): its own down to the chunk file's, each complete once the chunk file
    exists (its own holds zarr.json and ``c``). None where the name is a path (never: storage
    names hold no "/"), since a directory above it could still gain entries."""
    if "/" in name:
        return []
    parts = relative.split("/")[:-1]
    return ["/".join(parts[:depth]) for depth in range(1, len(parts) + 1)]


def _decide(name: str, array: np.ndarray, reuse: Reuse, fill: Callable[[], None] | None,
            chunk_offset: Callable[[np.ndarray, str], int], base: str,
            ) -> tuple[int, str | None, bool]:
    """An incremental write's decision on the one chunk file of ``name``: the base's file
    when its arrays are the very ones an earlier write hashed (``Reuse.carry``: nothing
    filled, read or hashed), else filled (a pack filled late), placed
    (``chunk_io.data_offset``) and hashed (``Reuse.consider``)."""
    relative = f"{name}/{zarr_format.chunk_relpath(array.ndim)}"
    carried = reuse.carry(relative, array.nbytes)
    if carried is not None:
        return carried
    if fill is not None:
        fill()
    return reuse.consider(relative, array, chunk_offset(array, base))


def entries_of(results: list[tuple[str, int, str | None, str | None]],
             known: dict[str, tuple[int, str]], algorithm: str) -> dict[str, dict[str, Any]]:
    """The manifest entries of a native write, relative to the state directory: the chunk
    files written (``results``: path below ``arrays/``, size, checksum or None for a file
    referred to, content hash or None) and the small files of ``known``."""
    entries: dict[str, dict[str, Any]] = {}
    for relative, size, crc, digest in results:
        if crc is None:
            continue
        entry: dict[str, Any] = {"size": size, algorithm: crc}
        if digest is not None:
            entry[HASH_NAME] = digest
        entries[f"{ARRAYS_DIR}/{relative}"] = entry
    for relative, (size, crc) in known.items():
        entries[f"{ARRAYS_DIR}/{relative}"] = {"size": size, algorithm: crc}
    return entries


# --------------------------------------------------------------------------- small files


def write_small(path: str, text: str) -> None:
    """A small metadata file next to array files: no fsync of its own (the commit fsyncs
    every file of a checkpoint)."""
    with open(path, "x", encoding="utf-8") as stream:
        stream.write(text)


def write_durably(path: epath.Path, text: str) -> None:
    """Write a small file so that it is complete or absent after a crash (local paths:
    temp file, fsync, rename). Other file systems (gs://) get a plain write."""
    local = os.fspath(path)
    if "://" in local:
        path.write_text(text)
        return
    temporary = f"{local}.tmp"
    with open(temporary, "w", encoding="utf-8") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, local)
