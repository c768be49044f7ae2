"""The native writer of a run of several JAX processes: each process writes the chunk files
of the shards it owns, in the layout Orbax gives a sharded array.

Owns: which native write a save gets (:func:`native_writer`), what this process writes of
each stored array (:func:`stage_shards`) and writing it (:func:`write_shards`): a regular
chunk grid of the shard shape, one chunk file per shard, written by the holder of its
replica 0; arrays every process holds whole, every ``zarr.json`` and Orbax's metadata are
the primary's. Files are written in place; the primary's commit marker makes them count.
What it cannot store (dtypes ``chunk_io`` does not write, irregular shards) gives None, and
the backend hands the write to Orbax (a local root only).

Must not import: torch.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from jaxckpt.backends.orbax import zarr_format
from jaxckpt.backends.orbax.files import ArrayFiles
from jaxckpt.backends.orbax.incremental import Reuse
from jaxckpt.backends.orbax.process import barrier
from jaxckpt.backends.orbax.tree import ARRAYS_DIR, ZARR_JSON
from jaxckpt.backends.orbax.write import Written, entries_of, host_arrays, write_native
from jaxckpt.core.checksum import default_algorithm

__all__ = ["ShardedArray", "filling", "native_writer", "stage_shards", "write_shards",
           "writes_tree"]


@dataclass(frozen=True, slots=True)
class ShardedArray:
    """One stored array of a multi-process write, as this process sees it."""

    #: the global shape and dtype name (zarr.json's).
    shape: tuple[int, ...]
    dtype_name: str
    #: the chunk grid's chunk shape; None for a single-chunk array.
    chunk_shape: tuple[int, ...] | None
    #: what this process writes: (chunk path below the array's directory, host data).
    pieces: tuple[tuple[str, np.ndarray], ...]


def _grid_of(array: jax.Array) -> tuple[int, ...] | None:
    """The chunk shape of ``array``'s shards when they tile it on a regular grid (every
    shard a whole cell of the shard shape), else None."""
    shape = tuple(array.shape)
    chunk = tuple(array.sharding.shard_shape(shape))
    if 0 in chunk:
        return None
    for index in array.sharding.devices_indices_map(shape).values():
        for part, size, cell in zip(index, shape, chunk, strict=True):
            start, stop, step = part.indices(size)
            if step != 1 or start % cell or stop - start != cell:
                return None
    return chunk


def stage_shards(arrays: dict[str, Any], *, primary: bool) -> dict[str, ShardedArray] | None:
    """What this process writes of each array of ``arrays`` (host numpy arrays, or
    jax.Arrays sharded over processes), with the data on the host (on CPU a view of an
    immutable buffer, no copy); None when some array is not stored natively (the same
    answer on every process: it depends on dtypes, shapes and shardings only)."""
    staged: dict[str, ShardedArray] = {}
    pieces: dict[str, list[tuple[str, np.ndarray]]] = {}  # name -> this process's chunks
    owned: list[tuple[str, str, Any]] = []  # (name, chunk path, shard data on device)
    for name, array in arrays.items():
        dtype = np.dtype(array.dtype)
        if not zarr_format.supported(np.empty((1,) if array.size else (0,), dtype)):
            return None
        shape = tuple(array.shape)
        if isinstance(array, np.ndarray) or array.is_fully_addressable:
            # Every process holds it entirely: the primary's copy is stored, as one chunk.
            staged[name] = ShardedArray(shape, dtype.name, None, ())
            if primary and isinstance(array, np.ndarray):
                pieces[name] = [(zarr_format.chunk_relpath(len(shape)), array)]
            elif primary:
                owned.append((name, zarr_format.chunk_relpath(len(shape)), array))
            continue
        chunk = _grid_of(array)
        if chunk is None:
            return None
        for shard in array.addressable_shards:
            if shard.replica_id == 0:
                position = tuple(part.indices(size)[0] // cell for part, size, cell
                                 in zip(shard.index, shape, chunk, strict=True))
                owned.append((name, zarr_format.chunk_relpath(len(shape), position), shard.data))
        staged[name] = ShardedArray(shape, dtype.name, None if chunk == shape else chunk, ())
    # One batched transfer of every owned jax shard (on CPU: views, nothing copied).
    fetched = host_arrays([data for _, _, data in owned])
    for (name, relative, _), host in zip(owned, fetched, strict=True):
        pieces.setdefault(name, []).append((relative, np.ascontiguousarray(host)))
    for name, mine in pieces.items():
        entry = staged[name]
        staged[name] = ShardedArray(entry.shape, entry.dtype_name, entry.chunk_shape,
                                    tuple(mine))
    return staged


def write_shards(root: str, staged: dict[str, ShardedArray], *, primary: bool,
                 pool: concurrent.futures.ThreadPoolExecutor, files: ArrayFiles,
                 reuse: Reuse | None = None) -> dict[str, dict[str, Any]]:
    """Write this process's share of ``staged`` into ``root/arrays`` through ``files`` (in
    place), the chunk files durably on ``pool``'s threads; the primary also writes every
    zarr.json and Orbax's metadata files. Returns the manifest entries of the files written
    durably, relative to ``root``. ``reuse``: an incremental write, each process deciding
    for its own chunk files (``write.write_native``)."""
    final = f"{os.fspath(root).rstrip('/')}/{ARRAYS_DIR}"
    started_ns = time.time_ns()
    base = files.start(final)
    algorithm = default_algorithm()
    known: dict[str, tuple[int, str]] = {}

    def small(relative: str, text: str) -> None:
        path = f"{base}/{relative}"
        files.make_parent(path)
        entry = files.write_small(path, text)
        if entry is not None:
            known[relative] = entry

    def write(job: tuple[str, np.ndarray]) -> tuple[str, int, str | None, str | None]:
        relative, data = job
        digest, referred = None, False
        if reuse is not None:
            entry = staged[relative.split("/", 1)[0]]
            _, digest, referred = reuse.consider(relative, data, 0, zarr_json=(
                zarr_format.metadata_text(entry.shape, entry.dtype_name,
                                          chunk_shape=entry.chunk_shape)))
        if referred:
            return relative, 0, None, digest
        path = f"{base}/{relative}"
        files.make_parent(path)
        size, crc = files.write_chunk(path, data, algorithm=algorithm, offset=0)
        return relative, size, crc, digest

    jobs = sorted(((f"{name}/{relative}", data) for name, entry in staged.items()
                   for relative, data in entry.pieces), key=lambda job: -job[1].nbytes)
    results = list(pool.map(write, jobs))
    if primary:
        for name, entry in staged.items():
            small(f"{name}/{ZARR_JSON}", zarr_format.metadata_text(
                entry.shape, entry.dtype_name, chunk_shape=entry.chunk_shape))
        small("_METADATA", zarr_format.tree_metadata_text(list(staged)))
        small("_CHECKPOINT_METADATA",
              zarr_format.checkpoint_metadata_text(started_ns, time.time_ns()))
        small("commit_success.txt", zarr_format.commit_success_text(final))
    files.finish(base, final)
    return entries_of(results, known, algorithm)


_SHARED_WRITES = itertools.count()  # names this process's shared writes' barriers


def native_writer(files: ArrayFiles | None, arrays: dict[str, Any], *, primary: bool,
                  shared: bool, pool: Callable[[], concurrent.futures.ThreadPoolExecutor],
                  collective_timeout_s: float, reuse: Reuse | None = None,
                  ) -> Callable[[Any], Written] | None:
    """The native write of ``arrays`` into a checkpoint directory, as a function of that
    directory returning the manifest entries it made (``write_native``, or for a directory
    several processes write, ``write_shards`` after a barrier that every process reaches
    once the primary created the directory), or None when Orbax must write them.
    ``shared``: several processes write the directory. ``reuse``: an incremental write.

    Every process of a run calls this for the same writes in the same order (the
    backend's contract), so the barrier names agree."""
    if files is None:
        return None
    if not shared:
        if not all(isinstance(array, np.ndarray) and zarr_format.supported(array)
                   for array in arrays.values()):
            return None
        return functools.partial(_write_single, arrays=arrays, pool=pool, files=files,
                                 reuse=reuse)
    staged = stage_shards(arrays, primary=primary)
    if staged is None:
        return None
    name = f"jaxckpt.shards.{next(_SHARED_WRITES)}"

    def write(root: Any) -> Written:
        barrier(name, collective_timeout_s)  # the primary made the directory
        return Written(write_shards(os.fspath(root), staged, primary=primary, pool=pool(),
                                    files=files, reuse=reuse))

    return write


def filling(native: Callable[[Any], Written] | None,
            fills: dict[str, Callable[[], None]],
            ) -> Callable[[Any], Written] | None:
    """``native`` (from ``native_writer``, or None where Orbax writes) with the arrays of
    ``fills`` (by storage name: what fills an array not filled yet) filled: by a single
    process's native write on its I/O threads, each just before its array is written
    (``write_native``); otherwise here, now."""
    if not fills:
        return native
    if isinstance(native, functools.partial) and native.func is _write_single:
        return functools.partial(native, fills=fills)
    for fill in fills.values():
        fill()
    return native


def _write_single(root: Any, *, arrays: dict[str, np.ndarray],
                  pool: Callable[[], concurrent.futures.ThreadPoolExecutor],
                  files: ArrayFiles,
                  fills: dict[str, Callable[[], None]] | None = None,
                  reuse: Reuse | None = None, tree_json: str | None = None) -> Written:
    return write_native(root, arrays, pool=pool(), files=files, fills=fills, reuse=reuse,
                        tree_json=tree_json)


def writes_tree(native: Callable[[Any], Written] | None, tree_json: str | None,
                ) -> tuple[Callable[[Any], Written] | None, bool]:
    """``native`` writing ``tree_json`` as well (first, through its ``ArrayFiles``: its
    checksum and fsync are then the writer's, beside the arrays), and True, where it is
    one process's write of a directory of its own; else ``native`` as it is and False
    (the caller writes tree.json). ``tree_json`` None: False."""
    if (tree_json is not None and isinstance(native, functools.partial)
            and native.func is _write_single):
        return functools.partial(native, tree_json=tree_json), True
    return native, False
