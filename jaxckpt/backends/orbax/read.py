"""The Orbax backend's read path, from a parsed tree.json (``match``) on: the way back.

Owns: where each jax leaf goes (:class:`Shardings`; a typed key's data placed with the key's
sharding), the restore arguments handed to Orbax, the scope of a partial read's deferred
checks (``limit_claims``), the native reader (``read_native``: ``chunk_io`` reads the
arrays in ``zarr_format``'s layout, checking the deferred checksums of the files as it
reads them: ``deferred_checks.DeferredChecks``; the packs' reads begin while ``like`` is
matched: ``PackReads``), and turning what was read into ``like``'s leaves
(``Unpacker``: packed leaves cut out of their packs as each pack arrives, arrays stored as
bytes viewed as their dtype; ``to_like_leaves``: keys wrapped, numpy and Python scalars
converted).

Which reader runs is the backend's decision (``backend``). Must not import: torch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from math import prod
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from etils import epath

from jaxckpt.backends.orbax import chunk_io, zarr_format
from jaxckpt.backends.orbax.files import ReadableFiles
from jaxckpt.backends.orbax.match import Target
from jaxckpt.backends.orbax.place import default_sharding, owned_on_cpu, place
from jaxckpt.backends.orbax.tree import (
    ARRAYS_DIR,
    STORAGE_NAME,
    TREE_FILE,
    ZARR_JSON,
    SavedLeaf,
    from_bytes,
)
from jaxckpt.core.checksum import extend
from jaxckpt.errors import CheckpointCorruptError
from jaxckpt.storage.buffers import aligned_empty

if TYPE_CHECKING:
    from jaxckpt.commit.deferred_checks import DeferredChecks

__all__ = ["TO_HOST", "PackReads", "Shardings", "ToDevice", "arrays_dir", "restore_args_for",
           "limit_claims", "restore_request", "read_native", "Unpacker", "to_like_leaves"]


def key_data_sharding(sharding: jax.sharding.Sharding, key_ndim: int,
                      extra_ndim: int) -> jax.sharding.Sharding | None:
    """The sharding of ``key_data`` for keys placed with ``sharding``: the key's layout plus
    unsharded trailing dims. None where we cannot derive it (then we restore and move)."""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (key_ndim - len(sharding.spec) + extra_ndim)
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec),
                                          memory_kind=sharding.memory_kind)
    return None


class Shardings:
    """Where the stored data of each jax leaf goes: the like leaf's sharding (the default
    device's where it has none), for a typed key the sharding of its ``key_data``; and the
    keys whose ``key_data`` sharding cannot be derived (restored onto the default device,
    then moved onto their sharding: ``move_after``). Used by one thread, for one read."""

    def __init__(self) -> None:
        self._default: jax.sharding.Sharding | None = None
        self.move_after: dict[str, jax.sharding.Sharding] = {}

    def default(self) -> jax.sharding.Sharding:
        if self._default is None:
            self._default = default_sharding()
        return self._default

    def of(self, path: str, target: Target, entry: SavedLeaf) -> jax.sharding.Sharding:
        """Where the stored data of the jax leaf ``path`` goes."""
        sharding = target.sharding
        if sharding is None:
            sharding = self.default()
        if entry.kind != "key":
            return sharding
        data_sharding = key_data_sharding(sharding, len(target.shape),
                                          len(entry.stored_shape) - len(target.shape))
        if data_sharding is None:
            self.move_after[path] = sharding
            data_sharding = self.default()
        return data_sharding


@dataclasses.dataclass(frozen=True, slots=True)
class ToDevice:
    """A stored array to read and place on ``sharding`` (Orbax's ``ArrayRestoreArgs``
    when Orbax reads it: ``restore_request``)."""

    sharding: jax.sharding.Sharding
    global_shape: tuple[int, ...]
    dtype: np.dtype


#: A stored array read into host memory and left there (Orbax's ``RestoreArgs`` with a
#: numpy restore type).
TO_HOST = "host"


def restore_args_for(targets: list[tuple[str, Target]], saved: dict[str, SavedLeaf],
                     shardings: Shardings) -> tuple[dict[str, Any],
                                                    dict[str, jax.sharding.Sharding]]:
    """What to ask Orbax (or chunk_io) for: restore args by storage name (a pack once), and
    where each jax leaf that is not packed goes (``shardings.of``). Packed leaves cost one
    look-up each here: where they go is worked out by ``Unpacker.prepare``, while the
    packs are read."""
    restore_args: dict[str, Any] = {}
    placements: dict[str, jax.sharding.Sharding] = {}
    to_host = TO_HOST
    for path, target in targets:
        entry = saved[path]
        if entry.offset is not None:  # packed: its pack comes to the host, read once
            if entry.name not in restore_args:
                restore_args[entry.name] = to_host
            continue
        # Arrays stored as bytes come to the host first too, and are viewed as their
        # dtype there; numpy and Python targets stay there.
        if entry.as_bytes or target.target != "jax":
            restore_args[entry.name] = to_host
        if target.target != "jax":
            continue
        sharding = placements[path] = shardings.of(path, target, entry)
        if not entry.as_bytes:
            restore_args[entry.name] = ToDevice(sharding=sharding,
                                                global_shape=tuple(entry.stored_shape),
                                                dtype=entry.stored_dtype)
    return restore_args, placements


def arrays_dir(root: epath.Path, directory: str) -> epath.Path:
    """The checkpoint's ``arrays/`` directory; CheckpointCorruptError when it is missing."""
    found = root / ARRAYS_DIR
    if not found.exists():
        raise CheckpointCorruptError(
            f"checkpoint {directory} has {TREE_FILE} but no {ARRAYS_DIR}/ directory: "
            "its write did not finish. Fix: restore an older, committed checkpoint.")
    return found


