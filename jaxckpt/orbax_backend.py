"""The JAX/Flax backend: pytrees of arrays stored as Orbax checkpoints.

Owns: turning a JAX pytree (dicts, lists, tuples, NamedTuples, ``flax.nnx.State``, optax
states) into a flat ``{storage_name: array}`` dict that Orbax writes, our own ``tree.json``
that records every leaf's tree path, shape, dtype and kind (array / typed PRNG key / Python
scalar), and the way back: matching saved leaves to a caller's ``like`` tree by tree path,
reporting every mismatch at once, and restoring each leaf onto the ``like`` leaf's sharding.
Also the process facts (index, count, barrier, broadcast) of a ``jax.distributed`` run.

Layout of one written directory::

    {directory}/tree.json     our metadata (see ``TREE_FORMAT``), written by the primary process
    {directory}/arrays/       an Orbax PyTreeCheckpointHandler checkpoint of the flat dict,
                              written under a temporary name and renamed into place only once
                              every process's data is written

Small leaves are packed. Orbax spends about 2 ms of Python per leaf whatever its size
(FIELD_NOTES.md), so a state of thousands of small leaves (optimizer states, biases, norms)
would cost seconds in bookkeeping alone. Leaves of at most ``pack_leaf_bytes`` bytes that
this process holds entirely (numpy arrays, Python scalars, fully addressable jax.Arrays,
typed keys' data) are copied into a few 1-D arrays per dtype (``pack_float32_000``, each at
most ``pack_bytes`` bytes) and written as ordinary Orbax arrays. tree.json records, for every
packed leaf, the pack and the element offset; restore reads the packs and cuts the leaves out
by tree path, so matching, mismatch errors and types are exactly those of unpacked leaves.
Large leaves and leaves sharded across processes are written as they are, one Orbax array
each, on their own shardings.

How a write runs: the caller's thread validates and classifies the leaves, fills the packs,
copies numpy leaves (async writes only: the caller may change them once write() returns)
and returns. In a single process every array is staged as a host array (a CPU jax.Array as
a zero-copy view: it is immutable), async writes run on the backend's own writer thread,
and on a local filesystem that thread writes Orbax's files itself (``jaxckpt.zarr_io``:
the same bytes tensorstore would write, moved with O_DIRECT and checksummed on the way;
``native_io``), which restores read back the same way. Orbax writes and reads everything
else: several processes (its AsyncCheckpointer writes each process's shards), remote
paths, dtypes zarr_io does not store, arrays in another layout. docs/performance.md has
the measurements behind each of these choices.

A training run saves the same layout (tree structure, leaf types, shapes, dtypes) again and
again, and everything but the data follows from the layout: tree paths, classification, the
packs and every leaf's place in them, the text of tree.json. That is a write plan
(``_WritePlan``); a single-process backend keeps the plans of its last few layouts, so a
save of a known layout only flattens the tree, compares the layout, checks the values that
need checking (Python ints within int64) and copies the data.

This is the only module of jaxckpt that imports orbax. It must not import torch (nor
torch_bridge): a JAX run must never pay for, or depend on, PyTorch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import importlib.metadata
import itertools
import json
import logging
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from math import prod
from typing import Any, Iterator, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxckpt import nnx_live, zarr_io
from jaxckpt.checksum import default_algorithm
from jaxckpt.errors import (
    CheckpointCorruptError,
    CodecError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    TreeMismatchError,
)
from jaxckpt.layout import TREE_FILE
from jaxckpt.read_claims import ReadClaims

__all__ = ["OrbaxBackend", "OrbaxWriteHandle", "TREE_FORMAT", "TREE_FORMAT_VERSION"]

#: value of the "format" field of tree.json; identifies the file's owner.
TREE_FORMAT = "jaxckpt.orbax.tree"
#: bumped on any incompatible change of tree.json; readers refuse newer versions. Version 2
#: adds packed leaves (an "offset" on the leaf, whose "name" is then its pack's, and a
#: "packs" list); a checkpoint without packed leaves is still written as version 1,
#: readable by every release. Version 3 adds arrays stored as their bytes (a "data_dtype"
#: of uint8 and a "data_shape" on a leaf of kind "array": dtypes Orbax has no type for);
#: only a checkpoint holding such a leaf is written as version 3.
TREE_FORMAT_VERSION = 3
_PACKED_TREE_VERSION = 2
_UNPACKED_TREE_VERSION = 1

_TREE_FILE = TREE_FILE
_ARRAYS_DIR = "arrays"
_ZARR_JSON = "zarr.json"
_PACK_PREFIX = "pack_"
#: The only storage names written: leaf_000017, pack_float32_000 (never a path).
# numpy dtype names have underscores of their own (float8_e4m3fn), never '/' or '.'.
_STORAGE_NAME = re.compile(r"^(leaf_\d{1,12}|pack_[a-z0-9_]{1,32}_\d{1,9})$")

#: Leaves of at most this many bytes are packed (see the module docstring). At ~2 ms of
#: Orbax overhead per leaf and a host copy at >= 2 GB/s, packing wins for every leaf below
#: a few MiB; 1 MiB keeps the extra host copy small for real models, whose bytes are in
#: large leaves.
DEFAULT_PACK_LEAF_BYTES = 1 << 20
#: Upper size of one pack array: several packs are written and read in parallel, and a
#: restore never needs one huge contiguous buffer. 16, 32 and 64 MiB measured alike
#: (docs/performance.md).
DEFAULT_PACK_BYTES = 32 << 20
#: Write plans a backend keeps (see OrbaxBackend._plan_for): enough for a run that saves a
#: few different trees (items and the state) in turn.
_MAX_PLANS = 4

# Python scalar types we store, by the name recorded in tree.json. bool comes first in
# the lookups below because bool is a subclass of int.
_PY_SCALAR_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float}
_PY_SCALAR_DTYPES = {"bool": np.dtype(np.bool_), "int": np.dtype(np.int64),
                     "float": np.dtype(np.float64)}
_PY_SCALAR_CLASSES = frozenset(_PY_SCALAR_TYPES.values())
# Which numpy dtype kinds a 0-d saved leaf may have to restore into a Python scalar like.
_PY_SCALAR_DTYPE_KINDS = {"bool": "b", "int": "iu", "float": "f"}

# Distinguishes successive broadcast_int calls in the coordination service's key-value
# store. Module-wide so that two backends in one process never reuse a key; every process
# must therefore make the same sequence of broadcast_int calls (they are collectives).
_broadcast_counter = itertools.count()


# Both are asked once per leaf and cost ~10 us each uncached (numpy's dtype.name and
# issubdtype are Python code): with 10,000 leaves that was 0.2 s of every save's blocking
# time. A state has a handful of distinct dtypes.
@functools.lru_cache(maxsize=256)
def _is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.lru_cache(maxsize=256)
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
    """Shape of the stored ``key_data`` for kind "key" (key shape + impl's trailing dims);
    for an array stored as its bytes, its shape + (itemsize,)."""
    data_dtype: str | None = None
    """Dtype of the stored ``key_data`` for kind "key" (uint32 for the built-in impls);
    "uint8" for an array stored as its bytes (a dtype Orbax cannot store, ``as_bytes``)."""
    python_type: str | None = None
    """"bool", "int" or "float" for kind "scalar"."""
    offset: int | None = None
    """For a packed leaf: its first element in the pack array ``name``; None when the leaf
    is an Orbax array of its own."""

    @property
    def packed(self) -> bool:
        return self.offset is not None

    @property
    def as_bytes(self) -> bool:
        """An array stored as its bytes (uint8, one more axis of the itemsize)."""
        return self.kind == "array" and self.data_dtype is not None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape of the data as stored (a key's ``key_data``, an array's bytes; the leaf's
        shape otherwise)."""
        return (tuple(self.data_shape or ()) if self.kind == "key" or self.as_bytes
                else self.shape)

    @property
    def stored_dtype(self) -> np.dtype:
        """Dtype of the data as stored (a key's ``key_data`` dtype, uint8 for an array's
        bytes; the leaf's otherwise)."""
        return np.dtype(self.data_dtype if self.kind == "key" or self.as_bytes
                        else self.dtype)

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": self.path, "name": self.name, "kind": self.kind,
                                 "shape": list(self.shape), "dtype": self.dtype}
        if self.kind == "key":
            entry.update(impl=self.impl, data_shape=list(self.data_shape or ()),
                         data_dtype=self.data_dtype)
        if self.as_bytes:
            entry.update(data_shape=list(self.data_shape or ()), data_dtype=self.data_dtype)
        if self.kind == "scalar":
            entry["python_type"] = self.python_type
        if self.offset is not None:
            entry["offset"] = self.offset
        return entry

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> _SavedLeaf:
        data_shape = entry.get("data_shape")
        offset = entry.get("offset")
        if offset is not None and (type(offset) is not int or offset < 0):
            raise ValueError(f"leaf {entry.get('path')!r} has offset {offset!r}, not an "
                             "integer >= 0")
        return cls(path=entry["path"], name=entry["name"], kind=entry["kind"],
                   shape=tuple(entry["shape"]), dtype=entry["dtype"], impl=entry.get("impl"),
                   data_shape=None if data_shape is None else tuple(data_shape),
                   data_dtype=entry.get("data_dtype"), python_type=entry.get("python_type"),
                   offset=offset)

    def describe(self) -> str:
        if self.kind == "scalar":
            return f"python {self.python_type}"
        text = f"shape {self.shape} {self.dtype}"
        return f"{text} (impl {self.impl})" if self.kind == "key" else text


