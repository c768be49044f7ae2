"""Write plans: where each leaf of a state goes, and the packing of small leaves.

Owns: what a write derives from the state's layout rather than its values
(:class:`WritePlan`, by :func:`build_plan`): the tree.json text, which leaf is an Orbax
array of its own and which goes into a pack (``pack_float32_000``, 1-D per dtype) at which
offset, how each leaf's data is fetched; and :func:`layout_key`, by which plans are reused.
Packs exist because Orbax's cost per leaf is fixed (docs/design.md, Measured facts): leaves
of at most ``pack_leaf_bytes`` held whole by this process are packed; reads cut them out by
tree path, so matching and errors are those of unpacked leaves.

Must not import: orbax, torch. No I/O.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from math import prod
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxckpt.backends.orbax.tree import (
    PACK_PREFIX,
    PY_SCALAR_CLASSES,
    Layout,
    TreeLines,
    bytes_of,
    check_int64,
    classify_leaf,
    dtype_name as name_of_dtype,
    jax_dtype_kind,
    plain_paths,
)

#: Where a packed leaf's data starts in its pack, in bytes: a multiple of this. On CPU,
#: jax adopts host memory aligned to 64 bytes without a copy, so a restore turns each
#: leaf cut out of its pack into a jax.Array in a fraction of the time a copy takes.
#: The padding costs at most 63 bytes a leaf.
PACK_ALIGN = 64


class Pack(NamedTuple):
    """One pack of a write."""

    dtype: np.dtype
    members: list[int]
    """Leaf indices, in pack order."""
    size: int
    """Elements used, padding included (the array holds ``pack_length(size)``)."""
    gaps: list[int]
    """Padding elements before each member (aligning it to ``PACK_ALIGN`` bytes)."""


#: The packs of a write, by pack name.
Packs = dict[str, Pack]


def _align_elements(dtype: np.dtype) -> int:
    """The element multiple a packed leaf of ``dtype`` starts at (1: no alignment, for
    itemsizes that do not divide ``PACK_ALIGN``)."""
    itemsize = dtype.itemsize
    return PACK_ALIGN // itemsize if itemsize and PACK_ALIGN % itemsize == 0 else 1


def plan_packs(candidates: list[tuple[int, np.dtype, int]],
               pack_limit: int) -> tuple[Packs, dict[int, tuple[str, int]]]:
    """Assign the leaves that go into packs to packs.

    ``candidates`` are ``(leaf index, stored dtype, element count)`` in tree order. Returns
    the packs and, per packed leaf index, its ``(pack name, element offset)``. Leaves are
    grouped by stored dtype, in tree order; each starts at a multiple of ``PACK_ALIGN``
    bytes (zero-size leaves wherever they fall), and a pack is closed before it would
    exceed ``pack_limit`` bytes (a single leaf larger than that still gets a pack of its
    own).
    """
    by_dtype: dict[str, list[tuple[int, np.dtype, int]]] = {}
    for candidate in candidates:
        by_dtype.setdefault(name_of_dtype(candidate[1]), []).append(candidate)
    packs: Packs = {}
    placements: dict[int, tuple[str, int]] = {}
    for dtype_name, members in by_dtype.items():
        dtype = np.dtype(dtype_name)
        align = _align_elements(dtype)
        number = 0
        name = f"{PACK_PREFIX}{dtype_name}_{number:03d}"
        indices: list[int] = []
        gaps: list[int] = []
        size = 0
        for index, _, count in members:
            gap = -size % align if count else 0
            if indices and (size + gap + count) * dtype.itemsize > pack_limit:
                packs[name] = Pack(dtype, indices, size, gaps)
                number += 1
                name = f"{PACK_PREFIX}{dtype_name}_{number:03d}"
                indices, gaps, size, gap = [], [], 0, 0
            placements[index] = (name, size + gap)
            indices.append(index)
            gaps.append(gap)
            size += gap + count
        packs[name] = Pack(dtype, indices, size, gaps)
    return packs, placements


def pack_length(size: int) -> int:
    """Elements of the array that holds a pack of ``size`` elements: a pack of zero-size
    leaves only holds one element of padding, as Orbax refuses to store an empty array."""
    return max(size, 1)


def fill_pack(buffer: np.ndarray, pack: Pack, sources: list[np.ndarray]) -> None:
    """Copy ``sources`` (host numpy arrays of ``pack.members``, in pack order) into
    ``buffer`` (``pack.size`` elements), zeros in the gaps: one copy call whatever the
    number of leaves."""
    if not any(pack.gaps):
        np.concatenate(sources, axis=None, out=buffer)  # axis=None: flattened, in C order
        return
    zeros = np.zeros(_align_elements(pack.dtype), pack.dtype)
    pieces: list[np.ndarray] = []
    for gap, source in zip(pack.gaps, sources, strict=True):
        if gap:
            pieces.append(zeros[:gap])
        pieces.append(source)
    np.concatenate(pieces, axis=None, out=buffer)


# ---------------------------------------------------------------------------- write plans



@dataclass(frozen=True, slots=True, eq=False)
class WritePlan:
    """Everything a write derives from the state's layout rather than from its values:
    the tree.json text, which leaf is stored where (its own Orbax array, or a pack and an
    offset), and how each leaf's data is fetched. Built by :func:`build_plan`, which
    validates every leaf; a plan therefore only exists for a layout that can be written."""

    tree_json: str
    """tree.json's full text."""
    nbytes: int
    """Bytes of array data (stored sizes) plus tree.json's length: the handle's ``nbytes``."""
    packs: Packs
    """The packs by name: dtype, leaf indices in pack order, size, alignment gaps."""
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

    def file_sources(self, sources: list[Any]) -> dict[str, tuple[Any, ...]]:
        """By storage name, the ``sources`` whose bytes make up that name's chunk file (an
        array of its own, or a pack's members in pack order)."""
        found = {name: (sources[index],) for index, name in self.unpacked}
        for name, pack in self.packs.items():
            found[name] = tuple(sources[index] for index in pack.members)
        return found

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
                check_int64(int_path, leaves[index])
            sources[index] = np.asarray(leaves[index], dtype)
        for index in self.as_bytes:
            sources[index] = bytes_of(np.asarray(leaves[index]))
        for index, shape, dtype in self.empty:
            sources[index] = np.empty(shape, dtype)
        return sources