def limit_claims(claims: DeferredChecks | None, directory: str, arrays: epath.Path | None,
                 restore_args: dict[str, Any], *, partial: bool) -> None:
    """A partial read's scope: the deferred checks of ``directory`` are limited to the
    array directories it reads (``arrays`` / each name of ``restore_args``; none when
    ``arrays`` is None), so that files nothing is restored from are not read to be
    checked. A packed leaf's whole pack is read (a few small leaves share one file), and
    is checked. With OCDBT, whose data files each hold many arrays, nothing is withdrawn:
    every data file is checked."""
    if not partial or claims is None:
        return
    # Object stores hold only what the native writer wrote (never OCDBT), and Orbax's own
    # check cannot open a URL (it would want s3fs).
    if arrays is not None and "://" not in os.fspath(arrays):
        import orbax.checkpoint as ocp

        if ocp.type_handlers.is_ocdbt_checkpoint(arrays):
            return
    claims.limit(directory, [] if arrays is None
                 else [os.fspath(arrays / name) for name in restore_args])


@contextlib.contextmanager
def unreadable_is_corrupt(directory: str) -> Iterator[None]:
    """Any failure of the block but running out of memory (or an interrupt) becomes a
    ``CheckpointCorruptError``: Orbax and tensorstore report damaged metadata or chunks with
    their own types (ValueError, UnicodeDecodeError, DATA_LOSS...), and to the caller this is
    one thing, a checkpoint that cannot be read, so recovery can fall back."""
    try:
        yield
    except (CheckpointCorruptError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as error:
        raise CheckpointCorruptError(
            f"{directory}: array data cannot be read ({type(error).__name__}: "
            f"{error}). The checkpoint is damaged; restore another one "
            f"(recover() falls back to the previous valid checkpoint).") from error


def restore_request(restore_args: dict[str, Any], partial: bool) -> Any:
    """Orbax's restore arguments for ``restore_args``; with ``partial`` the saved arrays
    outside them are left unread (Orbax otherwise insists on the whole saved tree). Orbax
    is imported here: a native read never needs it."""
    import orbax.checkpoint as ocp

    asked = {name: ocp.ArrayRestoreArgs(sharding=args.sharding, global_shape=args.global_shape,
                                        dtype=args.dtype)
             if isinstance(args, ToDevice) else ocp.RestoreArgs(restore_type=np.ndarray)
             for name, args in restore_args.items()}
    if not partial:
        return ocp.args.PyTreeRestore(restore_args=asked)
    return ocp.args.PyTreeRestore(item=dict.fromkeys(asked, 0), restore_args=asked,
                                  partial_restore=True)


_ChunkJob = tuple[str, str, tuple[int, ...], np.dtype, int, "tuple[slice, ...] | None"]


def _chunk_jobs(base: str, restore_args: dict[str, Any], parsed_metadata: list[Any],
                ) -> tuple[list[_ChunkJob], dict[str, np.ndarray]] | None:
    """One read job per chunk file of the arrays ``restore_args`` asks for: (name, file,
    chunk shape, dtype, offset, the slices of the array it fills, None for a single-chunk
    array, read as it is), and the buffers of the multi-chunk arrays, which their jobs
    fill; None when an array's zarr.json (``parsed_metadata``, ``zarr_format.parse_grid`` of
    each) is not in ``zarr_format``'s layout or disagrees with tree.json."""
    jobs: list[_ChunkJob] = []
    grids: dict[str, np.ndarray] = {}
    for (name, args), parsed in zip(restore_args.items(), parsed_metadata, strict=True):
        if parsed is None:
            return None
        shape, dtype, offset, chunk_shape = parsed
        if isinstance(args, ToDevice) and (
                tuple(args.global_shape) != shape or np.dtype(args.dtype) != dtype):
            return None
        if chunk_shape == shape:
            jobs.append((name, f"{base}/{name}/{zarr_format.chunk_relpath(len(shape))}", shape,
                         dtype, offset, None))
            continue
        grids[name] = aligned_empty(shape, dtype, fresh=True)
        wanted = _addressable_parts(args, shape)
        jobs.extend((name, f"{base}/{name}/{zarr_format.chunk_relpath(len(shape), index)}",
                     chunk_shape, dtype, 0, slices)
                    for index, slices in zarr_format.chunk_grid(shape, chunk_shape)
                    if wanted is None or any(_overlaps(slices, part, shape) for part in wanted))
    return jobs, grids


def _addressable_parts(args: Any, shape: tuple[int, ...]) -> list[tuple[slice, ...]] | None:
    """The parts of an array this process places on its devices when ``args`` spread it
    over several processes (only the chunks under them are read), else None (all)."""
    sharding = getattr(args, "sharding", None)
    if sharding is None or sharding.is_fully_addressable:
        return None
    return list(sharding.addressable_devices_indices_map(shape).values())


def _overlaps(chunk: tuple[slice, ...], part: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    for cell, piece, size in zip(chunk, part, shape, strict=True):
        start, stop, _ = piece.indices(size)
        if cell.start >= stop or start >= cell.stop:
            return False
    return True


def _chunk_reader(files: ReadableFiles, restore_args: dict[str, Any],
                  grids: dict[str, np.ndarray], expected: dict[str, str],
                  claims: DeferredChecks | None) -> Callable[[_ChunkJob], tuple[str, Any]]:
    """What an I/O thread does with one read job of ``read_native``: read the chunk file,
    settle its deferred check (``expected``: the claimed files' algorithms), check its
    shard index; return (name, the array), or (name, None) for a chunk of a grid, which
    fills its part of ``grids[name]``.

    The array of a single-chunk file bound for a CPU device of this process is read from a
    local disk into memory XLA allocated for it (``place.owned_on_cpu``), a jax.Array that
    a donated step can reuse; the others into a host buffer (placed by ``_placed``)."""
    into: Callable[..., tuple[np.ndarray, str | None]] | None = getattr(
        files, "read_chunk_into", None)

    def read(job: _ChunkJob) -> tuple[str, Any]:
        name, file, shape, dtype, offset, slices = job
        nbytes = prod(shape) * dtype.itemsize
        algorithm = expected.get(file)
        args = restore_args[name]
        owned = (owned_on_cpu(shape, dtype, args.sharding)
                 if into is not None and slices is None and isinstance(args, ToDevice)
                 else None)
        if owned is not None and into is not None:
            index, checksum = into(file, owned[1], algorithm=algorithm, offset=offset)
            if claims is not None and checksum is not None:
                claims.settle(file, checksum)
            chunk_io.check_index(file, index, nbytes, offset)
            return name, owned[0]
        content, checksum = files.read_chunk(file, nbytes, algorithm=algorithm, offset=offset)
        if claims is not None and checksum is not None:  # checksummed: ``algorithm`` given
            claims.settle(file, checksum)
        data = chunk_io.array_bytes(file, content, nbytes, offset).view(dtype).reshape(shape)
        if slices is None:
            return name, data
        grids[name][slices] = data
        return name, None

    return read


def read_native(base: str, restore_args: dict[str, Any], claims: DeferredChecks | None, *,
                pool: concurrent.futures.ThreadPoolExecutor, files: ReadableFiles,
                on_host: Callable[[str, np.ndarray], None] | None = None,
                meanwhile: Callable[[], None] | None = None,
                packs: PackReads | None = None) -> dict[str, Any] | None:
    """What Orbax's restore returns for ``restore_args``, read through ``files`` (chunk_io
    with O_DIRECT on a local disk, GETs on an object store) on ``pool``'s threads; None
    (before any bulk read) when some array is not stored in ``zarr_format``'s layout or not as
    tree.json says (Orbax then reads everything and reports what is wrong).

    Claims the deferred checks of the files it reads (``claims``: a restore's deferred
    checksums) and closes the claims, then reads the files on the I/O threads
    (``_chunk_reader``), checksumming the claimed ones as they are read: on a CPU device
    straight into memory XLA allocated, elsewhere into aligned host buffers. An array
    stored as a grid of chunks (written by several processes) is assembled from its chunk
    files into one buffer; where the target spreads it over several processes, only the
    chunks under this process's devices are read.

    ``on_host(name, array)`` is called, on the calling thread, for each array restored to
    the host (a pack) as soon as it is read, while the rest is still being read: the
    backend cuts and places a pack's leaves meanwhile (``Unpacker.take``), in the order
    the reads finish. ``meanwhile()`` is called, on the calling thread, once every read is
    queued and before the first ``on_host``: work of the caller's that needs no data
    (``Unpacker.prepare``) runs while the files are read.

    ``packs``: the packs' reads started while ``like`` was matched (:class:`PackReads`);
    each is taken over as it is, its claim settled before its bytes are used.
    """
    if not all(STORAGE_NAME.match(name) for name in restore_args):
        return None

    def metadata(name: str) -> tuple[tuple[int, ...], np.dtype, int, tuple[int, ...]] | None:
        try:
            return zarr_format.parse_grid(files.read_small(f"{base}/{name}/{ZARR_JSON}", 1 << 16))
        except OSError:
            return None

    # On the I/O threads: on an object store each is a round trip.
    planned = _chunk_jobs(base, restore_args, list(pool.map(metadata, restore_args)))
    if planned is None:
        return None
    jobs, grids = planned
    expected: dict[str, str] = {}
    if claims is not None:
        for _, file, *_ in jobs:
            claimed = claims.claim(file)
            if claimed is not None:
                expected[file] = claimed[0]
        claims.close()

    # Local files: the arrays bound for a CPU device are read into XLA's own memory.
    read = _chunk_reader(files, restore_args, grids, expected, claims)
    jobs.sort(key=lambda job: -prod(job[2]) * job[3].itemsize)  # largest first
    arrays: dict[str, Any] = dict(grids)
    taken = {} if packs is None else packs.futures  # the packs' reads, begun already
    early = {taken[job[0]]: job for job in jobs if job[0] in taken and job[5] is None}
    futures = [*early, *(pool.submit(read, job) for job in jobs if job not in early.values())]
    try:
        if meanwhile is not None:
            meanwhile()
        # In the order the reads finish, not the order they started: a pack read early is
        # unpacked at once, not after the packs ahead of it in the queue.
        for future in concurrent.futures.as_completed(futures):
            if future in early:
                name, data = _adopt(early[future], future, read, expected, claims)
            else:
                name, data = future.result()
            if data is not None:
                arrays[name] = data
                if on_host is not None and not isinstance(restore_args[name], ToDevice):
                    on_host(name, data)
    finally:
        for future in futures:  # after a failure: the reads not started yet never start
            future.cancel()
    return _placed(restore_args, arrays)


def _adopt(job: _ChunkJob, future: concurrent.futures.Future[Any],
           read: Callable[[_ChunkJob], tuple[str, Any]], expected: dict[str, str],
           claims: DeferredChecks | None) -> tuple[str, Any]:
    """What ``read(job)`` returns, from a pack's read that :class:`PackReads` started: the
    same file, offset and size, its checksum with the claimed algorithm settled before its
    bytes are used. Where it read something else, or failed, ``job`` is read again here
    (and fails as it would have)."""
    name, file, shape, dtype, offset, _ = job
    try:
        got = future.result()
    except Exception:
        got = None
    if got is None or got[:4] != (file, shape, dtype, offset):
        return read(job)
    _, _, _, _, content, algorithm, checksum = got
    wanted = expected.get(file)
    if wanted is not None and claims is not None:
        if algorithm != wanted or checksum is None:  # not offered yet when it was read
            checksum = f"{extend(wanted, 0, content):08x}"
        claims.settle(file, checksum)
    nbytes = prod(shape) * dtype.itemsize
    return name, chunk_io.array_bytes(file, content, nbytes, offset).view(dtype).reshape(shape)


class PackReads:
    """The reads of a checkpoint's packs (the small leaves' files, never an unpacked
    array's), started as soon as its tree.json is parsed so that they go on while ``like``
    is matched; ``read_native`` takes them over once it matches (``_adopt``). A read
    changes nothing: after a mismatch, or any failure, :meth:`close` cancels the reads not
    started, waits for those under way and drops what they read.

    Each is a pack's zarr.json and its one chunk file, checksummed as it is read with the
    algorithm of the file's deferred check where one is offered (``claims.offered``); the
    claim itself is made and settled by ``read_native``, as for every file it reads."""

    def __init__(self, base: str, files: ReadableFiles | None,
                 pool: Callable[[], concurrent.futures.ThreadPoolExecutor],
                 claims: DeferredChecks | None, *, early: bool = True) -> None:
        """Args:
            base: the checkpoint's ``arrays/`` directory (a path or URL).
            files: what reads the files (``ReadableFiles``); None where Orbax reads them.
            pool: the I/O threads, asked for once there is something to read.
            claims: the restore's deferred checks, or None.
            early: False reads nothing before ``like`` matches (a partial read, whose
                packs depend on ``like``).
        """
        self.files = files
        self._base, self._pool, self._claims, self._early = base, pool, claims, early
        #: The read of each pack by storage name, once started.
        self.futures: dict[str, concurrent.futures.Future[Any]] = {}

    def __enter__(self) -> PackReads:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self, saved: dict[str, SavedLeaf]) -> None:
        """Start reading the packs of ``saved`` (tree.json's leaves by tree path)."""
        names = sorted({entry.name for entry in saved.values() if entry.offset is not None})
        if self.files is None or not self._early or not names:
            return
        pool = self._pool()
        self.futures.update(
            (name, pool.submit(self._read, self._base, name, self.files, self._claims))
            for name in names if STORAGE_NAME.match(name))

    @staticmethod
    def _read(base: str, name: str, files: ReadableFiles,
              claims: DeferredChecks | None) -> tuple[Any, ...] | None:
        try:
            parsed = zarr_format.parse_grid(files.read_small(f"{base}/{name}/{ZARR_JSON}",
                                                             1 << 16))
        except OSError:
            return None
        if parsed is None or parsed[3] != parsed[0]:  # not one chunk: read_native's to read
            return None
        shape, dtype, offset, _ = parsed
        file = f"{base}/{name}/{zarr_format.chunk_relpath(len(shape))}"
        algorithm = None if claims is None else claims.offered(file)
        content, checksum = files.read_chunk(file, prod(shape) * dtype.itemsize,
                                             algorithm=algorithm, offset=offset)
        return file, shape, dtype, offset, content, algorithm, checksum

    def close(self) -> None:
        """Cancel the reads not started, wait for the others, drop what they read."""
        for future in self.futures.values():
            future.cancel()
        concurrent.futures.wait(list(self.futures.values()))
        self.futures.clear()


def _placed(restore_args: dict[str, Any], arrays: dict[str, Any]) -> dict[str, Any]:
    """What ``read_native`` returns from the host arrays it read: each array that
    ``restore_args`` sends to devices placed there, the others as they are."""
    restored: dict[str, Any] = {}
    placed: list[tuple[str, np.ndarray, Any]] = []
    for name, args in restore_args.items():
        if isinstance(arrays[name], jax.Array):  # read into XLA's memory: placed already
            restored[name] = arrays[name]
        elif isinstance(args, ToDevice):
            placed.append((name, arrays[name], args.sharding))
        else:
            restored[name] = arrays[name]
    spread = [entry for entry in placed if not entry[2].is_fully_addressable]
    placed = [entry for entry in placed if entry[2].is_fully_addressable]
    for name, array, sharding in spread:  # only this process's parts were read
        restored[name] = jax.make_array_from_callback(array.shape, sharding, array.__getitem__)
    if placed:
        # One batch; on CPU jax adopts the aligned buffers as they are.
        values = place([array for _, array, _ in placed],
                       [sharding for _, _, sharding in placed])
        restored.update((name, value) for (name, _, _), value in zip(placed, values, strict=True))
    return restored


class Unpacker:
    """The stored data of every target of one read, gathered pack by pack.

    ``prepare`` works out, for each packed leaf, its pack and where it goes; it needs no
    data, and runs while the packs are read (``read_native``'s ``meanwhile``). A pack's
    leaves are cut out of it and placed on their devices as soon as the pack is read
    (``take``, called by ``read_native`` while the other packs are still being read), so
    that this per-leaf work overlaps the reading instead of following it; ``finish`` does
    the rest (packs not taken yet, leaves stored as arrays of their own).
    Concurrency contract: used by one thread (the one that reads), for one read.
    """

    def __init__(self, directory: str, targets: list[tuple[str, Target]],
                 saved: dict[str, SavedLeaf], placements: dict[str, jax.sharding.Sharding],
                 shardings: Shardings):
        self._directory = directory
        self._targets = targets
        self._saved = saved
        self._placements = placements  # of the leaves that are not packed
        self._shardings = shardings
        self._values: list[Any] = [None] * len(targets)
        # Pack name -> (slot, path, target, saved leaf, offset, where it goes: None for a
        # host target, whether it is the usual leaf: see _prepare) of each leaf in it, in
        # tree order; filled by prepare.
        self._members: dict[str, list[tuple[int, str, Target, SavedLeaf, int,
                                            jax.sharding.Sharding | None, bool]]] = {}
        self.converted: list[int] = []  # slots to_like_leaves converts (keys, host targets)
        self._prepared = False
        self._taken: set[str] = set()
        # Whether each sharding is held by this process alone, asked once per sharding (a
        # state's leaves share a few; asking costs microseconds).
        self._local: dict[jax.sharding.Sharding, bool] = {}
        self._last_local: jax.sharding.Sharding | None = None  # the last one held alone
        self._failed: Exception | None = None  # what take() could not do (see take)

    def prepare(self) -> None:
        """Each packed leaf's pack and placement, and which leaves ``to_like_leaves``
        converts. Once; a failure is kept and raised by ``finish`` (like ``take``'s)."""
        if self._prepared or self._failed is not None:
            return
        self._prepared = True
        try:
            self._prepare()
        except Exception as error:  # noqa: BLE001 - raised by finish, outside the read
            self._failed = error

    def _prepare(self) -> None:
        saved, members, converted = self._saved, self._members, self.converted
        shardings, local = self._shardings, self._local
        # Equal shardings made one object, so that ``is`` finds them alike below and in
        # ``_orbax_place`` (a sharding's hash and equality are Python code).
        same: dict[jax.sharding.Sharding, jax.sharding.Sharding] = {}
        default = last = None
        last_local = False
        for slot, (path, target) in enumerate(self._targets):
            entry = saved[path]
            jax_target = target.target == "jax"
            if entry.kind == "key" or not jax_target:
                converted.append(slot)
            offset = entry.offset
            if offset is None:
                continue
            sharding = None
            usual = False  # an array of its own dtype going to this process's devices
            if jax_target:
                # The usual leaf spelled out (this loop runs once per leaf).
                sharding = target.sharding
                if entry.kind == "key":
                    sharding = shardings.of(path, target, entry)
                elif sharding is None:
                    sharding = default = default or shardings.default()
                if sharding is not last:
                    sharding = same.setdefault(sharding, sharding)
                    last = sharding
                    last_local = local.get(sharding)  # type: ignore[assignment]
                    if last_local is None:
                        last_local = local[sharding] = sharding.is_fully_addressable
                usual = last_local and entry.kind == "array" and entry.data_dtype is None
            name = entry.name
            if name not in members:
                members[name] = []
            members[name].append((slot, path, target, entry, offset, sharding, usual))

    def take(self, name: str, pack: Any) -> None:
        """Cut the leaves of the pack ``name`` out of ``pack`` (as read) and place them;
        nothing for an array that is not a pack of this read, or one already taken.

        Runs inside the read, where any failure means a damaged checkpoint: a failure here
        (placing on a device that is out of memory, say) is kept and raised by ``finish``
        instead, as it is, so that a valid checkpoint is never taken for a damaged one."""
        self.prepare()
        if self._failed is not None:
            return
        try:
            self._take(name, pack)
        except Exception as error:  # noqa: BLE001 - raised by finish, outside the read
            self._failed = error

    def _take(self, name: str, pack: Any) -> None:
        members = self._members.get(name)
        if members is None or name in self._taken:
            return
        self._taken.add(name)
        directory = self._directory
        if np.ndim(pack) != 1:
            raise CheckpointCorruptError(
                f"{directory}/{ARRAYS_DIR}/{name} has shape {np.shape(pack)}, not the "
                "1-D pack tree.json describes. Fix: restore an older checkpoint.")
        found = (pack, pack.shape[0], pack.dtype.name)
        # (slot, data, sharding) of each leaf placed in this pack's batch.
        batch: list[tuple[int, np.ndarray, jax.sharding.Sharding]] = []
        add = batch.append
        length, dtype = found[1], found[2]
        for slot, path, target, entry, offset, sharding, usual in members:
            # The usual leaf first, spelled out (this loop runs once per leaf): an array of
            # the pack's dtype going to a sharding of this process's alone.
            if usual and entry.dtype == dtype:
                shape = entry.shape
                count = prod(shape)
                if offset + count <= length and sharding is not None:  # (it is: usual)
                    add((slot, pack[offset:offset + count].reshape(shape), sharding))
                    continue
            as_bytes = entry.data_dtype is not None and entry.kind == "array"
            data = _cut(directory, path, entry, offset, found, as_bytes)
            if as_bytes:
                data = from_bytes(data, entry)
            value = self._host_value(target, data, sharding)
            if value is None and sharding is not None:
                add((slot, data, sharding))
            self._values[slot] = value
        if not batch:
            return
        # One batch per pack (``_orbax_place``: the cheap way where it applies). On CPU jax
        # adopts each leaf's memory in its pack (aligned by the writer) as it is, no copy:
        # a pack's memory is then freed once the last of its leaves is.
        slots, data_list, sharding_list = zip(*batch, strict=True)
        values = self._values
        for slot, value in zip(slots, place(list(data_list), list(sharding_list)),
                               strict=True):
            values[slot] = value

    def _host_value(self, target: Target, data: np.ndarray,
                    sharding: jax.sharding.Sharding | None) -> Any:
        """What a leaf cut or viewed on the host becomes, but for jax leaves this process
        places alone (None: the caller places those, on ``sharding``, in one batch)."""
        if target.target != "jax" or sharding is None:
            # A copy: a view would keep the whole pack alive as long as this leaf.
            return data.copy() if target.target == "numpy" else data
        if sharding is self._last_local:  # most leaves share one sharding object
            return None
        addressable = self._local.get(sharding)
        if addressable is None:
            addressable = self._local[sharding] = sharding.is_fully_addressable
        if addressable:
            self._last_local = sharding
            return None
        # Spans processes: every process holds the pack, each places its shards.
        return jax.make_array_from_callback(data.shape, sharding, data.__getitem__)

    def finish(self, restored: dict[str, Any]) -> list[Any]:
        """The stored data of every target, in order, from everything read (``restored``,
        by storage name): unpacked leaves as Orbax restored them; packed ones cut out of
        their pack, arrays stored as bytes viewed as their dtype, and those two, for jax
        targets, placed on their sharding."""
        self.prepare()
        if self._failed is not None:
            raise self._failed
        for name in self._members:
            if name not in self._taken:
                self._take(name, restored[name])
        values, directory = self._values, self._directory
        batch_slots: list[int] = []
        batch_data: list[np.ndarray] = []
        batch_shardings: list[jax.sharding.Sharding] = []
        for slot, (path, target) in enumerate(self._targets):
            entry = self._saved[path]
            if entry.offset is not None:
                continue
            if not entry.as_bytes:
                values[slot] = restored[entry.name]
                continue
            data = np.asarray(restored[entry.name])
            if data.shape != entry.stored_shape or data.dtype != entry.stored_dtype:
                raise CheckpointCorruptError(
                    f"{directory}/{ARRAYS_DIR}/{entry.name} holds {data.shape} "
                    f"{data.dtype}, not the bytes of leaf {path} ({entry.stored_shape} "
                    "uint8). Fix: restore an older checkpoint.")
            data = from_bytes(data, entry)
            sharding = self._placements.get(path)
            values[slot] = self._host_value(target, data, sharding)
            if values[slot] is None and sharding is not None:
                batch_slots.append(slot)
                batch_data.append(data)
                batch_shardings.append(sharding)
        for slot, value in zip(batch_slots, place(batch_data, batch_shardings), strict=True):
            values[slot] = value
        return values


def _cut(directory: str, path: str, entry: SavedLeaf, offset: int,
         pack: tuple[np.ndarray, int, str] | None, as_bytes: bool) -> np.ndarray:
    """The stored data of the packed leaf ``entry`` (a view into its pack: the array, its
    length and dtype name as ``Unpacker`` found them)."""
    if entry.kind == "key" or as_bytes:
        shape, dtype = tuple(entry.data_shape or ()), entry.data_dtype
    else:
        shape, dtype = entry.shape, entry.dtype
    count = prod(shape)
    if pack is None or offset + count > pack[1] or (
            pack[2] != dtype and pack[0].dtype != np.dtype(dtype)):
        found = ("it was not read" if pack is None else
                 f"elements {offset}..{offset + count} of {pack[1]}, dtype {dtype} vs "
                 f"{pack[2]}")
        raise CheckpointCorruptError(
            f"{directory}: leaf {path} lies outside its pack {entry.name} ({found}). "
            "Fix: restore an older checkpoint.")
    return pack[0][offset:offset + count].reshape(shape)


def to_like_leaves(targets: list[tuple[str, Target]], saved: dict[str, SavedLeaf],
                   values: list[Any], move_after: dict[str, jax.sharding.Sharding],
                   converted: list[int] | None = None) -> list[Any]:
    """The leaves of ``like``, in order, from the stored data of each target (``Unpacker``):
    keys wrapped (and moved where their data's sharding could not be derived), numpy and
    Python targets converted to their types. ``converted``: the only slots that may need
    it (``Unpacker.converted``); the others are ``values``' as they are. ``values`` is
    changed in place and returned."""
    for slot in range(len(targets)) if converted is None else converted:
        path, target = targets[slot]
        entry, value = saved[path], values[slot]
        if entry.kind == "key":
            value = jax.random.wrap_key_data(value, impl=entry.impl)
            if path in move_after:
                value = jax.device_put(value, move_after[path])
        elif target.target == "numpy":
            value = np.asarray(value)
        elif target.target == "numpy_scalar":
            value = np.asarray(value, dtype=target.dtype)[()]
        elif target.target == "python":
            value = target.dtype(np.asarray(value).item())
        values[slot] = value
    return values
