"""The JAX/Flax backend: pytrees of arrays stored as Orbax checkpoints (``OrbaxBackend``).

Owns: :class:`OrbaxBackend`, the :class:`jaxckpt.backends.base.Backend` for JAX pytrees (dicts,
lists, tuples, NamedTuples, ``flax.nnx.State``, optax states, live NNX objects): which writer
and reader run, on which thread, and what lives between saves (the write plans of the last
few layouts, host buffers, Orbax checkpointers, thread pools). Its parts, one concern each:
``options``, ``tree`` (tree.json), ``plan`` (write plans, packs), ``write``, ``shards`` (the
write of several processes), ``match`` (``like`` against tree.json), ``read``, ``place``,
``process``, ``files`` and ``locations`` (where the files live), ``zarr_format`` and
``chunk_io`` (Orbax's files, our I/O), ``nnx_live``.

A written directory holds ``tree.json`` (ours: every leaf's path, shape, dtype and kind) and
``arrays/``, an Orbax PyTreeCheckpointHandler checkpoint of the flat dict of stored arrays,
written natively (``native_io``) where it can be and by Orbax elsewhere. How a write and a
read run: docs/architecture.md; why: docs/design.md and docs/performance.md.

Must not import: torch, torch_bridge (a JAX run must never pay for, or depend on, PyTorch).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import importlib.metadata
import os
import threading
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from jaxckpt.core.extras import requires_extra

with requires_extra("jax", "jaxckpt's Orbax backend (a CheckpointManager without backend=)"):
    import jax
    import orbax
    from etils import epath

    del orbax  # imported whole only where Orbax writes or reads (``_orbax``)

from jaxckpt.backends.base import BackendFeatures, IncrementalBase
from jaxckpt.backends.orbax import (
    locations as orbax_remote,
    match as orbax_match,
    nnx_live,
    process as orbax_process,
    read as orbax_read,
    shards as orbax_shards,
)
from jaxckpt.backends.orbax.files import WRITTEN, ArrayFiles, StorageArrayFiles
from jaxckpt.backends.orbax.incremental import Redirected, Reuse, redirects
from jaxckpt.backends.orbax.options import DEFAULT_PACK_BYTES, DEFAULT_PACK_LEAF_BYTES, OrbaxOptions
from jaxckpt.backends.orbax.plan import (
    WritePlan,
    build_plan as _build_plan,  # a module global tests replace
    layout_key,
)
from jaxckpt.backends.orbax.tree import ARRAYS_DIR, TREE_FILE, TREE_FORMAT, TREE_FORMAT_VERSION
from jaxckpt.backends.orbax.unchanged import KnownHashes
from jaxckpt.backends.orbax.write import (
    HostBuffers,
    OrbaxWriteHandle,
    create_directory,
    type_handler_registry,
    write_durably,
)

if TYPE_CHECKING:
    from jaxckpt.commit.deferred_checks import DeferredChecks
    from jaxckpt.storage.base import Storage

__all__ = ["WRITTEN", "OrbaxBackend", "OrbaxWriteHandle", "OrbaxOptions", "TREE_FORMAT",
           "TREE_FORMAT_VERSION", "DEFAULT_PACK_LEAF_BYTES", "DEFAULT_PACK_BYTES"]

#: Write plans a backend keeps (see OrbaxBackend._plan_for): enough for a run that saves a
#: few different trees (items and the state) in turn.
_MAX_PLANS = 4


@contextlib.contextmanager
def _gc_paused(enabled: bool) -> Iterator[None]:
    """Pause the cyclic GC: with thousands of leaves it costs 10-20% (docs/design.md,
    "Measured facts")."""
    if not enabled or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@functools.cache
def _library_versions() -> dict[str, str]:
    """Looked up once: the package-metadata lookups are slow, and the manager asks at every
    save on the training thread. Callers copy the result."""
    found = {"jax": jax.__version__}
    for package in ("jaxlib", "orbax-checkpoint", "flax"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found



def _new_checkpointer(options: OrbaxOptions, kind: str) -> Any:
    """Orbax's "sync", "async" or "background" checkpointer (Orbax imported here: a native
    save or restore never needs one, and importing Orbax costs a restarted process a large
    share of its restore). Separate ones: a background write may still be busy while the
    sync one writes or reads on the caller's thread; "background" is used only by the
    backend's writer thread."""
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler(**options.handler_options,
                                          type_handler_registry=type_handler_registry())
    if kind == "async":
        return ocp.AsyncCheckpointer(handler, timeout_secs=options.async_timeout_s)
    return ocp.Checkpointer(handler)