def build_plan(state: Any, *, leaf_limit: int, pack_limit: int, local: bool,
               leaves: list[Any] | None = None) -> WritePlan:
    """The write plan of ``state``, from scratch: its tree paths, every leaf classified and
    validated (TypeError / ValueError naming the path, before any I/O), the packs planned.
    ``local``: a single process, which holds every array entirely and hands Orbax host
    arrays only. ``leaves``: ``jax.tree_util.tree_flatten(state)``'s, where the caller
    has them (flattened here otherwise)."""
    if leaves is None:
        leaves = jax.tree_util.tree_leaves(state)
    paths = plain_paths(state, leaves)
    if paths is None:  # a tree of other nodes: jax's walk
        path_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        paths = [jax.tree_util.keystr(key_path) for key_path, _ in path_leaves]
        leaves = [leaf for _, leaf in path_leaves]
    if len(set(paths)) != len(paths):
        _refuse_shared_paths(paths)
    leaf_plan = _LeafPlan()
    leaf_plan.classify(paths, leaves, leaf_limit=leaf_limit, local=local)
    packs, placements = plan_packs(leaf_plan.candidates, pack_limit)
    lines = TreeLines()
    unpacked: list[tuple[int, str]] = []
    for index, (path, layout) in enumerate(zip(paths, leaf_plan.layouts, strict=True)):
        placed = placements.get(index)
        if placed is None:
            name = f"leaf_{index:06d}"
            unpacked.append((index, name))
            lines.add(path, name, None, layout)
        else:
            lines.add(path, placed[0], placed[1], layout)
    tree_json = lines.text([{"name": name, "dtype": pack.dtype.name,
                             "size": pack_length(pack.size)} for name, pack in packs.items()])
    return WritePlan(tree_json=tree_json, nbytes=len(tree_json) + leaf_plan.stored_bytes,
                     packs=packs, unpacked=unpacked, on_device=leaf_plan.on_device,
                     keys=leaf_plan.keys, numpy=leaf_plan.numpy, scalars=leaf_plan.scalars,
                     empty=leaf_plan.empty, as_bytes=leaf_plan.as_bytes)


def _refuse_shared_paths(paths: list[str]) -> None:
    seen: set[str] = set()
    for path in paths:
        if path in seen:
            raise ValueError(f"two leaves of the state share the tree path {path}; "
                             "paths must be unique to be matched on restore")
        seen.add(path)