class _Layout(NamedTuple):
    """What tree.json records of one leaf apart from its path and where it is stored: the
    fields of _SavedLeaf but path, name and offset, with the same meanings."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    impl: str | None = None
    data_shape: tuple[int, ...] | None = None
    data_dtype: str | None = None
    python_type: str | None = None


#: Array dtypes Orbax's tensorstore stores (zarr3), by numpy name. Arrays of any other
#: dtype numpy holds (uint2, uint4, float8_e4m3, float6_*, int1/uint1, complex32, numpy's
#: longdouble...) are stored as their bytes: uint8 with one more axis of the itemsize
#: (``_as_bytes``); tests/test_dtypes.py round-trips every one bit for bit.
_STORABLE_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "bfloat16", "complex64", "complex128",
    "int2", "int4", "float4_e2m1fn", "float8_e3m4", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
})


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of ``array`` (C order) as uint8 of shape ``array.shape + (itemsize,)``: how
    an array of a dtype Orbax has no type for is stored (a view where it can be)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(np.uint8).reshape(array.shape + (array.dtype.itemsize,))


def _from_bytes(data: np.ndarray, entry: _SavedLeaf) -> np.ndarray:
    """The array ``_as_bytes`` stored, from its bytes as read (host memory)."""
    dtype = np.dtype(_numpy_dtype(entry.dtype))
    flat = np.ascontiguousarray(data).reshape(-1)
    return flat.view(dtype).reshape(entry.shape)


def _numpy_dtype(name: str) -> np.dtype:
    """A dtype by the name tree.json records (ml_dtypes' names included)."""
    if re.fullmatch(r"void\d+", name):  # raw bytes: numpy names V4 "void32", in bits
        return np.dtype(f"V{int(name[4:]) // 8}")
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        found = getattr(ml_dtypes, name, None)
        if found is None:
            raise
        return np.dtype(found)


def _bytes_layout(path: str, array: np.ndarray) -> tuple[_Layout, np.ndarray]:
    """A leaf of a dtype Orbax cannot store, kept as its bytes (refused where its bytes
    cannot be had: an object, string or structured dtype)."""
    data = _as_bytes(array)
    return _Layout(kind="array", shape=tuple(array.shape), dtype=array.dtype.name,
                   data_shape=tuple(data.shape), data_dtype="uint8"), data


def _check_int64(path: str, value: int) -> None:
    """Python ints are stored as int64; one outside its range raises, naming its path."""
    if not -(2**63) <= value < 2**63:
        raise TypeError(
            f"leaf {path} is the Python int {value}, which does not fit in int64. "
            "Fix: store it as a string in a stateful object's JSON state.")


def _stage_leaf(path: str, leaf: Any) -> tuple[_Layout, Any]:
    """Classify one state leaf; return what tree.json records of it and the array that
    holds its data (the caller's own numpy array, not a copy: ``OrbaxBackend._stage_host``
    copies what must be copied). Raises TypeError, naming ``path``, for a leaf that cannot
    be stored."""
    if isinstance(leaf, jax.Array):
        if _is_key_dtype(leaf.dtype):
            data = jax.random.key_data(leaf)
            return _Layout(kind="key", shape=tuple(leaf.shape), dtype=_dtype_name(leaf.dtype),
                           impl=str(jax.random.key_impl(leaf)), data_shape=tuple(data.shape),
                           data_dtype=np.dtype(data.dtype).name), data
        if np.dtype(leaf.dtype).name not in _STORABLE_DTYPES:
            if not leaf.is_fully_addressable:
                raise CodecError(
                    f"leaf {path} is a jax.Array of dtype {np.dtype(leaf.dtype).name} sharded "
                    "across processes; Orbax has no type for that dtype, and jaxckpt stores "
                    "such arrays as their bytes only from one process. Fix: convert it to a "
                    "dtype Orbax stores (e.g. uint8, float32) before saving.")
            return _bytes_layout(path, np.asarray(leaf))
        return _Layout(kind="array", shape=tuple(leaf.shape),
                       dtype=_dtype_name(leaf.dtype)), leaf
    if isinstance(leaf, (np.ndarray, np.generic)):
        # Objects, strings, dates and records have no array encoding in Orbax.
        if leaf.dtype.kind in "OUSMm" or leaf.dtype.fields is not None:
            raise TypeError(
                f"leaf {path} is a numpy array of dtype {leaf.dtype}, which Orbax cannot "
                "store as an array. Fix: convert it to a numeric array, or keep it out of the "
                "array state (e.g. in a stateful object's JSON state).")
        array = np.asarray(leaf)
        if array.dtype.name not in _STORABLE_DTYPES:
            return _bytes_layout(path, array)
        return _Layout(kind="array", shape=tuple(array.shape),
                       dtype=_dtype_name(array.dtype)), array
    for type_name, py_type in _PY_SCALAR_TYPES.items():
        if type(leaf) is py_type:
            dtype = _PY_SCALAR_DTYPES[type_name]
            if py_type is int:
                _check_int64(path, leaf)
            return _Layout(kind="scalar", shape=(), dtype=dtype.name,
                           python_type=type_name), np.asarray(leaf, dtype)
    raise TypeError(
        f"leaf {path} is a {type(leaf).__module__}.{type(leaf).__qualname__}, which cannot be "
        "checkpointed as an array. Leaves must be jax.Array (typed PRNG keys included), numpy "
        "arrays or Python bool/int/float. Fix: remove it from the array state (e.g. with "
        "nnx.state(model, nnx.Param) or a filtered dict) and keep strings and objects in a "
        "stateful object's JSON state, or convert it to an array.")


# -------------------------------------------------------------------------------- packing


#: The packs of a write: {pack name: (dtype, leaf indices in pack order, size in elements)}.
_Packs = dict[str, tuple[np.dtype, list[int], int]]


def _plan_packs(candidates: list[tuple[int, np.dtype, int]],
                pack_limit: int) -> tuple[_Packs, dict[int, tuple[str, int]]]:
    """Assign the leaves that go into packs to packs.

    ``candidates`` are ``(leaf index, stored dtype, element count)`` in tree order. Returns
    the packs and, per packed leaf index, its ``(pack name, element offset)``. Leaves are
    grouped by stored dtype, in tree order, and a pack is closed before it would exceed
    ``pack_limit`` bytes (a single leaf larger than that still gets a pack of its own).
    """
    by_dtype: dict[str, list[tuple[int, np.dtype, int]]] = {}
    for candidate in candidates:
        by_dtype.setdefault(candidate[1].name, []).append(candidate)
    packs: _Packs = {}
    placements: dict[int, tuple[str, int]] = {}
    for dtype_name, members in by_dtype.items():
        dtype = np.dtype(dtype_name)
        number = 0
        name = f"{_PACK_PREFIX}{dtype_name}_{number:03d}"
        indices: list[int] = []
        size = 0
        for index, _, count in members:
            if indices and (size + count) * dtype.itemsize > pack_limit:
                packs[name] = (dtype, indices, size)
                number += 1
                name = f"{_PACK_PREFIX}{dtype_name}_{number:03d}"
                indices, size = [], 0
            placements[index] = (name, size)
            indices.append(index)
            size += count
        packs[name] = (dtype, indices, size)
    return packs, placements


def _host_arrays(arrays: list[jax.Array]) -> list[np.ndarray]:
    """Host numpy arrays of fully addressable jax.Arrays. On CPU a view (no copy; read-only,
    and the array cannot be donated while the view lives); elsewhere one batched transfer.
    np.asarray is half the cost of jax.device_get per array, which shows at 10,000 leaves."""
    if jax.default_backend() == "cpu":
        return [np.asarray(array) for array in arrays]
    return jax.device_get(arrays)


def _pack_length(size: int) -> int:
    """Elements of the array that holds a pack of ``size`` elements: a pack of zero-size
    leaves only holds one element of padding, as Orbax refuses to store an empty array."""
    return max(size, 1)


def _fill_pack(buffer: np.ndarray, sources: list[np.ndarray]) -> None:
    """Copy ``sources`` (host numpy arrays, in pack order) into ``buffer``."""
    np.concatenate(sources, axis=None, out=buffer)  # axis=None: flattened, in C order


# ---------------------------------------------------------------------------- write plans


@dataclass(frozen=True, slots=True, eq=False)
class _WritePlan:
    """Everything a write derives from the state's layout rather than from its values:
    the tree.json text, which leaf is stored where (its own Orbax array, or a pack and an
    offset), and how each leaf's data is fetched. Built by :func:`_build_plan`, which
    validates every leaf; a plan therefore only exists for a layout that can be written."""

    tree_json: str
    """tree.json's full text."""
    nbytes: int
    """Bytes of array data (stored sizes) plus tree.json's length: the handle's ``nbytes``."""
    packs: _Packs
    """``{pack name: (dtype, leaf indices in pack order, size in elements)}``."""
    unpacked: list[tuple[int, str]]
    """``(leaf index, storage name)`` of the leaves written as Orbax arrays of their own."""
    on_device: list[int]
    """Leaves whose data is a jax.Array that comes to the host before the write."""
    keys: list[int]
    """Typed PRNG key leaves: their data is ``jax.random.key_data``."""
    numpy: list[int]
    """numpy array and numpy scalar leaves: their data is ``np.asarray`` of them."""
    scalars: list[tuple[int, np.dtype, str | None]]
    """Python scalar leaves: ``(leaf index, stored dtype, path if an int else None)``."""
    empty: list[tuple[int, tuple[int, ...], np.dtype]]
    """Zero-size leaves: ``(leaf index, stored shape, stored dtype)``; always packed, their
    data an empty host array."""
    as_bytes: list[int]
    """Leaves of a dtype Orbax has no type for: their data is their bytes, on the host."""

    def sources(self, leaves: list[Any]) -> list[Any]:
        """The array that holds each leaf's data for this save (the caller's own numpy
        arrays; jax.Arrays as they are). Runs the checks that depend on values, not layout:
        a Python int outside int64 raises TypeError naming its path."""
        sources = list(leaves)  # a jax.Array leaf is its own data
        for index in self.keys:
            sources[index] = jax.random.key_data(leaves[index])
        for index in self.numpy:
            sources[index] = np.asarray(leaves[index])
        for index, dtype, int_path in self.scalars:
            if int_path is not None:
                _check_int64(int_path, leaves[index])
            sources[index] = np.asarray(leaves[index], dtype)
        for index in self.as_bytes:
            sources[index] = _as_bytes(np.asarray(leaves[index]))
        for index, shape, dtype in self.empty:
            sources[index] = np.empty(shape, dtype)
        return sources


def _build_plan(state: Any, *, leaf_limit: int, pack_limit: int, local: bool) -> _WritePlan:
    """The write plan of ``state``, from scratch: flattens it with tree paths, classifies
    and validates every leaf (TypeError / ValueError naming the path, before any I/O) and
    plans the packs. ``local``: a single process, which holds every array entirely and
    hands Orbax host arrays only."""
    path_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    paths: list[str] = []
    layouts: list[_Layout] = []
    candidates: list[tuple[int, np.dtype, int]] = []  # leaves that may go into a pack
    stored_bytes = 0
    on_device: list[int] = []
    keys: list[int] = []
    numpy_leaves: list[int] = []
    scalars: list[tuple[int, np.dtype, str | None]] = []
    empty: list[tuple[int, tuple[int, ...], np.dtype]] = []
    as_bytes: list[int] = []
    seen: set[str] = set()
    for index, (key_path, leaf) in enumerate(path_leaves):
        path = jax.tree_util.keystr(key_path)
        if path in seen:
            raise ValueError(f"two leaves of the state share the tree path {path}; "
                             "paths must be unique to be matched on restore")
        seen.add(path)
        layout, data = _stage_leaf(path, leaf)
        paths.append(path)
        layouts.append(layout)
        if layout.kind == "key":
            keys.append(index)
            stored_shape, dtype = layout.data_shape, np.dtype(layout.data_dtype)
        elif layout.data_dtype is not None:  # stored as its bytes
            as_bytes.append(index)
            stored_shape, dtype = layout.data_shape, np.dtype(layout.data_dtype)
        else:
            stored_shape, dtype = layout.shape, np.dtype(data.dtype)
            if layout.kind == "scalar":
                scalars.append((index, dtype, path if layout.python_type == "int" else None))
            elif isinstance(data, np.ndarray):
                numpy_leaves.append(index)
        # Sizes from the shape: jax.Array's size and nbytes properties cost microseconds.
        count = prod(stored_shape)
        nbytes = count * dtype.itemsize
        stored_bytes += nbytes
        if count == 0:
            # Orbax refuses zero-size arrays ("Cannot save arrays with zero size") and
            # there is nothing to store: tree.json's shape and dtype say it all. Such a
            # leaf goes into a pack at any offset, from an empty host array (no transfer,
            # whichever process holds it).
            empty.append((index, tuple(stored_shape), dtype))
            candidates.append((index, dtype, 0))
            continue
        on_host = isinstance(data, np.ndarray)
        # Small leaves this process holds entirely go into packs. An array sharded across
        # processes is written shard by shard by Orbax instead; with a single process every
        # array is held entirely, and asking would cost microseconds per leaf.
        packable = 0 < leaf_limit and nbytes <= leaf_limit and (
            local or on_host or data.is_fully_addressable)
        if packable:
            candidates.append((index, dtype, count))
        # jax data comes to the host to be packed, and in a single process to be written.
        if not on_host and (packable or local):
            on_device.append(index)
    packs, placements = _plan_packs(candidates, pack_limit)

    entries: list[_SavedLeaf] = []
    unpacked: list[tuple[int, str]] = []
    for index, (path, layout) in enumerate(zip(paths, layouts)):
        placed = placements.get(index)
        if placed is None:
            name, offset = f"leaf_{index:06d}", None
            unpacked.append((index, name))
        else:
            name, offset = placed
        entries.append(_SavedLeaf(path=path, name=name, offset=offset, **layout._asdict()))
    tree_json = _tree_json(entries, [{"name": name, "dtype": dtype.name,
                                      "size": _pack_length(size)}
                                     for name, (dtype, _, size) in packs.items()])
    return _WritePlan(tree_json=tree_json, nbytes=len(tree_json) + stored_bytes, packs=packs,
                      unpacked=unpacked, on_device=on_device, keys=keys, numpy=numpy_leaves,
                      scalars=scalars, empty=empty, as_bytes=as_bytes)


def _layout_key(treedef: Any, leaves: list[Any]) -> tuple[Any, ...]:
    """What a write plan depends on besides the backend's pack settings: the tree structure
    and, per leaf, its type, shape and dtype (a typed key's dtype names its impl; a Python
    scalar's type alone fixes its layout). Cheap next to building a plan: no tree paths, no
    classification. Raises (AttributeError) for a leaf without shape or dtype; no plan
    exists for such a leaf.

    The structure is both the treedef and its text. Treedefs tell node types apart by
    identity, which the text (type names) does not; but they compare dict keys with ``==``:
    ``{1: x}``, ``{True: x}`` and ``{np.int64(1): x}`` have equal treedefs and the tree paths
    ``[1]``, ``[True]`` and ``[np.int64(1)]``, which only the text tells apart."""
    signature = tuple([cls if (cls := type(leaf)) in _PY_SCALAR_CLASSES
                       else (cls, leaf.shape, leaf.dtype) for leaf in leaves])
    # Cheapest comparisons first: a key that differs mostly differs early.
    return signature, str(treedef), treedef


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
    holds no Orbax state itself: the backend serialises access to its checkpointers.
    """

    __slots__ = ("directory", "nbytes", "_backend", "_finished", "_error", "_future",
                 "_checksums")

    def __init__(self, backend: OrbaxBackend | None, directory: str, nbytes: int,
                 future: concurrent.futures.Future[Any] | None = None,
                 checksums: dict[str, dict[str, Any]] | None = None):
        #: the checkpoint directory this write fills.
        self.directory = directory
        #: bytes of array data handed to Orbax (logical sizes, plus tree.json); known at
        #: staging time, so nobody needs to walk the directory to report a save's size.
        self.nbytes = nbytes
        self._backend = backend
        # Single process: the backend's writer thread runs the write and this future holds
        # its outcome. Otherwise Orbax's AsyncCheckpointer runs it and the backend records
        # the outcome here when it drains.
        self._future = future
        self._finished = backend is None and future is None
        self._error: BaseException | None = None
        self._checksums = checksums

    @property
    def checksums(self) -> dict[str, dict[str, Any]] | None:
        """Manifest entries (``{"size": n, algorithm: hex}``) of the files this write made
        durable and checksummed itself, by path relative to ``directory``; None when Orbax
        wrote the arrays. Known once ``wait`` returned."""
        if self._future is not None:
            return self._future.result()
        return self._checksums

    def done(self) -> bool:
        """Whether the write is known to have finished (successfully or not)."""
        return self._future.done() if self._future is not None else self._finished

    def wait(self) -> None:
        """Block until Orbax finished this write; re-raise whatever made it fail."""
        if self._future is not None:
            self._future.result()
            return
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


class _Staging:
    """Marks reused host buffers as taken by the write being staged."""

    @staticmethod
    def done() -> bool:
        return False


_STAGING = _Staging()


def _type_handler_registry() -> Any:
    """Orbax's handlers, except that numpy arrays are not deep-copied again at save time.

    Orbax's NumpyHandler copies every numpy array it is given, in case the caller changes
    it during an async write. We hand it only arrays nobody changes meanwhile: packs and
    copies of the caller's numpy leaves made at staging time (async), views of immutable CPU
    jax.Arrays, or the caller's arrays during a write that finishes before write() returns
    (sync). A second copy would only double the staging time and the host memory.
    """
    return ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
        (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)),
    )


class OrbaxBackend:
    """Writes and reads JAX pytrees with Orbax (see the module docstring for the layout).

    Concurrency contract: ``write``, ``read`` and ``close`` are called from one thread (the
    training loop's); a handle's ``wait`` may run on another thread. Every error stays with
    the write it belongs to (its handle), never raised by a later call nor lost.
    Single process: async writes are queued on the backend's one writer thread and run in
    order; ``write`` returns once its arrays are staged, without waiting for earlier writes
    (a save that writes a changed auxiliary item and then the state stages both at once).
    Multi-process: Orbax's AsyncCheckpointer writes, one write at a time: a new ``write``
    first waits for the previous one; every process calls ``write``/``read`` with the same
    directory and tree, only process 0 writes tree.json, every process writes its shards.
    Across jobs: a directory is written once and never modified.
    """

    name = "orbax"
    supports_async = True
    #: read() accepts ``claims`` and checks the deferred checksums of what it reads itself.
    verifies_reads = True

    def __init__(self, *, use_ocdbt: bool = False, use_zarr3: bool = True,
                 use_compression: bool = False, async_timeout_s: int | None = None,
                 collective_timeout_s: float = 300.0, pause_gc: bool = True,
                 pack_leaf_bytes: int = DEFAULT_PACK_LEAF_BYTES,
                 pack_bytes: int = DEFAULT_PACK_BYTES, reuse_host_buffers: bool = True,
                 native_io: bool = True, direct_io: bool = True, io_threads: int = 4,
                 read_threads: int = 8):
        """
        Args:
          use_ocdbt: Orbax's OCDBT container format. Off: one zarr array per leaf was the
            fastest on CPU (FIELD_NOTES.md, docs/performance.md).
          use_zarr3: zarr v3 array format.
          use_compression: zstd compression; costs CPU and barely shrinks float weights.
          async_timeout_s: how long Orbax's background thread waits at its cross-process
            barriers; None keeps Orbax's default.
          collective_timeout_s: timeout of ``broadcast_int`` in multi-process runs.
          pause_gc: pause Python's cyclic GC during the blocking parts of write and read.
          pack_leaf_bytes: leaves of at most this many bytes are packed into a few arrays per
            dtype (see the module docstring); 0 writes every leaf as its own Orbax array.
          pack_bytes: the largest pack array, in bytes.
          reuse_host_buffers: keep the host buffers a save copies into (packs; numpy leaves
            of async saves) and copy into them again at the next save of the same layout.
            Fresh buffers cost page faults that take longer than the copy itself
            (docs/performance.md); the price is one host copy of those leaves held between
            saves. False allocates per save and frees after the write.
          native_io: single-process runs on a local filesystem write, and read back, the
            arrays with jaxckpt's own file I/O (``jaxckpt.zarr_io``) in the zarr3 layout
            Orbax + tensorstore produce, instead of through them: a third of the CPU per
            save, checksums computed on the way, no read-back at commit
            (docs/performance.md). The files are Orbax's: Orbax reads them, and arrays
            Orbax wrote are read natively when their layout is this one. (Large arrays
            may start a few bytes into their file, where their memory lines up with its
            blocks: ``zarr_io.data_offset``.) False: Orbax writes and reads everything,
            as with several processes.
          direct_io: with ``native_io``, move the bytes with ``O_DIRECT`` where the
            filesystem allows it (no copy through the page cache); False: buffered I/O.
          io_threads: threads that write array files in parallel with ``native_io``. Each
            checksums a piece (copied into its aligned buffer first where the array's
            memory does not line up with the file), then waits for the disk; four keep
            the disk busy (1 GiB: 0.73 s with 4, 0.80 s with 2, measured with every
            piece copied), and the training loop measured no dearer with 4 than with 2
            (docs/performance.md).
          read_threads: threads that read array files in parallel with ``native_io``. Each
            reads a piece, then checksums it: more reads in flight help a restore (1 GiB,
            medians of 10 alternating rounds: 0.51 s with 8, 0.54-0.61 s with 6, 0.61-0.93 s
            with 4; 0.64 s with 2), and nothing else runs then.
        """
        for field, value in (("pack_leaf_bytes", pack_leaf_bytes), ("pack_bytes", pack_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"OrbaxBackend({field}=...) must be an int >= 0 (bytes), got "
                                 f"{value!r}.")
        for field, value in (("io_threads", io_threads), ("read_threads", read_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"OrbaxBackend({field}=...) must be an int >= 1, got "
                                 f"{value!r}.")
        if pack_leaf_bytes > 0 and pack_bytes < pack_leaf_bytes:
            raise ValueError(f"OrbaxBackend(pack_bytes={pack_bytes}) must be at least "
                             f"pack_leaf_bytes={pack_leaf_bytes}: a pack holds leaves of up to "
                             "pack_leaf_bytes each. Raise pack_bytes or lower pack_leaf_bytes.")
        self._handler_options = dict(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3,
                                     use_compression=use_compression)
        self._collective_timeout_s = collective_timeout_s
        self._pause_gc = pause_gc
        self._pack_leaf_bytes = pack_leaf_bytes
        self._pack_bytes = pack_bytes
        self._reuse_host_buffers = reuse_host_buffers
        self._native_io = native_io
        self._direct_io = direct_io
        self._io_threads = io_threads
        self._read_threads = read_threads
        self._io_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._read_pool: concurrent.futures.ThreadPoolExecutor | None = None
        # (storage name, shape, dtype) -> [host buffer, the write that last used it]: a
        # buffer is refilled only once that write finished (see _stage_host).
        self._host_buffers: dict[tuple[str, tuple[int, ...], np.dtype],
                                 list[list[Any]]] = {}
        # Write plans of recent layouts, most recently used first: (key, plan); see _plan_for.
        self._plans: list[tuple[tuple[Any, ...], _WritePlan]] = []
        registry = _type_handler_registry()

        def checkpointer() -> ocp.Checkpointer:
            return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
                **self._handler_options, type_handler_registry=registry))

        # Separate checkpointers: a background write may still be busy while the sync one
        # writes or reads on the caller's thread.
        self._async = ocp.AsyncCheckpointer(
            ocp.PyTreeCheckpointHandler(**self._handler_options,
                                        type_handler_registry=registry),
            timeout_secs=async_timeout_s)
        self._sync = checkpointer()
        self._background = checkpointer()  # used only by self._writer's thread
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._versions: dict[str, str] | None = None
        self._lock = threading.Lock()
        self._pending: OrbaxWriteHandle | None = None  # Orbax's async write, multi-process
        self._queued: list[OrbaxWriteHandle] = []  # writer-thread writes not known done

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
        array, typed key or Python scalar (or a Python int outside int64). A save of a
        layout seen recently reuses its write plan (see the module docstring).
        """
        with _gc_paused(self._pause_gc):
            leaves, treedef = jax.tree_util.tree_flatten(state)
            if nnx_live.holds_live(state, treedef):
                # Live NNX objects are written as their nnx.State (jaxckpt.nnx_live).
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
            return self._write_staged(directory, plan, sources, asynchronous=asynchronous,
                                      local=local)

    def _plan_for(self, state: Any, treedef: Any, leaves: list[Any],
                  local: bool) -> _WritePlan:
        """The write plan of ``state``: the one of an earlier save with the same layout
        (tree structure, leaf types, shapes, dtypes), else a new one.

        Only single-process runs reuse plans: there a plan follows from the layout alone.
        With several processes it also depends on which arrays this process holds entirely
        (only those go into packs), a property of each array's sharding that the layout
        key does not capture; those saves plan afresh, as every save did before.
        """
        settings = dict(leaf_limit=self._pack_leaf_bytes, pack_limit=self._pack_bytes)
        if not local:
            return _build_plan(state, local=False, **settings)
        try:
            key = (self._pack_leaf_bytes, self._pack_bytes, *_layout_key(treedef, leaves))
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

    def _write_staged(self, directory: str, plan: _WritePlan, sources: list[Any], *,
                      asynchronous: bool, local: bool) -> OrbaxWriteHandle:
        """The part of write() after planning: stage the host arrays, create the directory,
        write (sync) or hand the write to a background thread (async)."""
        tree_json, nbytes = plan.tree_json, plan.nbytes
        root = epath.Path(directory)
        with self._lock:
            if not local:
                self._drain_locked()
            self._queued = [queued for queued in self._queued if not queued.done()]
            arrays, used = self._stage_host(plan, sources, copy_numpy=asynchronous)
            primary = jax.process_index() == 0
            if primary:
                self._create_directory(root, directory)
            if not arrays or not asynchronous or not local:
                if primary:
                    _write_durably(root / _TREE_FILE, tree_json)
            if not arrays:  # Orbax refuses an empty tree; tree.json alone describes it.
                return OrbaxWriteHandle(None, directory, nbytes)
            native = self._writes_natively(directory, arrays)
            save_args = None if native else ocp.args.PyTreeSave(item=arrays)
            if not asynchronous:
                if native:
                    return OrbaxWriteHandle(None, directory, nbytes,
                                            checksums=self._write_native(root, arrays))
                self._sync.save(root / _ARRAYS_DIR, args=save_args)
                return OrbaxWriteHandle(None, directory, nbytes)
            if local:
                if self._writer is None:
                    self._writer = concurrent.futures.ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="jaxckpt-orbax-write")
                work = (functools.partial(self._write_local_native, root, tree_json, arrays)
                        if native else
                        functools.partial(self._write_local, root, tree_json, save_args))
                handle = OrbaxWriteHandle(self, directory, nbytes, self._writer.submit(work))
                self._queued.append(handle)
            else:
                # Orbax's save() returns once the arrays are staged in host memory and
                # continues writing in its own background thread.
                self._async.save(root / _ARRAYS_DIR, args=save_args)
                handle = OrbaxWriteHandle(self, directory, nbytes)
                self._pending = handle
            for slot in used:
                slot[1] = handle  # these buffers are busy until this write finished
            return handle

    def _write_local(self, root: epath.Path, tree_json: str, save_args: Any) -> None:
        """The background half of a single-process async write (the writer thread).

        Why not Orbax's AsyncCheckpointer here: its save() spends 10-20 ms on the caller's
        thread per call (an event loop, several new threads, futures) even when there is
        nothing to copy, and that is the training loop's time. Everything it would stage is
        already staged by _stage_host (host arrays: packs, copies of numpy leaves, and views
        of immutable CPU jax.Arrays, which also make jax skip donating those buffers), so a
        plain synchronous save on this thread writes the same files.
        """
        _write_durably(root / _TREE_FILE, tree_json)
        self._background.save(root / _ARRAYS_DIR, args=save_args)

    def _native_here(self, directory: str) -> bool:
        """Whether ``native_io`` applies to ``directory``: a single process, a local path."""
        return self._native_io and jax.process_count() == 1 and "://" not in directory

    def _writes_natively(self, directory: str, arrays: dict[str, Any]) -> bool:
        """Whether this write goes through zarr_io: ``_native_here``, and every array of a
        dtype and size it stores as Orbax would."""
        return self._native_here(directory) and all(
            isinstance(array, np.ndarray) and zarr_io.supported(array)
            for array in arrays.values())

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._io_pool is None:
            self._io_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self._io_threads, thread_name_prefix="jaxckpt-io")
        return self._io_pool

    def _readers(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._read_pool is None:
            self._read_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self._read_threads, thread_name_prefix="jaxckpt-read")
        return self._read_pool

    def _write_local_native(self, root: epath.Path, tree_json: str,
                            arrays: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
        """The writer thread's half of a single-process async write through zarr_io."""
        _write_durably(root / _TREE_FILE, tree_json)
        return self._write_native(root, arrays)

    def _write_native(self, root: epath.Path,
                      arrays: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
        """Write ``arrays`` as the Orbax checkpoint ``root/arrays`` with zarr_io: the same
        files PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True) writes. Array files
        are durable on return; the small metadata files are left to the commit's fsync.
        Like Orbax, writes under a temporary name renamed into place at the end, so that
        ``arrays/`` exists only complete (a failed write removes what it wrote).
        Returns the manifest entries of the array files, relative to ``root``."""
        final = os.path.join(os.fspath(root), _ARRAYS_DIR)
        base = f"{final}.tmp-{os.getpid()}-{time.time_ns()}"
        started_ns = time.time_ns()
        os.mkdir(base)
        try:
            entries = self._write_native_into(base, final, arrays, started_ns)
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)
            raise
        os.rename(base, final)
        return entries

    def _write_native_into(self, base: str, final: str, arrays: dict[str, np.ndarray],
                           started_ns: int) -> dict[str, dict[str, Any]]:
        algorithm = default_algorithm()
        # Largest first, so that the threads finish together.
        jobs = sorted(arrays.items(), key=lambda job: -job[1].nbytes)

        def write(job: tuple[str, np.ndarray]) -> tuple[str, int, str]:
            # Each array's directories and zarr.json are made on the I/O threads too: a
            # mkdir or create takes 0.1-0.4 ms here, ~70 ms for 64 arrays, which on the
            # caller's thread delayed the first large write by as much.
            name, array = job
            relative = f"{name}/{zarr_io.chunk_relpath(array.ndim)}"
            chunk = os.path.join(base, *relative.split("/"))
            os.makedirs(os.path.dirname(chunk))
            # Large arrays start where their memory lines up with the file's blocks, and
            # are written from it without a copy (zarr_io.data_offset).
            offset = zarr_io.data_offset(array, base, direct=self._direct_io)
            _write_small(os.path.join(base, name, _ZARR_JSON),
                         zarr_io.metadata_text(array.shape, array.dtype.name, offset))
            size, crc = zarr_io.write_chunk(chunk, array, algorithm=algorithm,
                                            direct=self._direct_io, offset=offset)
            return relative, size, crc

        results = list(self._pool().map(write, jobs))
        _write_small(os.path.join(base, "_METADATA"), zarr_io.tree_metadata_text(list(arrays)))
        _write_small(os.path.join(base, "_CHECKPOINT_METADATA"),
                     zarr_io.checkpoint_metadata_text(started_ns, time.time_ns()))
        _write_small(os.path.join(base, "commit_success.txt"),
                     zarr_io.commit_success_text(final))
        return {f"{_ARRAYS_DIR}/{relative}": {"size": size, algorithm: crc}
                for relative, size, crc in results}

    def _stage_host(self, plan: _WritePlan, sources: list[Any], *,
                    copy_numpy: bool) -> tuple[dict[str, Any], list[list[Any]]]:
        """The flat ``{storage name: array}`` dict Orbax writes, and the reused-buffer slots
        it fills. Packs are filled; numpy leaves are copied when the caller may change them
        during the write (``copy_numpy``); the jax.Arrays the plan names come to the host
        (a view, no copy, on CPU: they are immutable), the others stay as they are. Caller
        holds ``self._lock``."""
        used: list[list[Any]] = []

        def buffer(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
            slots = self._host_buffers.setdefault((name, shape, dtype), [])
            for slot in slots:
                if slot[1] is None or slot[1].done():
                    break
            else:
                slot = [zarr_io.aligned_empty(shape, dtype), None]  # written without a copy
                if self._reuse_host_buffers:
                    slots.append(slot)
            used.append(slot)
            slot[1] = _STAGING  # not reusable within this write either
            return slot[0]

        # Device arrays come to the host in one batch (transfers started together), not one
        # blocking transfer per leaf; on CPU this copies nothing.
        host = list(sources)
        fetched = _host_arrays([sources[index] for index in plan.on_device])
        for index, array in zip(plan.on_device, fetched):
            host[index] = array
        arrays: dict[str, Any] = {}
        for name, (dtype, members, size) in plan.packs.items():
            pack = buffer(name, (_pack_length(size),), dtype)
            if size == 0:
                pack[...] = 0  # the padding of a pack of zero-size leaves only
            _fill_pack(pack[:size], [host[index] for index in members])
            arrays[name] = pack
        for index, name in plan.unpacked:
            source = sources[index]
            if copy_numpy and isinstance(source, np.ndarray):  # the caller's, mutable
                copy = buffer(name, source.shape, source.dtype)
                np.copyto(copy, source)
                arrays[name] = copy
            else:
                arrays[name] = host[index]
        # Buffers that neither this write nor one in flight uses are dropped: a layout that
        # changed must not pin memory for the rest of the run.
        taken = {id(slot) for slot in used}
        for key in list(self._host_buffers):
            slots = self._host_buffers[key]
            busy = [slot for slot in slots if id(slot) in taken or
                    (slot[1] is not None and not slot[1].done())]
            if busy:
                self._host_buffers[key] = busy
            else:
                del self._host_buffers[key]
        for slot in used:
            slot[1] = None  # a sync write is finished when write() returns
        return arrays, used

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
        """Wait for every write in flight (its outcome stays on its handle). Caller holds
        ``self._lock``."""
        queued, self._queued = self._queued, []
        for handle in queued:
            with contextlib.suppress(BaseException):
                handle.wait()  # noqa: BLE001 - the error belongs to whoever waits on it
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
            self._host_buffers.clear()
            self._plans.clear()
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            for pool in (self._io_pool, self._read_pool):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._io_pool = self._read_pool = None
            self._async.close()
            self._sync.close()
            self._background.close()

    # -------------------------------------------------------------------------- read

    def read(self, directory: str, like: Any, *, claims: ReadClaims | None = None) -> Any:
        """Read ``directory`` into the structure, shapes, dtypes and shardings of ``like``.

        A ``like`` holding live NNX objects (``jaxckpt.nnx_live``) is read into their
        current arrays' shapes, dtypes and shardings, and the result is a
        ``nnx_live.PendingUpdate``: :meth:`finish_read` puts the values into the objects,
        in place. The manager calls it once the checkpoint is judged valid, so a read it
        throws away never changes the caller's objects.
        """
        if nnx_live.holds_live(like):
            return nnx_live.read_into(
                like, lambda pure: self._read(directory, pure, claims=claims))
        return self._read(directory, like, claims=claims)

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

    def _read(self, directory: str, like: Any, *, claims: ReadClaims | None = None) -> Any:
        """Read ``directory`` into the structure, shapes, dtypes and shardings of ``like``
        (a tree without live NNX objects).

        Leaves are matched by tree path. Every mismatch (missing, extra, shape, dtype, key
        impl) is collected first and raised as one TreeMismatchError; no array is read
        then. jax.Array / ShapeDtypeStruct leaves come back as jax.Array on the like leaf's
        sharding (the default device when it has none), numpy leaves as numpy, Python
        scalars as the same Python type.

        ``claims`` (a restore's deferred checksums, ``store.ReadClaims``): the array files
        read with ``native_io`` are claimed and checksummed as they are read, so nobody
        reads them a second time to verify them; claims are closed before the bulk read.
        """
        root = epath.Path(directory)
        if not root.exists():
            raise CheckpointNotFoundError(f"no checkpoint at {directory}: the directory does "
                                          "not exist")
        saved = _read_tree_json(root, directory)

        targets, like_treedef = _like_targets(like)

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

        restore_args, placements, move_after = _restore_args(targets, saved)

        with _gc_paused(self._pause_gc):
            try:
                restored = None
                if self._native_here(directory):
                    restored = self._read_native(os.fspath(arrays_dir), restore_args, claims)
                if claims is not None:
                    claims.close()
                if restored is None:
                    restored = self._sync.restore(
                        arrays_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))
            except (CheckpointCorruptError, MemoryError, KeyboardInterrupt):
                raise
            except Exception as error:
                # Orbax and tensorstore report damaged metadata or chunks with their own
                # types (ValueError, UnicodeDecodeError, DATA_LOSS...): to the caller this is
                # one thing, a checkpoint that cannot be read, so recovery can fall back.
                raise CheckpointCorruptError(
                    f"{directory}: array data cannot be read ({type(error).__name__}: "
                    f"{error}). The checkpoint is damaged; restore another one "
                    f"(recover() falls back to the previous valid checkpoint).") from error
            values = self._unpack(directory, targets, saved, restored, placements)

        leaves = []
        for (path, target), value in zip(targets, values):
            entry = saved[path]
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

    def _read_native(self, base: str, restore_args: dict[str, Any],
                     claims: ReadClaims | None) -> dict[str, Any] | None:
        """What ``self._sync.restore`` returns for ``restore_args``, read with zarr_io; None
        (before any bulk read) when some array is not stored in zarr_io's layout or not as
        tree.json says (Orbax then reads everything and reports what is wrong).

        Claims the deferred checks of the files it reads (see ``read``), then reads them on
        the I/O threads into aligned buffers: jax adopts those without a copy on CPU.
        """
        plans: list[tuple[str, tuple[int, ...], np.dtype, int, Any, str]] = []
        for name, args in restore_args.items():
            if not _STORAGE_NAME.match(name):
                return None
            try:
                with open(os.path.join(base, name, _ZARR_JSON), "rb") as stream:
                    parsed = zarr_io.parse_metadata(stream.read(1 << 16))
            except OSError:
                return None
            if parsed is None:
                return None
            shape, dtype, offset = parsed
            if isinstance(args, ocp.ArrayRestoreArgs) and (
                    tuple(args.global_shape) != shape or np.dtype(args.dtype) != dtype):
                return None
            plans.append((name, shape, dtype, offset, args,
                          os.path.join(base, name, *zarr_io.chunk_relpath(len(shape)).split("/"))))
        expected: dict[str, str] = {}
        if claims is not None:
            for *_, file in plans:
                claimed = claims.claim(file)
                if claimed is not None:
                    expected[file] = claimed[0]
            claims.close()

        def read(plan: tuple[str, tuple[int, ...], np.dtype, int, Any, str]) -> np.ndarray:
            _, shape, dtype, offset, _, file = plan
            nbytes = prod(shape) * dtype.itemsize
            algorithm = expected.get(file)
            content, checksum = zarr_io.read_chunk(file, nbytes, algorithm=algorithm,
                                                   direct=self._direct_io, offset=offset)
            if claims is not None and algorithm is not None:
                claims.settle(file, checksum)
            return zarr_io.array_bytes(file, content, nbytes, offset).view(dtype).reshape(shape)

        plans.sort(key=lambda plan: -prod(plan[1]) * plan[2].itemsize)  # largest first
        arrays = list(self._readers().map(read, plans))
        restored: dict[str, Any] = {}
        placed: list[tuple[str, np.ndarray, Any]] = []
        for (name, _, _, _, args, _), array in zip(plans, arrays):
            if isinstance(args, ocp.ArrayRestoreArgs):
                placed.append((name, array, args.sharding))
            else:
                restored[name] = array
        if placed:
            # One batched transfer; on CPU jax adopts the aligned buffers as they are.
            values = jax.device_put([array for _, array, _ in placed],
                                    [sharding for _, _, sharding in placed])
            restored.update((name, value) for (name, _, _), value in zip(placed, values))
        return restored

    @staticmethod
    def _unpack(directory: str, targets: list[tuple[str, _Target]],
                saved: dict[str, _SavedLeaf], restored: dict[str, Any],
                placements: dict[str, jax.sharding.Sharding]) -> list[Any]:
        """The stored data of every target, in order: unpacked leaves as Orbax restored them;
        packed ones cut out of their pack, arrays stored as bytes viewed as their dtype, and
        those two, for jax targets, placed on their sharding."""
        for name, pack in restored.items():
            if name.startswith(_PACK_PREFIX) and np.ndim(pack) != 1:
                raise CheckpointCorruptError(
                    f"{directory}/{_ARRAYS_DIR}/{name} has shape {np.shape(pack)}, not the "
                    "1-D pack tree.json describes. Fix: restore an older checkpoint.")
        values: list[Any] = []
        batch_slots: list[int] = []
        batch_data: list[np.ndarray] = []
        batch_shardings: list[jax.sharding.Sharding] = []
        for slot, (path, target) in enumerate(targets):
            entry = saved[path]
            if entry.packed:
                data = OrbaxBackend._cut(directory, path, entry, restored[entry.name])
            elif entry.as_bytes:
                data = np.asarray(restored[entry.name])
                if data.shape != entry.stored_shape or data.dtype != entry.stored_dtype:
                    raise CheckpointCorruptError(
                        f"{directory}/{_ARRAYS_DIR}/{entry.name} holds {data.shape} "
                        f"{data.dtype}, not the bytes of leaf {path} ({entry.stored_shape} "
                        "uint8). Fix: restore an older checkpoint.")
            else:
                values.append(restored[entry.name])
                continue
            if entry.as_bytes:
                data = _from_bytes(data, entry)
            if target.target != "jax":
                # A copy: a view would keep the whole pack alive as long as this leaf.
                values.append(data.copy() if target.target == "numpy" else data)
                continue
            sharding = placements[path]
            if sharding.is_fully_addressable:
                batch_slots.append(slot)
                batch_data.append(data)
                batch_shardings.append(sharding)
                values.append(None)
            else:  # spans processes: every process holds the pack, each places its shards
                values.append(jax.make_array_from_callback(
                    data.shape, sharding, lambda index, data=data: data[index]))
        # One batched transfer for all packed leaves instead of one call per leaf.
        for slot, value in zip(batch_slots, jax.device_put(batch_data, batch_shardings)):
            values[slot] = value
        return values

    @staticmethod
    def _cut(directory: str, path: str, entry: _SavedLeaf, pack: np.ndarray) -> np.ndarray:
        """The stored data of the packed leaf ``entry`` (a view into its pack)."""
        count = int(np.prod(entry.stored_shape, dtype=np.int64))
        if entry.offset + count > pack.shape[0] or pack.dtype != entry.stored_dtype:
            raise CheckpointCorruptError(
                f"{directory}: leaf {path} lies outside its pack {entry.name} (elements "
                f"{entry.offset}..{entry.offset + count} of {pack.shape[0]}, dtype "
                f"{entry.stored_dtype} vs {pack.dtype}). Fix: restore an older checkpoint.")
        return pack[entry.offset:entry.offset + count].reshape(entry.stored_shape)

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
        """Versions of the libraries a checkpoint is written with (flax when installed).

        Looked up once: the metadata lookups cost ~2 ms, and the manager asks at every save
        on the training thread."""
        if self._versions is not None:
            return dict(self._versions)
        found = {"jax": jax.__version__}
        for package in ("jaxlib", "orbax-checkpoint", "flax"):
            try:
                found[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                pass
        self._versions = found
        return dict(found)

    def rng_state(self) -> None:
        """JAX has no global RNG: keys are ordinary leaves of the state."""
        return None

    def set_rng_state(self, state: Any) -> None:
        """Nothing to restore (see :meth:`rng_state`)."""
        return None


def _restore_args(targets: list[tuple[str, _Target]], saved: dict[str, _SavedLeaf],
                  ) -> tuple[dict[str, Any], dict[str, jax.sharding.Sharding],
                             dict[str, jax.sharding.Sharding]]:
    """What to ask Orbax (or zarr_io) for: restore args by storage name; where each jax
    leaf's stored data goes (for keys: the key_data's sharding); and the keys whose
    key_data sharding cannot be derived (restored, then moved onto their sharding)."""
    default_sharding = None
    restore_args: dict[str, Any] = {}
    # Where each jax leaf's stored data goes (for keys: the key_data's sharding).
    placements: dict[str, jax.sharding.Sharding] = {}
    # Keys whose key_data sharding we cannot derive: restored, then moved onto it.
    move_after: dict[str, jax.sharding.Sharding] = {}
    for path, target in targets:
        entry = saved[path]
        # Packs and arrays stored as bytes come to the host first; each leaf is cut
        # out (or viewed as its dtype) there, then placed.
        if entry.packed or entry.as_bytes:
            restore_args[entry.name] = ocp.RestoreArgs(restore_type=np.ndarray)
        if target.target != "jax":
            if not entry.packed:
                restore_args[entry.name] = ocp.RestoreArgs(restore_type=np.ndarray)
            continue
        sharding = target.sharding
        if sharding is None:
            if default_sharding is None:
                default_sharding = jax.device_put(np.zeros((), np.int8)).sharding
            sharding = default_sharding
        if entry.kind == "key":
            data_sharding = _key_data_sharding(sharding, len(target.shape),
                                               len(entry.stored_shape) - len(target.shape))
            if data_sharding is None:
                move_after[path] = sharding
                if default_sharding is None:
                    default_sharding = jax.device_put(np.zeros((), np.int8)).sharding
                data_sharding = default_sharding
            sharding = data_sharding
        placements[path] = sharding
        if not (entry.packed or entry.as_bytes):
            restore_args[entry.name] = ocp.ArrayRestoreArgs(
                sharding=sharding, global_shape=entry.stored_shape,
                dtype=entry.stored_dtype)
    return restore_args, placements, move_after


def _like_targets(like: Any) -> tuple[list[tuple[str, _Target]], Any]:
    """``(tree path, what the leaf asks for)`` of every leaf of ``like``, and its treedef;
    TypeError listing every leaf that describes no array."""
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
    return targets, like_treedef


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


def _tree_json(entries: list[_SavedLeaf], packs: list[dict[str, Any]]) -> str:
    """tree.json's text: one leaf per line, so that it stays readable and diffable.

    Built from per-line ``json.dumps`` calls, which use the C encoder: ``indent=`` switches
    the whole document to the pure-Python encoder, 0.4 s for 10,000 leaves.
    """
    version = (TREE_FORMAT_VERSION if any(entry.as_bytes for entry in entries) else
               _PACKED_TREE_VERSION if packs else _UNPACKED_TREE_VERSION)
    lines = [f'{{"format": {json.dumps(TREE_FORMAT)}, "version": {version},']
    if packs:
        lines.append(' "packs": [' + ",\n  ".join(json.dumps(p) for p in packs) + "],")
    lines.append(' "leaves": [')
    lines.append(",\n".join("  " + json.dumps(entry.to_json()) for entry in entries))
    lines.append(" ]}")
    return "\n".join(lines) + "\n"


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
            raise CheckpointFormatError(
                f"{directory}/{_TREE_FILE} is unreadable: version {document['version']} is newer "
                f"than this jaxckpt reads ({TREE_FORMAT_VERSION}); upgrade jaxckpt")
        entries = [_SavedLeaf.from_json(entry) for entry in document["leaves"]]
        for entry in entries:
            # A storage name becomes a path under arrays/: only names this backend makes.
            if not isinstance(entry.name, str) or not _STORAGE_NAME.match(entry.name):
                raise ValueError(f"leaf {entry.path!r} has storage name {entry.name!r}, which is "
                                 "not one this backend writes (leaf_N or pack_DTYPE_N); "
                                 "refusing a name that could point outside the checkpoint")
        _check_packs(entries, document.get("packs") or [])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointCorruptError(f"{directory}/{_TREE_FILE} is unreadable: {error}") \
            from error
    return {entry.path: entry for entry in entries}


def _check_packs(entries: list[_SavedLeaf], packs: list[dict[str, Any]]) -> None:
    """Every packed leaf names a listed pack of its stored dtype and lies inside it."""
    listed: dict[str, tuple[np.dtype, int]] = {}
    for pack in packs:
        name, size = pack["name"], pack["size"]
        if not isinstance(name, str) or not name.startswith(_PACK_PREFIX) or not _STORAGE_NAME.match(name):
            raise ValueError(f"pack name {name!r} is not a pack name this backend writes")
        if type(size) is not int or size < 0:
            raise ValueError(f"pack {name} has size {size!r}, not an integer >= 0")
        listed[name] = (np.dtype(pack["dtype"]), size)
    for entry in entries:
        if not entry.packed:
            continue
        if entry.name not in listed:
            raise ValueError(f"leaf {entry.path} is packed into {entry.name}, which is not in "
                             "the list of packs")
        dtype, size = listed[entry.name]
        count = int(np.prod(entry.stored_shape, dtype=np.int64))
        if dtype != entry.stored_dtype or entry.offset + count > size:
            raise ValueError(f"leaf {entry.path} ({count} x {entry.stored_dtype} at element "
                             f"{entry.offset}) does not fit pack {entry.name} ({size} x {dtype})")


def _write_small(path: str, text: str) -> None:
    """A small metadata file next to array files: no fsync of its own (the commit fsyncs
    every file of a checkpoint)."""
    with open(path, "x", encoding="utf-8") as stream:
        stream.write(text)


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