def _tree_save(arrays: dict[str, Any]) -> Any:
    """Orbax's save arguments for a flat dict of arrays (Orbax imported here, not before)."""
    import orbax.checkpoint as ocp

    return ocp.args.PyTreeSave(item=arrays)


def _started(pool: concurrent.futures.ThreadPoolExecutor | None, workers: int,
             prefix: str) -> concurrent.futures.ThreadPoolExecutor:
    """``pool``, or a new pool of ``workers`` threads named ``prefix`` when there is none."""
    if pool is None:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                     thread_name_prefix=prefix)
    return pool

class OrbaxBackend(orbax_process.ProcessFacts):
    """Writes and reads JAX pytrees with Orbax (see the module docstring for the layout).

    Concurrency contract: ``write``, ``read`` and ``close`` are called from one thread (the
    training loop's); a handle's ``wait`` may run on another thread. Every error stays with
    the write it belongs to (its handle), never raised by a later call nor lost.
    Single process: async writes are queued on the backend's one writer thread and run in
    order; ``write`` returns once its arrays are staged, without waiting for earlier writes
    (a save that writes a changed auxiliary item and then the state stages both at once).
    Multi-process: the backend's writer thread (natively) or Orbax's AsyncCheckpointer
    writes, one write at a time: a new ``write`` first waits for the previous one; every
    process calls ``write``/``read`` with the same directory and tree, only process 0
    writes tree.json, every process writes its shards.
    Across jobs: a directory is written once and never modified.
    """

    name = "orbax"
    #: Async writes; read() takes ``claims`` and checks the deferred checksums of the array
    #: files it reads itself; reads into new arrays (live NNX objects: in finish_read);
    #: incremental writes (``incremental``: chunk files the base holds are referred to).
    features = BackendFeatures(supports_async=True, verifies_reads=True, object_storage=True,
                               incremental=True)

    def __init__(self, *, use_ocdbt: bool = False, use_zarr3: bool = True,
                 use_compression: bool = False, async_timeout_s: int | None = None,
                 collective_timeout_s: float = 300.0, pause_gc: bool = True,
                 pack_leaf_bytes: int = DEFAULT_PACK_LEAF_BYTES,
                 pack_bytes: int = DEFAULT_PACK_BYTES, reuse_host_buffers: bool = True,
                 native_io: bool = True, direct_io: bool = True, io_threads: int = 4,
                 read_threads: int = 8):
        """Every argument is a field of :class:`OrbaxOptions`, which says what it does and
        why its default is what it is; a bad value raises ValueError naming it."""
        self.options = OrbaxOptions(
            use_ocdbt=use_ocdbt, use_zarr3=use_zarr3, use_compression=use_compression,
            async_timeout_s=async_timeout_s, collective_timeout_s=collective_timeout_s,
            pause_gc=pause_gc, pack_leaf_bytes=pack_leaf_bytes, pack_bytes=pack_bytes,
            reuse_host_buffers=reuse_host_buffers, native_io=native_io, direct_io=direct_io,
            io_threads=io_threads, read_threads=read_threads)
        self._io_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._read_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._host_buffers = HostBuffers(reuse=reuse_host_buffers)
        self._known = KnownHashes()  # incremental writes: hashes known by array identity
        # Write plans of recent layouts, most recently used first: (key, plan); see _plan_for.
        self._plans: list[tuple[tuple[Any, ...], WritePlan]] = []
        # Orbax's checkpointers by kind, made at their first use (``_new_checkpointer``).
        self._checkpointers: dict[str, Any] = {}
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pending: OrbaxWriteHandle | None = None  # Orbax's async write, multi-process
        self._queued: list[OrbaxWriteHandle] = []  # writer-thread writes not known done
        self._remote: StorageArrayFiles | None = None  # attach_storage: an object-store root

    def _orbax(self, kind: str) -> Any:
        """Orbax's "sync", "async" or "background" checkpointer, made at its first use."""
        if kind not in self._checkpointers:
            self._checkpointers[kind] = _new_checkpointer(self.options, kind)
        return self._checkpointers[kind]

    # ------------------------------------------------------------- features and facts

    @property
    def supports_async(self) -> bool:
        """``features.supports_async``, for code that reads the attribute."""
        return self.features.supports_async

    @property
    def verifies_reads(self) -> bool:
        """``features.verifies_reads``, for code that reads the attribute."""
        return self.features.verifies_reads

    # ------------------------------------------------------------------------- write

    def write(self, directory: str, state: Any, *, asynchronous: bool,
              base: IncrementalBase | None = None) -> OrbaxWriteHandle:
        """Write ``state`` into the new directory ``directory``; see the module docstring.

        Returns once the arrays are staged (the caller may then mutate numpy leaves, donate
        or free arrays). With ``asynchronous=False`` the data is written on return.
        Raises TypeError, before any I/O, naming the tree path of a leaf that is not an
        array, typed key or Python scalar (or a Python int outside int64). A save of a
        layout seen recently reuses its write plan (see the module docstring).
        """
        with _gc_paused(self.options.pause_gc):
            leaves, treedef = jax.tree_util.tree_flatten(state)
            if nnx_live.holds_live(state, treedef):
                # Live NNX objects are written as their nnx.State (jaxckpt.backends.orbax.nnx_live).
                state = nnx_live.to_state_tree(state)
                leaves, treedef = jax.tree_util.tree_flatten(state)
            # A single process holds every array entirely: it hands Orbax host arrays and
            # runs async writes on the backend's own thread (see _write_local). Several
            # processes write one sharded array together, which Orbax's AsyncCheckpointer
            # coordinates.
            local = jax.process_count() == 1
            # Everything is validated and classified before touching the filesystem, so a
            # bad leaf leaves nothing behind and every process fails the same way.
            plan = self._plan_for(state, treedef, leaves, local)
            sources = plan.sources(leaves)
            reuse = None if base is None else Reuse(
                base, plan.tree_json, lambda path: self._path(path).read_bytes(),
                known=self._known,
                seen=self._known.see(plan.file_sources(sources)) if local else None)
            return self._write_staged(directory, plan, sources, asynchronous=asynchronous,
                                      local=local, reuse=reuse)

    def _plan_for(self, state: Any, treedef: Any, leaves: list[Any],
                  local: bool) -> WritePlan:
        """The write plan of ``state``: the one of an earlier save with the same layout
        (tree structure, leaf types, shapes, dtypes), else a new one.

        Only single-process runs reuse plans: there a plan follows from the layout alone.
        With several processes it also depends on which arrays this process holds entirely
        (only those go into packs), a property of each array's sharding that the layout
        key does not capture; those saves plan afresh, as every save did before.
        """
        limits = (self.options.pack_leaf_bytes, self.options.pack_bytes)
        settings = dict(leaf_limit=limits[0], pack_limit=limits[1], leaves=leaves)
        if not local:
            return _build_plan(state, local=False, **settings)
        try:
            key = (*limits, *layout_key(treedef, leaves))
            position = next((i for i, (cached, _) in enumerate(self._plans) if cached == key),
                            None)
        except Exception:  # noqa: BLE001 - leaves or tree metadata we cannot compare
            # No plan can be reused (building one says what is wrong, if anything is).
            return _build_plan(state, local=True, **settings)
        if position is not None:
            entry = self._plans.pop(position)
            self._plans.insert(0, entry)  # most recently used first
            return entry[1]
        plan = _build_plan(state, local=True, **settings)
        # Keep a few layouts, so that a run alternating between them (a save that writes an
        # item and then the state) reuses every plan, and a layout that changed for good
        # is dropped before long.
        self._plans.insert(0, (key, plan))
        del self._plans[_MAX_PLANS:]
        return plan

    def _write_staged(self, directory: str, plan: WritePlan, sources: list[Any], *,
                      asynchronous: bool, local: bool,
                      reuse: Reuse | None = None) -> OrbaxWriteHandle:
        """The part of write() after planning: stage the host arrays, create the directory,
        write (sync) or hand the write to a background thread (async). ``reuse``: an
        incremental write, which only a native write follows (Orbax writes everything)."""
        tree_json, nbytes = plan.tree_json, plan.nbytes
        root = self._path(directory)
        with self._lock:
            if not local:
                self._drain_locked()
            self._queued = [queued for queued in self._queued if not queued.done()]
            # One process's sync write fills its packs as it writes them (defer_fill).
            arrays, used, fills = self._host_buffers.stage(
                plan, sources, copy_numpy=asynchronous, defer_fill=local and not asynchronous)
            native = orbax_shards.filling(  # before any I/O: may refuse
                self._writes_natively(directory, arrays, reuse), fills)
            if native is None:
                reuse = None
            # One process's native write writes tree.json itself, beside the arrays; an
            # async write by Orbax on the writer thread too (``_write_local``).
            native, own_tree = orbax_shards.writes_tree(native, tree_json if arrays else None)
            primary = jax.process_index() == 0
            if primary:
                create_directory(root, directory)
            if primary and not own_tree and not (arrays and asynchronous and local and not native):
                orbax_remote.write_tree(self._remote, root, directory, tree_json,
                                         alongside=bool(arrays) and native is not None)
            if not arrays:  # Orbax refuses an empty tree; tree.json alone describes it.
                return OrbaxWriteHandle(directory, nbytes)
            save_args = None if native else _tree_save(arrays)
            if not asynchronous:
                if native:
                    return OrbaxWriteHandle(directory, nbytes, written=native(root),
                                            reuse=reuse)
                self._orbax("sync").save(root / ARRAYS_DIR, args=save_args)
                return OrbaxWriteHandle(directory, nbytes)
            if local or native:
                if self._writer is None:
                    self._writer = concurrent.futures.ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="jaxckpt-orbax-write")
                work = (functools.partial(native, root) if native else
                        functools.partial(self._write_local, root, tree_json, save_args))
                handle = OrbaxWriteHandle(directory, nbytes, future=self._writer.submit(work),
                                          reuse=reuse)
                self._queued.append(handle)
            else:
                # Orbax's save() returns once the arrays are staged in host memory and
                # continues writing in its own background thread.
                self._orbax("async").save(root / ARRAYS_DIR, args=save_args)
                handle = OrbaxWriteHandle(directory, nbytes, finish=self._finish)
                self._pending = handle
            for slot in used:
                slot[1] = handle  # these buffers are busy until this write finished
            return handle

    def _write_local(self, root: epath.Path, tree_json: str, save_args: Any) -> None:
        """The background half of a single-process async write (the writer thread).

        Why not Orbax's AsyncCheckpointer here: its save() spends time on the caller's
        thread per call (an event loop, several new threads, futures) even when there is
        nothing to copy, and that is the training loop's time. Everything it would stage is
        already staged by HostBuffers.stage (host arrays: packs, copies of numpy leaves, and
        views of immutable CPU jax.Arrays, which also make jax skip donating those buffers),
        so a plain synchronous save on this thread writes the same files.
        """
        write_durably(root / TREE_FILE, tree_json)
        self._orbax("background").save(root / ARRAYS_DIR, args=save_args)

    def attach_storage(self, storage: Storage) -> None:
        """Write and read URLs of ``storage`` (an object-store root) natively through it."""
        self._remote = StorageArrayFiles(storage, read_threads=self.options.read_threads)

    def _path(self, directory: str) -> Any:
        return orbax_remote.path_for(self._remote, directory)

    def _files_for(self, directory: str) -> ArrayFiles | None:
        return orbax_remote.files_for(self._remote, directory, self.options)

    def _writes_natively(self, directory: str, arrays: dict[str, Any],
                         reuse: Reuse | None = None) -> Any:
        """This write through ``_files_for`` as a function of the directory
        (``orbax_shards.native_writer``: every array of a dtype and layout the native I/O stores
        as Orbax would), else None; a URL's arrays must (``check_arrays``)."""
        return orbax_remote.writer_for(self._remote, directory, arrays, self.options,
                                        pool=self._pool, reuse=reuse)

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        self._io_pool = _started(self._io_pool, self.options.io_threads, "jaxckpt-io")
        return self._io_pool

    def _readers(self) -> concurrent.futures.ThreadPoolExecutor:
        self._read_pool = _started(self._read_pool, self.options.read_threads, "jaxckpt-read")
        return self._read_pool

    def _finish(self, handle: OrbaxWriteHandle) -> None:
        with self._lock:
            if self._pending is handle:
                self._drain_locked()

    def _drain_locked(self) -> None:
        """Wait for every write in flight (its outcome stays on its handle). Caller holds
        ``self._lock``."""
        queued, self._queued = self._queued, []
        # A write's error is its handle's; a KeyboardInterrupt raised here is the user's.
        for handle in queued:
            with contextlib.suppress(Exception):
                handle.wait()
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                self._orbax("async").wait_until_finished()
            except BaseException as raised:
                pending.record_outcome(raised)
                if not isinstance(raised, Exception):
                    raise
            else:
                pending.record_outcome(None)

    def close(self) -> None:
        """Wait for an in-flight write (its error stays on its handle) and release Orbax's
        resources."""
        with self._lock:
            self._drain_locked()
            self._host_buffers.clear()
            self._plans.clear()
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            for pool in (self._io_pool, self._read_pool, self._remote):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._io_pool = self._read_pool = None
            for checkpointer in self._checkpointers.values():
                checkpointer.close()

    # -------------------------------------------------------------------------- read

    def read(self, directory: str, like: Any, *, claims: DeferredChecks | None = None,
             partial: bool = False,
             references: Mapping[str, Mapping[str, Any]] | None = None) -> Any:
        """Read ``directory`` into the structure, shapes, dtypes and shardings of ``like``.

        Leaves are matched by tree path. Every mismatch (missing, extra, shape, dtype, key
        impl) is collected first and raised as one TreeMismatchError; no array is read
        then. jax.Array / ShapeDtypeStruct leaves come back as jax.Array on the like leaf's
        sharding (the default device when it has none), numpy leaves as numpy, Python
        scalar leaves as the same Python type where a Python scalar was saved and as the
        saved jax.Array (its dtype, on the default device) where an array was: a fresh
        Linen ``TrainState`` (``step=0``) gets back the saved int32 step.

        A ``like`` holding live NNX objects (``jaxckpt.backends.orbax.nnx_live``) is read into their
        current arrays' shapes, dtypes and shardings, and the result is a
        ``nnx_live.PendingUpdate``: :meth:`finish_read` puts the values into the objects,
        in place. The manager calls it once the checkpoint is judged valid, so a read it
        throws away never changes the caller's objects.

        ``claims`` (a restore's deferred checksums, a ``DeferredChecks``): the array files
        read with ``native_io`` are claimed and checksummed as they are read, so nobody
        reads them a second time to verify them; claims are closed before the bulk read.

        ``partial``: ``like`` is a subtree of what was saved; the rest is neither matched
        nor read, nor checked (``orbax_read.limit_claims``).

        ``references`` (an incremental checkpoint's, verified by the caller): the chunk files
        it refers to are read from the earlier checkpoints that hold them
        (``incremental.redirects``), every other file from ``directory``.
        """
        read = functools.partial(self._read, directory, claims=claims, partial=partial,
                                 redirect=redirects(directory, references))
        # The GC paused: tree.json and like's paths make tens of thousands of objects with
        # many leaves, and its collections would walk them all; it is back once they are
        # gone with _read's frame (not before: its first collection would walk them).
        with _gc_paused(self.options.pause_gc):
            if nnx_live.holds_live(like):
                return nnx_live.read_into(like, read)
            return read(like)

    @staticmethod
    def finish_read(value: Any) -> Any:
        """What :meth:`read` returned, with values read for live NNX objects put into them
        (in place); anything else as it is."""
        if isinstance(value, nnx_live.PendingUpdate):
            return value.apply()
        return value

    @staticmethod
    def left_out(saved: Any, scope: dict[str, Any]) -> str | None:
        """A warning naming the NNX objects of ``scope`` (the local variables of the code
        that called save) that ``saved`` leaves out, or None (``nnx_live.left_out``)."""
        return nnx_live.left_out(saved, scope)

    def _read(self, directory: str, like: Any, *, claims: DeferredChecks | None = None,
              partial: bool = False, redirect: Mapping[str, str] | None = None) -> Any:
        """:meth:`read` of a ``like`` without live NNX objects (``redirect``: the files
        referred to, ``incremental.redirects``), with the GC paused; the packs' reads begin
        while like is matched (``packs.start``) and end with the block, whatever happens."""
        root = self._path(directory)
        files = self._files_for(directory)
        with orbax_read.PackReads(os.fspath(root / ARRAYS_DIR), Redirected(files, redirect)
                                  if files is not None and redirect else files,
                                  self._readers, claims, early=not partial) as packs:
            saved, targets, like_treedef = orbax_match.match_like(
                root, directory, like, partial=partial, on_parsed=packs.start)
            if not targets:
                orbax_read.limit_claims(claims, directory, None, {}, partial=partial)
                return jax.tree_util.tree_unflatten(like_treedef, [])
            arrays_dir = orbax_read.arrays_dir(root, directory)
            shardings = orbax_read.Shardings()
            restore_args, placements = orbax_read.restore_args_for(targets, saved, shardings)
            orbax_read.limit_claims(claims, directory, arrays_dir, restore_args, partial=partial)
            # The per-leaf work that needs no data (prepare) runs while the files are read.
            unpacker = orbax_read.Unpacker(directory, targets, saved, placements, shardings)
            restored = self._restore(directory, arrays_dir, restore_args, claims,
                                     partial=partial, unpacker=unpacker, packs=packs)
            values = unpacker.finish(restored)
            leaves = orbax_read.to_like_leaves(targets, saved, values, shardings.move_after,
                                                unpacker.converted)
            return jax.tree_util.tree_unflatten(like_treedef, leaves)

    def _restore(self, directory: str, arrays_dir: Any, restore_args: dict[str, Any],
                 claims: DeferredChecks | None, *, partial: bool,
                 unpacker: orbax_read.Unpacker, packs: orbax_read.PackReads) -> dict[str, Any]:
        """The stored arrays ``restore_args`` asks for, by storage name: read natively
        through ``packs.files`` where ``native_io`` applies and the files are in its layout
        (the packs' reads begun meanwhile taken over; ``unpacker`` prepares, then takes each
        host array as it arrives: ``orbax_read.read_native``), else by Orbax (told, with
        ``partial``, that the saved arrays outside ``restore_args`` stay unread). Any failure
        but running out of memory is a damaged checkpoint (CheckpointCorruptError)."""
        with orbax_read.unreadable_is_corrupt(directory):
            restored = None
            if packs.files is not None:
                restored = orbax_read.read_native(
                    os.fspath(arrays_dir), restore_args, claims, pool=self._readers(),
                    files=packs.files, on_host=unpacker.take, meanwhile=unpacker.prepare,
                    packs=packs)
            if claims is not None:
                claims.close()
            if restored is None and self._files_for(directory) is self._remote is not None:
                orbax_remote.refuse_foreign(directory)
            if restored is None:
                restored = self._orbax("sync").restore(
                    arrays_dir, args=orbax_read.restore_request(restore_args, partial))
        return restored

    # ---------------------------------------------------------------------- the rest

    def host_copy(self, state: Any) -> Any:
        """A copy of ``state`` in host memory (``orbax_process.host_copy``): a collective
        where arrays are sharded across processes."""
        return orbax_process.host_copy(state)

    def versions(self) -> dict[str, str]:
        """Versions of the libraries a checkpoint is written with (flax when installed)."""
        return dict(_library_versions())

    def rng_state(self) -> None:
        """JAX has no global RNG: keys are ordinary leaves of the state."""
        return None

    def set_rng_state(self, state: Any) -> None:
        """Nothing to restore (see :meth:`rng_state`)."""
        return None