class _LeafPlan:
    """What ``build_plan`` learns of each leaf: its layout, where its data comes from, and
    whether it may go into a pack. Used once, by one thread."""

    def __init__(self) -> None:
        self.layouts: list[Layout] = []
        self.candidates: list[tuple[int, np.dtype, int]] = []  # leaves a pack may take
        self.stored_bytes = 0
        self.on_device: list[int] = []
        self.keys: list[int] = []
        self.numpy: list[int] = []
        self.scalars: list[tuple[int, np.dtype, str | None]] = []
        self.empty: list[tuple[int, tuple[int, ...], np.dtype]] = []
        self.as_bytes: list[int] = []

    def classify(self, paths: list[str], leaves: list[Any], *, leaf_limit: int,
                 local: bool) -> None:
        # The usual leaf, a jax.Array of a dtype Orbax stores, spelled out: this loop runs
        # once per leaf, and classify_leaf's checks cost microseconds each.
        is_array: dict[type, bool] = {}  # isinstance(leaf, jax.Array), per class
        stored_as_is: dict[Any, tuple[str, np.dtype] | None] = {}  # per jax dtype
        layouts, new = self.layouts, tuple.__new__
        for index, leaf in enumerate(leaves):
            cls = leaf.__class__
            array = is_array.get(cls)
            if array is None:
                array = is_array[cls] = isinstance(leaf, jax.Array)
            if array:
                dtype = leaf.dtype
                if dtype in stored_as_is:
                    as_is = stored_as_is[dtype]
                else:
                    as_is = stored_as_is[dtype] = (
                        (name_of_dtype(dtype), np.dtype(dtype))
                        if jax_dtype_kind(dtype) == "array" else None)
                if as_is is not None:
                    shape = tuple(leaf.shape)
                    layouts.append(new(Layout, ("array", shape, as_is[0], None, None, None,
                                                None)))
                    self._place(index, leaf, shape, as_is[1], False, leaf_limit, local)
                    continue
            self._classify_one(index, paths[index], leaf, leaf_limit, local)

    def _classify_one(self, index: int, path: str, leaf: Any, leaf_limit: int,
                      local: bool) -> None:
        """Any leaf (``classify_leaf``)."""
        layout, data = classify_leaf(path, leaf)
        self.layouts.append(layout)
        if layout.kind == "key":
            self.keys.append(index)
            stored_shape, dtype = layout.data_shape, np.dtype(layout.data_dtype)
        elif layout.data_dtype is not None:  # stored as its bytes
            self.as_bytes.append(index)
            stored_shape, dtype = layout.data_shape, np.dtype(layout.data_dtype)
        else:
            stored_shape, dtype = layout.shape, np.dtype(data.dtype)
            if layout.kind == "scalar":
                self.scalars.append((index, dtype,
                                     path if layout.python_type == "int" else None))
            elif isinstance(data, np.ndarray):
                self.numpy.append(index)
        assert stored_shape is not None  # keys and arrays stored as bytes carry data_shape
        self._place(index, data, stored_shape, dtype, isinstance(data, np.ndarray),
                    leaf_limit, local)

    def _place(self, index: int, data: Any, stored_shape: tuple[int, ...], dtype: np.dtype,
               on_host: bool, leaf_limit: int, local: bool) -> None:
        """Whether the leaf may go into a pack, and whether its data comes to the host."""
        # Sizes from the shape: jax.Array's size and nbytes properties cost microseconds.
        count = prod(stored_shape)
        nbytes = count * dtype.itemsize
        self.stored_bytes += nbytes
        if count == 0:
            # Orbax refuses zero-size arrays ("Cannot save arrays with zero size") and
            # there is nothing to store: tree.json's shape and dtype say it all. Such a
            # leaf goes into a pack at any offset, from an empty host array (no transfer,
            # whichever process holds it).
            self.empty.append((index, tuple(stored_shape), dtype))
            self.candidates.append((index, dtype, 0))
            return
        # Small leaves this process holds entirely go into packs. An array sharded across
        # processes is written shard by shard by Orbax instead; with a single process every
        # array is held entirely, and asking would cost microseconds per leaf.
        packable = 0 < leaf_limit and nbytes <= leaf_limit and (
            local or on_host or data.is_fully_addressable)
        if packable:
            self.candidates.append((index, dtype, count))
        # jax data comes to the host to be packed, and in a single process to be written.
        if not on_host and (packable or local):
            self.on_device.append(index)


def layout_key(treedef: Any, leaves: list[Any]) -> tuple[Any, ...]:
    """What a write plan depends on besides the backend's pack settings: the tree structure
    and, per leaf, its type, shape and dtype (a typed key's dtype names its impl; a Python
    scalar's type alone fixes its layout). Cheap next to building a plan: no tree paths, no
    classification. Raises (AttributeError) for a leaf without shape or dtype; no plan
    exists for such a leaf.

    The structure is both the treedef and its text. Treedefs tell node types apart by
    identity, which the text (type names) does not; but they compare dict keys with ``==``:
    ``{1: x}``, ``{True: x}`` and ``{np.int64(1): x}`` have equal treedefs and the tree paths
    ``[1]``, ``[True]`` and ``[np.int64(1)]``, which only the text tells apart."""
    classes = tuple(map(type, leaves))
    arrays = leaves if PY_SCALAR_CLASSES.isdisjoint(classes) else [
        leaf for leaf, cls in zip(leaves, classes, strict=True) if cls not in PY_SCALAR_CLASSES]
    # Three tuples, not one per leaf: the key lives as long as its plan, and a tuple per
    # leaf was that many more objects for every collection of the GC to walk.
    shapes = tuple(map(_SHAPE, arrays))
    dtypes = tuple(map(_DTYPE, arrays))
    # Cheapest comparisons first: a key that differs mostly differs early.
    return classes, shapes, dtypes, str(treedef), treedef


_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")

