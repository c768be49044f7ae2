"""The JAX/Flax backend: pytrees of arrays written and read by Orbax.

Owns: turning a JAX pytree (dicts, lists, tuples, NamedTuples, ``flax.nnx.State``, optax
states) into a flat ``{storage_name: array}`` dict that Orbax writes, our own ``tree.json``
that records every leaf's tree path, shape, dtype and kind (array / typed PRNG key / Python
scalar), and the way back: matching saved leaves to a caller's ``like`` tree by tree path,
reporting every mismatch at once, and restoring each leaf onto the ``like`` leaf's sharding.
Also the process facts (index, count, barrier, broadcast) of a ``jax.distributed`` run.

Layout of one written directory::

    {directory}/tree.json     our metadata (see ``TREE_FORMAT``), written by the primary process
    {directory}/arrays/       an Orbax PyTreeCheckpointHandler checkpoint of the flat dict;
                              Orbax writes it under a temporary name and renames it into place
                              only once every process's data is written

This is the only module of jaxckpt that imports orbax. It must not import torch (nor
torch_bridge): a JAX run must never pay for, or depend on, PyTorch.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import itertools
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    TreeMismatchError,
)

__all__ = ["OrbaxBackend", "OrbaxWriteHandle", "TREE_FORMAT", "TREE_FORMAT_VERSION"]

#: value of the "format" field of tree.json; identifies the file's owner.
TREE_FORMAT = "jaxckpt.orbax.tree"
#: bumped on any incompatible change of tree.json; readers refuse newer versions.
TREE_FORMAT_VERSION = 1

_TREE_FILE = "tree.json"
_ARRAYS_DIR = "arrays"

# Python scalar types we store, by the name recorded in tree.json. bool comes first in
# the lookups below because bool is a subclass of int.
_PY_SCALAR_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float}
_PY_SCALAR_DTYPES = {"bool": np.dtype(np.bool_), "int": np.dtype(np.int64),
                     "float": np.dtype(np.float64)}
# Which numpy dtype kinds a 0-d saved leaf may have to restore into a Python scalar like.
_PY_SCALAR_DTYPE_KINDS = {"bool": "b", "int": "iu", "float": "f"}

# Distinguishes successive broadcast_int calls in the coordination service's key-value
# store. Module-wide so that two backends in one process never reuse a key; every process
# must therefore make the same sequence of broadcast_int calls (they are collectives).
_broadcast_counter = itertools.count()


def _is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _dtype_name(dtype: Any) -> str:
    # Key dtypes are not numpy dtypes; their str is e.g. "key<fry>" and differs per impl.
    return str(dtype) if _is_key_dtype(dtype) else np.dtype(dtype).name


@contextlib.contextmanager
def _gc_paused(enabled: bool) -> Iterator[None]:
    """Pause the cyclic GC: with thousands of leaves it costs 10-20% (FIELD_NOTES.md)."""
    if not enabled or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# --------------------------------------------------------------------------- saved leaves


@dataclass(frozen=True, slots=True)
class _SavedLeaf:
    """One entry of tree.json."""

    path: str
    """``jax.tree_util.keystr`` of the leaf's tree path: the key leaves are matched by."""
    name: str
    """Storage name of the leaf inside the Orbax checkpoint (``leaf_000017``)."""
    kind: str
    """"array", "key" (typed PRNG key) or "scalar" (Python bool/int/float)."""
    shape: tuple[int, ...]
    """Shape of the leaf as the user sees it (for keys: the key array's shape)."""
    dtype: str
    """Dtype name as the user sees it ("float32", "bfloat16", "key<fry>", "int64")."""
    impl: str | None = None
    """Key implementation name ("threefry2x32", "rbg", ...) for kind "key"."""
    data_shape: tuple[int, ...] | None = None
    """Shape of the stored ``key_data`` for kind "key" (key shape + impl's trailing dims)."""
    data_dtype: str | None = None
    """Dtype of the stored ``key_data`` for kind "key" (uint32 for the built-in impls)."""
    python_type: str | None = None
    """"bool", "int" or "float" for kind "scalar"."""

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": self.path, "name": self.name, "kind": self.kind,
                                 "shape": list(self.shape), "dtype": self.dtype}
        if self.kind == "key":
            entry.update(impl=self.impl, data_shape=list(self.data_shape or ()),
                         data_dtype=self.data_dtype)
        if self.kind == "scalar":
            entry["python_type"] = self.python_type
        return entry

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> _SavedLeaf:
        data_shape = entry.get("data_shape")
        return cls(path=entry["path"], name=entry["name"], kind=entry["kind"],
                   shape=tuple(entry["shape"]), dtype=entry["dtype"], impl=entry.get("impl"),
                   data_shape=None if data_shape is None else tuple(data_shape),
                   data_dtype=entry.get("data_dtype"), python_type=entry.get("python_type"))

    def describe(self) -> str:
        if self.kind == "scalar":
            return f"python {self.python_type}"
        text = f"shape {self.shape} {self.dtype}"
        return f"{text} (impl {self.impl})" if self.kind == "key" else text


def _stage_leaf(path: str, name: str, leaf: Any, *, copy_host: bool) -> tuple[_SavedLeaf, Any]:
    """Classify one state leaf; return its tree.json entry and the array Orbax will write.

    ``copy_host`` copies numpy leaves: they are mutable, and in async mode the caller may
    change them as soon as write() returns. jax.Arrays are immutable and need no copy.
    """
    if isinstance(leaf, jax.Array):
        if _is_key_dtype(leaf.dtype):
            data = jax.random.key_data(leaf)
            return _SavedLeaf(path=path, name=name, kind="key", shape=tuple(leaf.shape),
                              dtype=_dtype_name(leaf.dtype),
                              impl=str(jax.random.key_impl(leaf)),
                              data_shape=tuple(data.shape),
                              data_dtype=np.dtype(data.dtype).name), data
        return _SavedLeaf(path=path, name=name, kind="array", shape=tuple(leaf.shape),
                          dtype=_dtype_name(leaf.dtype)), leaf
    if isinstance(leaf, (np.ndarray, np.generic)):
        # Objects, strings, dates and records have no array encoding in Orbax.
        if leaf.dtype.kind in "OUSMm" or leaf.dtype.fields is not None:
            raise TypeError(
                f"leaf {path} is a numpy array of dtype {leaf.dtype}, which Orbax cannot "
                "store as an array. Fix: convert it to a numeric array, or keep it out of the "
                "array state (e.g. in a stateful object's JSON state).")
        array = np.array(leaf, copy=True) if copy_host else np.asarray(leaf)
        return _SavedLeaf(path=path, name=name, kind="array", shape=tuple(array.shape),
                          dtype=_dtype_name(array.dtype)), array
    for type_name, py_type in _PY_SCALAR_TYPES.items():
        if type(leaf) is py_type:
            dtype = _PY_SCALAR_DTYPES[type_name]
            if py_type is int and not -(2**63) <= leaf < 2**63:
                raise TypeError(
                    f"leaf {path} is the Python int {leaf}, which does not fit in int64. "
                    "Fix: store it as a string in a stateful object's JSON state.")
            return _SavedLeaf(path=path, name=name, kind="scalar", shape=(),
                              dtype=dtype.name, python_type=type_name), np.asarray(leaf, dtype)
    raise TypeError(
        f"leaf {path} is a {type(leaf).__module__}.{type(leaf).__qualname__}, which cannot be "
        "checkpointed as an array. Leaves must be jax.Array (typed PRNG keys included), numpy "
        "arrays or Python bool/int/float. Fix: remove it from the array state (e.g. with "
        "nnx.state(model, nnx.Param) or a filtered dict) and keep strings and objects in a "
        "stateful object's JSON state, or convert it to an array.")


# ---------------------------------------------------------------------------- like leaves


@dataclass(frozen=True, slots=True)
class _Target:
    """What a ``like`` leaf asks for."""

    target: str
    """"jax" (jax.Array, also for ShapeDtypeStruct), "numpy", "numpy_scalar" or "python"."""
    shape: tuple[int, ...]
    dtype: Any
    """numpy or key dtype; the Python type for target "python"."""
    sharding: jax.sharding.Sharding | None = None
    """Where a "jax" leaf goes; None means the default device."""

    def describe(self) -> str:
        if self.target == "python":
            return f"python {self.dtype.__name__}"
        return f"shape {self.shape} {_dtype_name(self.dtype)}"


def _target_of(leaf: Any) -> _Target | None:
    if isinstance(leaf, jax.Array):
        return _Target("jax", tuple(leaf.shape), leaf.dtype, leaf.sharding)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return _Target("jax", tuple(leaf.shape), leaf.dtype, leaf.sharding)
    if isinstance(leaf, np.ndarray):
        return _Target("numpy", tuple(leaf.shape), leaf.dtype)
    if isinstance(leaf, np.generic):
        return _Target("numpy_scalar", (), leaf.dtype)
    for py_type in _PY_SCALAR_TYPES.values():
        if type(leaf) is py_type:
            return _Target("python", (), py_type)
    return None


def _mismatch(target: _Target, saved: _SavedLeaf) -> bool:
    if target.target == "python":
        # A Python scalar like accepts any 0-d, non-key saved leaf of a matching kind (a
        # step counter saved as a jnp.int32 restores into a Python int).
        type_name = target.dtype.__name__
        return (saved.kind == "key" or saved.shape != ()
                or np.dtype(saved.dtype).kind not in _PY_SCALAR_DTYPE_KINDS[type_name])
    return saved.shape != target.shape or saved.dtype != _dtype_name(target.dtype)


def _key_data_sharding(sharding: jax.sharding.Sharding, key_ndim: int,
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


# --------------------------------------------------------------------------------- handle


class OrbaxWriteHandle:
    """A write started by :meth:`OrbaxBackend.write`.

    Concurrency contract: ``wait`` may be called from any thread, any number of times; every
    call after the write finished returns at once or re-raises the same error. The handle
    holds no Orbax state itself: the backend serialises access to its checkpointer.
    """

    __slots__ = ("directory", "nbytes", "_backend", "_finished", "_error")

    def __init__(self, backend: OrbaxBackend | None, directory: str, nbytes: int):
        #: the checkpoint directory this write fills.
        self.directory = directory
        #: bytes of array data handed to Orbax (logical sizes, plus tree.json); known at
        #: staging time, so nobody needs to walk the directory to report a save's size.
        self.nbytes = nbytes
        self._backend = backend
        self._finished = backend is None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the write is known to have finished (successfully or not)."""
        return self._finished

    def wait(self) -> None:
        """Block until Orbax finished this write; re-raise whatever made it fail."""
        if not self._finished and self._backend is not None:
            self._backend._finish(self)
        if self._error is not None:
            raise self._error


# -------------------------------------------------------------------------------- backend


class _QuietOcdbtMerge(logging.Filter):
    """Drops Orbax's "Skipping merge of OCDBT checkpoints" line: we turn OCDBT off on purpose
    (measured faster here), so that message would print on every save and say nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT" not in record.getMessage()


_QUIET = _QuietOcdbtMerge()
for _logger_name in ("absl", "orbax"):
    if _QUIET not in logging.getLogger(_logger_name).filters:
        logging.getLogger(_logger_name).addFilter(_QUIET)


class OrbaxBackend:
    """Writes and reads JAX pytrees with Orbax (see the module docstring for the layout).

    Concurrency contract: ``write``, ``read`` and ``close`` are called from one thread (the
    training loop's); a handle's ``wait`` may run on another thread. At most one async write
    is in flight: a new ``write`` first waits for the previous one (recording its outcome on
    its handle, so no error is lost or raised on the wrong call). Multi-process: every
    process calls ``write``/``read`` with the same directory and tree; only process 0 writes
    tree.json, every process writes its shards through Orbax. Across jobs: a directory is
    written once and never modified.
    """

    name = "orbax"
    supports_async = True

    def __init__(self, *, use_ocdbt: bool = False, use_zarr3: bool = True,
                 use_compression: bool = False, async_timeout_s: int | None = None,
                 collective_timeout_s: float = 300.0, pause_gc: bool = True):
        """
        Args:
          use_ocdbt: Orbax's OCDBT container format. Off: one zarr array per leaf was the
            fastest on CPU (FIELD_NOTES.md).
          use_zarr3: zarr v3 array format.
          use_compression: zstd compression; costs CPU and barely shrinks float weights.
          async_timeout_s: how long Orbax's background thread waits at its cross-process
            barriers; None keeps Orbax's default.
          collective_timeout_s: timeout of ``broadcast_int`` in multi-process runs.
          pause_gc: pause Python's cyclic GC during the blocking parts of write and read.
        """
        self._handler_options = dict(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3,
                                     use_compression=use_compression)
        self._collective_timeout_s = collective_timeout_s
        self._pause_gc = pause_gc
        # Separate handlers: the async checkpointer's handler may still be busy in its
        # background thread while the sync one writes or reads.
        self._async = ocp.AsyncCheckpointer(
            ocp.PyTreeCheckpointHandler(**self._handler_options), timeout_secs=async_timeout_s)
        self._sync = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**self._handler_options))
        self._lock = threading.Lock()
        self._pending: OrbaxWriteHandle | None = None

    # ------------------------------------------------------------------ process facts

    @property
    def process_index(self) -> int:
        return jax.process_index()

    @property
    def process_count(self) -> int:
        return jax.process_count()

    def barrier(self, name: str, timeout_s: float) -> None:
        """Block until every process reached barrier ``name`` (names must be unique per run).

        Safe from any thread: it waits in the coordination service (as Orbax's background
        thread does), not in a device collective.
        """
        if jax.process_count() == 1:
            return
        timeout_ms = max(1, int(timeout_s * 1000))
        if ocp.multihost.is_jax_distributed_client_initialized():
            ocp.multihost.get_barrier_sync_fn()(key=f"jaxckpt/{name}", timeout_ms=timeout_ms)
        else:
            ocp.multihost.sync_global_processes(f"jaxckpt/{name}",
                                                timeout=max(1, int(timeout_s)))

    def broadcast_int(self, value: int) -> int:
        """Process 0's ``value`` on every process. A collective: all processes call it, in
        the same order."""
        if jax.process_count() == 1:
            return int(value)
        if not ocp.multihost.is_jax_distributed_client_initialized():
            # Device collective fallback; values go through a jax array (int32 unless x64).
            from jax.experimental import multihost_utils

            return int(multihost_utils.broadcast_one_to_all(np.int32(value)))
        client = ocp.multihost.get_jax_distributed_client()
        key = f"jaxckpt/broadcast_int/{next(_broadcast_counter)}"
        if jax.process_index() == 0:
            client.key_value_set(key, str(int(value)), allow_overwrite=True)
            return int(value)
        timeout_ms = max(1, int(self._collective_timeout_s * 1000))
        return int(client.blocking_key_value_get(key, timeout_ms))

    # ------------------------------------------------------------------------- write

    def write(self, directory: str, state: Any, *,
              asynchronous: bool) -> OrbaxWriteHandle:
        """Write ``state`` into the new directory ``directory``; see the module docstring.

        Returns once the arrays are staged (the caller may then mutate numpy leaves, donate
        or free arrays). With ``asynchronous=False`` the data is written on return.
        Raises TypeError, before any I/O, naming the tree path of a leaf that is not an
        array, typed key or Python scalar.
        """
        # Validate and stage everything before touching the filesystem, so a bad leaf
        # leaves nothing behind and every process fails the same way.
        path_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        entries: list[_SavedLeaf] = []
        arrays: dict[str, Any] = {}
        seen: set[str] = set()
        for index, (key_path, leaf) in enumerate(path_leaves):
            path = jax.tree_util.keystr(key_path)
            if path in seen:
                raise ValueError(f"two leaves of the state share the tree path {path}; "
                                 "paths must be unique to be matched on restore")
            seen.add(path)
            entry, array = _stage_leaf(path, f"leaf_{index:06d}", leaf,
                                       copy_host=asynchronous)
            entries.append(entry)
            arrays[entry.name] = array
        tree_json = json.dumps({"format": TREE_FORMAT, "version": TREE_FORMAT_VERSION,
                                "leaves": [entry.to_json() for entry in entries]}, indent=1)
        nbytes = len(tree_json) + sum(int(np.prod(a.shape)) * a.dtype.itemsize
                                      for a in arrays.values())

        root = epath.Path(directory)
        with _gc_paused(self._pause_gc), self._lock:
            self._drain_locked()
            if jax.process_index() == 0:
                self._create_directory(root, directory)
                _write_durably(root / _TREE_FILE, tree_json)
            if not arrays:  # Orbax refuses an empty tree; tree.json alone describes it.
                return OrbaxWriteHandle(None, directory, nbytes)
            save_args = ocp.args.PyTreeSave(item=arrays)
            if not asynchronous:
                self._sync.save(root / _ARRAYS_DIR, args=save_args)
                return OrbaxWriteHandle(None, directory, nbytes)
            # Orbax's save() returns once the arrays are staged in host memory and continues
            # writing in its own background thread.
            self._async.save(root / _ARRAYS_DIR, args=save_args)
            handle = OrbaxWriteHandle(self, directory, nbytes)
            self._pending = handle
            return handle

    @staticmethod
    def _create_directory(root: epath.Path, directory: str) -> None:
        if root.exists() and any(root.iterdir()):
            raise CheckpointWriteError(
                f"checkpoint directory {directory} already exists and is not empty; the "
                "Orbax backend only writes into new directories. Fix: write to a fresh "
                "directory, or delete the stale one first.")
        root.mkdir(parents=True, exist_ok=True)

    def _finish(self, handle: OrbaxWriteHandle) -> None:
        with self._lock:
            if self._pending is handle:
                self._drain_locked()

    def _drain_locked(self) -> None:
        """Wait for the in-flight async write, if any, and record its outcome on its handle.
        Caller holds ``self._lock``."""
        handle, self._pending = self._pending, None
        if handle is None:
            return
        try:
            self._async.wait_until_finished()
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on it
            handle._error = error
        finally:
            handle._finished = True

    def close(self) -> None:
        """Wait for an in-flight write (its error stays on its handle) and release Orbax's
        resources."""
        with self._lock:
            self._drain_locked()
            self._async.close()
            self._sync.close()

    # -------------------------------------------------------------------------- read

    def read(self, directory: str, like: Any) -> Any:
        """Read ``directory`` into the structure, shapes, dtypes and shardings of ``like``.

        Leaves are matched by tree path. Every mismatch (missing, extra, shape, dtype, key
        impl) is collected first and raised as one TreeMismatchError; no array is read
        then. jax.Array / ShapeDtypeStruct leaves come back as jax.Array on the like leaf's
        sharding (the default device when it has none), numpy leaves as numpy, Python
        scalars as the same Python type.
        """
        root = epath.Path(directory)
        if not root.exists():
            raise CheckpointNotFoundError(f"no checkpoint at {directory}: the directory does "
                                          "not exist")
        saved = _read_tree_json(root, directory)

        like_leaves, like_treedef = jax.tree_util.tree_flatten_with_path(like)
        targets: list[tuple[str, _Target]] = []
        bad_like: list[str] = []
        for key_path, leaf in like_leaves:
            path = jax.tree_util.keystr(key_path)
            target = _target_of(leaf)
            if target is None:
                bad_like.append(f"  {path}: {type(leaf).__module__}.{type(leaf).__qualname__}")
            else:
                targets.append((path, target))
        if bad_like:
            raise TypeError(
                "like has leaves that describe no array:\n" + "\n".join(bad_like) + "\nFix: "
                "give like leaves that are jax.Array, jax.ShapeDtypeStruct, numpy arrays or "
                "Python bool/int/float (e.g. from nnx.eval_shape or jax.eval_shape).")

        problems = _compare(targets, saved)
        if problems:
            raise TreeMismatchError(
                f"cannot restore {directory} into like: {len(problems)} tree path(s) do not "
                "match:\n" + "\n".join(f"  {line}" for line in problems) + "\nFix: build "
                "like with the same code and configuration that produced the checkpoint "
                "(e.g. nnx.eval_shape of the same model and optimizer), or read with a like "
                f"that matches {directory}/{_TREE_FILE} and convert the result yourself.",
                problems)

        if not targets:
            return jax.tree_util.tree_unflatten(like_treedef, [])
        arrays_dir = root / _ARRAYS_DIR
        if not arrays_dir.exists():
            raise CheckpointCorruptError(
                f"checkpoint {directory} has {_TREE_FILE} but no {_ARRAYS_DIR}/ directory: "
                "its write did not finish. Fix: restore an older, committed checkpoint.")

        default_sharding = None
        restore_args: dict[str, Any] = {}
        # Keys whose key_data sharding we cannot derive: restored, then moved onto it.
        move_after: dict[str, jax.sharding.Sharding] = {}
        for path, target in targets:
            entry = saved[path]
            if target.target != "jax":
                restore_args[entry.name] = ocp.RestoreArgs(restore_type=np.ndarray)
                continue
            sharding = target.sharding
            if sharding is None:
                if default_sharding is None:
                    default_sharding = jax.device_put(np.zeros((), np.int8)).sharding
                sharding = default_sharding
            shape, dtype = target.shape, target.dtype
            if entry.kind == "key":
                shape, dtype = entry.data_shape, np.dtype(entry.data_dtype)
                data_sharding = _key_data_sharding(sharding, len(target.shape),
                                                   len(shape) - len(target.shape))
                if data_sharding is None:
                    move_after[path] = sharding
                    if default_sharding is None:
                        default_sharding = jax.device_put(np.zeros((), np.int8)).sharding
                    data_sharding = default_sharding
                sharding = data_sharding
            restore_args[entry.name] = ocp.ArrayRestoreArgs(
                sharding=sharding, global_shape=tuple(shape), dtype=dtype)

        with _gc_paused(self._pause_gc):
            restored = self._sync.restore(arrays_dir,
                                          args=ocp.args.PyTreeRestore(restore_args=restore_args))

        leaves = []
        for path, target in targets:
            entry = saved[path]
            value = restored[entry.name]
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
            leaves.append(value)
        return jax.tree_util.tree_unflatten(like_treedef, leaves)

    # ---------------------------------------------------------------------- the rest

    def host_copy(self, state: Any) -> Any:
        """A copy of ``state`` in host memory, independent of the training loop's buffers
        (which may be donated or freed). Array leaves become numpy arrays; typed keys stay
        typed keys, rebuilt from a host copy of their data on the default device; Python
        scalars are kept. Arrays sharded across processes are gathered, which makes this a
        collective that every process must call."""

        def to_host(array: jax.Array) -> np.ndarray:
            if array.is_fully_addressable:
                return np.array(array, copy=True)
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(array, tiled=True))

        def copy_leaf(leaf: Any) -> Any:
            if isinstance(leaf, jax.Array):
                if _is_key_dtype(leaf.dtype):
                    impl = str(jax.random.key_impl(leaf))
                    return jax.random.wrap_key_data(to_host(jax.random.key_data(leaf)),
                                                    impl=impl)
                return to_host(leaf)
            if isinstance(leaf, (np.ndarray, np.generic)):
                return np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf
            return leaf

        return jax.tree_util.tree_map(copy_leaf, state)

    def versions(self) -> dict[str, str]:
        """Versions of the libraries a checkpoint is written with (flax when installed)."""
        found = {"jax": jax.__version__}
        for package in ("jaxlib", "orbax-checkpoint", "flax"):
            try:
                found[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                pass
        return found

    def rng_state(self) -> None:
        """JAX has no global RNG: keys are ordinary leaves of the state."""
        return None

    def set_rng_state(self, state: Any) -> None:
        """Nothing to restore (see :meth:`rng_state`)."""
        return None


def _compare(targets: list[tuple[str, _Target]], saved: dict[str, _SavedLeaf]) -> list[str]:
    """Every difference between like and the checkpoint, one line per tree path."""
    problems = []
    like_paths = set()
    for path, target in targets:
        like_paths.add(path)
        entry = saved.get(path)
        if entry is None:
            problems.append(f"{path}: missing from checkpoint (like has {target.describe()})")
        elif _mismatch(target, entry):
            problems.append(f"{path}: expected {target.describe()}, checkpoint has "
                            f"{entry.describe()}")
    for path, entry in saved.items():
        if path not in like_paths:
            problems.append(f"{path}: not in like (checkpoint has {entry.describe()})")
    # Sorted by path so that related problems (a renamed subtree) read side by side.
    return sorted(problems)


def _read_tree_json(root: epath.Path, directory: str) -> dict[str, _SavedLeaf]:
    tree_file = root / _TREE_FILE
    if not tree_file.exists():
        raise CheckpointCorruptError(
            f"{directory} has no {_TREE_FILE}: it was not written by jaxckpt's Orbax backend, "
            "or its write did not finish. Fix: point at a checkpoint directory that the "
            "Orbax backend wrote completely.")
    try:
        document = json.loads(tree_file.read_text())
        if document.get("format") != TREE_FORMAT:
            raise ValueError(f"format is {document.get('format')!r}, not {TREE_FORMAT!r}")
        if document.get("version", 0) > TREE_FORMAT_VERSION:
            raise ValueError(f"version {document['version']} is newer than this jaxckpt "
                             f"reads ({TREE_FORMAT_VERSION}); upgrade jaxckpt")
        entries = [_SavedLeaf.from_json(entry) for entry in document["leaves"]]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointCorruptError(f"{directory}/{_TREE_FILE} is unreadable: {error}") \
            from error
    return {entry.path: entry for entry in entries}


def _write_durably(path: epath.Path, text: str) -> None:
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
