"""tree.json: the record of every saved leaf of an Orbax-backend checkpoint, and the leaves.

Owns: the names of the files and directories the Orbax backend writes inside a checkpoint's
state directory (``tree.json``, ``arrays/``, storage names), the format of ``tree.json``
(its text, its parsing and checks), what it records of one leaf (:class:`SavedLeaf`), and
how a state leaf is classified into that record (:func:`classify_leaf`): array, typed PRNG
key or Python scalar, and arrays of dtypes Orbax has no type for kept as their bytes; and
the tree paths leaves are recorded and matched by (``plain_paths``: trees of plain
containers without jax's walk).

Must not import: orbax, torch. Writes nothing; reads only ``tree.json``.
"""

from __future__ import annotations

import functools
import json
import re
from math import prod
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath

from jaxckpt.core.layout import TREE_FILE
from jaxckpt.core.tree_record import (
    PACKED_TREE_VERSION,
    TREE_FORMAT,
    TREE_FORMAT_VERSION,
    UNPACKED_TREE_VERSION,
    parse_tree_record,
)
from jaxckpt.errors import CheckpointCorruptError, CodecError

ARRAYS_DIR = "arrays"
ZARR_JSON = "zarr.json"
PACK_PREFIX = "pack_"
#: The only storage names written: leaf_000017, pack_float32_000 (never a path).
# numpy dtype names have underscores of their own (float8_e4m3fn), never '/' or '.'.
STORAGE_NAME = re.compile(r"^(leaf_\d{1,12}|pack_[a-z0-9_]{1,32}_\d{1,9})$")

# Python scalar types we store, by the name recorded in tree.json. bool comes first in
# the lookups below because bool is a subclass of int.
PY_SCALAR_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float}
PY_SCALAR_DTYPES = {"bool": np.dtype(np.bool_), "int": np.dtype(np.int64),
                    "float": np.dtype(np.float64)}
PY_SCALAR_CLASSES = frozenset(PY_SCALAR_TYPES.values())
# Which numpy dtype kinds a 0-d saved leaf may have to restore into a Python scalar like.
PY_SCALAR_DTYPE_KINDS = {"bool": "b", "int": "iu", "float": "f"}


# Both are asked once per leaf and are Python code (numpy's dtype.name and issubdtype):
# uncached, thousands of leaves made them a visible part of every save's blocking time.
# A state has a handful of distinct dtypes.
@functools.lru_cache(maxsize=256)
def is_key_dtype(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.lru_cache(maxsize=256)
def dtype_name(dtype: Any) -> str:
    # Key dtypes are not numpy dtypes; their str is e.g. "key<fry>" and differs per impl.
    return str(dtype) if is_key_dtype(dtype) else np.dtype(dtype).name


@functools.lru_cache(maxsize=256)
def jax_dtype_kind(dtype: Any) -> str:
    """How a jax.Array of ``dtype`` is stored: "key" (its key data), "array" (a dtype Orbax
    stores) or "bytes". Asked per leaf at a save that builds a plan; a state has a handful
    of dtypes, and numpy's ``dtype.name`` and jax's ``issubdtype`` cost microseconds."""
    if is_key_dtype(dtype):
        return "key"
    return "array" if np.dtype(dtype).name in STORABLE_DTYPES else "bytes"


@functools.lru_cache(maxsize=256)
def _stored_dtype(name: str | None) -> np.dtype:
    # Asked per leaf on every read (~1 us uncached); a state has a handful of dtypes.
    return np.dtype(name)


# --------------------------------------------------------------------------- saved leaves

_new_tuple = tuple.__new__


class SavedLeaf(NamedTuple):
    """One entry of tree.json. A named tuple rather than a frozen dataclass: a restore makes
    one per saved leaf, and a tuple is made in a fraction of the time (many small leaves:
    benchmarks/results/leaves-cost_cpu2core_2026-11-25.md)."""

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
        return _stored_dtype(self.data_dtype if self.kind == "key" or self.as_bytes
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
    def from_json(cls, entry: dict[str, Any]) -> SavedLeaf:
        get = entry.get
        data_shape = get("data_shape")
        offset = get("offset")
        if offset is not None and (type(offset) is not int or offset < 0):
            raise ValueError(f"leaf {get('path')!r} has offset {offset!r}, not an "
                             "integer >= 0")
        # Positional, in field order: the keyword constructor costs twice as much.
        return _new_tuple(cls, (
            entry["path"], entry["name"], entry["kind"], tuple(entry["shape"]),
            entry["dtype"], get("impl"), None if data_shape is None else tuple(data_shape),
            get("data_dtype"), get("python_type"), offset))

    def describe(self) -> str:
        if self.kind == "scalar":
            return f"python {self.python_type}"
        text = f"shape {self.shape} {self.dtype}"
        return f"{text} (impl {self.impl})" if self.kind == "key" else text


class Layout(NamedTuple):
    """What tree.json records of one leaf apart from its path and where it is stored: the
    fields of SavedLeaf but path, name and offset, with the same meanings."""

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
#: (``bytes_of``); tests/integration/test_dtypes.py round-trips every one bit for bit.
STORABLE_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "bfloat16", "complex64", "complex128",
    "int2", "int4", "float4_e2m1fn", "float8_e3m4", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
})


def bytes_of(array: np.ndarray) -> np.ndarray:
    """The bytes of ``array`` (C order) as uint8 of shape ``array.shape + (itemsize,)``: how
    an array of a dtype Orbax has no type for is stored (a view where it can be)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(np.uint8).reshape(array.shape + (array.dtype.itemsize,))


def from_bytes(data: np.ndarray, entry: SavedLeaf) -> np.ndarray:
    """The array ``bytes_of`` stored, from its bytes as read (host memory)."""
    dtype = np.dtype(numpy_dtype(entry.dtype))
    flat = np.ascontiguousarray(data).reshape(-1)
    return flat.view(dtype).reshape(entry.shape)


def numpy_dtype(name: str) -> np.dtype:
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


def bytes_layout(path: str, array: np.ndarray) -> tuple[Layout, np.ndarray]:
    """A leaf of a dtype Orbax cannot store, kept as its bytes (refused where its bytes
    cannot be had: an object, string or structured dtype)."""
    data = bytes_of(array)
    return Layout(kind="array", shape=tuple(array.shape), dtype=array.dtype.name,
                  data_shape=tuple(data.shape), data_dtype="uint8"), data


def check_int64(path: str, value: int) -> None:
    """Python ints are stored as int64; one outside its range raises, naming its path."""
    if not -(2**63) <= value < 2**63:
        raise TypeError(
            f"leaf {path} is the Python int {value}, which does not fit in int64. "
            "Fix: store it as a string in a stateful object's JSON state.")


def classify_leaf(path: str, leaf: Any) -> tuple[Layout, Any]:
    """Classify one state leaf; return what tree.json records of it and the array that
    holds its data (the caller's own numpy array, not a copy: ``HostBuffers.stage`` in
    ``write`` copies what must be copied). Raises TypeError, naming ``path``, for a
    leaf that cannot be stored."""
    if isinstance(leaf, jax.Array):
        kind = jax_dtype_kind(leaf.dtype)
        if kind == "array":  # the common case first, one cached look-up per leaf
            return Layout(kind="array", shape=tuple(leaf.shape),
                          dtype=dtype_name(leaf.dtype)), leaf
        if kind == "key":
            data = jax.random.key_data(leaf)
            return Layout(kind="key", shape=tuple(leaf.shape), dtype=dtype_name(leaf.dtype),
                          impl=str(jax.random.key_impl(leaf)), data_shape=tuple(data.shape),
                          data_dtype=np.dtype(data.dtype).name), data
        if kind == "bytes":
            if not leaf.is_fully_addressable:
                raise CodecError(
                    f"leaf {path} is a jax.Array of dtype {np.dtype(leaf.dtype).name} sharded "
                    "across processes; Orbax has no type for that dtype, and jaxckpt stores "
                    "such arrays as their bytes only from one process. Fix: convert it to a "
                    "dtype Orbax stores (e.g. uint8, float32) before saving.")
            return bytes_layout(path, np.asarray(leaf))
    if isinstance(leaf, (np.ndarray, np.generic)):
        # Objects, strings, dates and records have no array encoding in Orbax.
        if leaf.dtype.kind in "OUSMm" or leaf.dtype.fields is not None:
            raise TypeError(
                f"leaf {path} is a numpy array of dtype {leaf.dtype}, which Orbax cannot "
                "store as an array. Fix: convert it to a numeric array, or keep it out of the "
                "array state (e.g. in a stateful object's JSON state).")
        array = np.asarray(leaf)
        if array.dtype.name not in STORABLE_DTYPES:
            return bytes_layout(path, array)
        return Layout(kind="array", shape=tuple(array.shape),
                      dtype=dtype_name(array.dtype)), array
    for type_name, py_type in PY_SCALAR_TYPES.items():
        if type(leaf) is py_type:
            dtype = PY_SCALAR_DTYPES[type_name]
            if type(leaf) is int:  # py_type; spelled so that type checkers narrow ``leaf``
                check_int64(path, leaf)
            return Layout(kind="scalar", shape=(), dtype=dtype.name,
                          python_type=type_name), np.asarray(leaf, dtype)
    raise TypeError(
        f"leaf {path} is a {type(leaf).__module__}.{type(leaf).__qualname__}, which cannot be "
        "checkpointed as an array. Leaves must be jax.Array (typed PRNG keys included), numpy "
        "arrays or Python bool/int/float. Fix: remove it from the array state (e.g. with "
        "nnx.state(model, nnx.Param) or a filtered dict) and keep strings and objects in a "
        "stateful object's JSON state, or convert it to an array.")

# ---------------------------------------------------------------------------- tree paths


def plain_paths(tree: Any, leaves: list[Any]) -> list[str] | None:
    """``jax.tree_util.keystr`` of the tree path of each of ``leaves`` (``tree``'s, as
    ``jax.tree_util.tree_flatten`` gives them), where ``tree`` is made of plain dicts with
    string keys, lists, tuples and None; None for any other tree (jax's own walk then).

    jax's walk makes a key object per node and a string per key of every path, about 2 us
    a leaf; here each key's text is made once and paths share their prefixes. The leaves
    found must be ``leaves`` themselves, in order, or the answer is None."""
    paths: list[str] = []
    keys: dict[str, str] = {}  # a dict key -> its text in a path
    count, position = len(leaves), 0

    def leaf(node: Any, path: str) -> None:
        nonlocal position
        # Attribute and item access only, no calls: this runs once per leaf.
        if position >= count or leaves[position] is not node:
            raise _NotPlain
        paths.append(path)
        position += 1

    def walk(node: Any, prefix: str) -> None:
        nonlocal position
        kind = node.__class__
        if kind is dict:
            for key in sorted(node):  # jax's order; a TypeError (mixed keys) ends the walk
                if key.__class__ is not str:
                    raise _NotPlain
                if key in keys:
                    text = keys[key]
                else:
                    text = keys[key] = f"[{key!r}]"
                child = node[key]
                if child.__class__ in _CONTAINERS or child is None:
                    walk(child, prefix + text)
                elif position < count and leaves[position] is child:  # leaf(), inline
                    paths.append(prefix + text)
                    position += 1
                else:
                    raise _NotPlain
        elif kind is list or kind is tuple:
            for index, child in enumerate(node):
                walk(child, f"{prefix}[{index}]")
        elif node is not None:
            leaf(node, prefix)

    try:
        walk(tree, "")
    except (_NotPlain, TypeError, RecursionError):
        return None  # a node jax flattens differently (a registered type, say)
    return paths if position == count else None


class _NotPlain(Exception):
    """``plain_paths`` met a node it does not know, or leaves other than jax's."""


_CONTAINERS = frozenset({dict, list, tuple})


# ------------------------------------------------------------------------------ tree.json


#: A string as ``json.dumps`` writes it (ASCII, escaped): the C encoder's own function.
_quoted = json.encoder.encode_basestring_ascii


def tree_json_text(entries: list[SavedLeaf], packs: list[dict[str, Any]]) -> str:
    """tree.json's text: one leaf per line, so that it stays readable and diffable."""
    lines = TreeLines()
    for entry in entries:
        lines.add(entry.path, entry.name, entry.offset, Layout(*entry[2:9]))
    return lines.text(packs)


class TreeLines:
    """tree.json's leaf lines, one added per leaf in tree order, then the whole text.

    A plain array's line is put together from the C encoder's string escaping, each shape's
    text made once (a dict and a ``json.dumps`` per leaf were most of the cost of tree.json
    with thousands of leaves); any other leaf's line is ``json.dumps`` of its entry. The
    text is the same either way. ``indent=`` is never used: it switches the whole document
    to the pure-Python encoder, slow with thousands of leaves."""

    __slots__ = ("_lines", "_shapes", "_as_bytes")

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._shapes: dict[tuple[int, ...], str] = {}
        self._as_bytes = False

    def add(self, path: str, name: str, offset: int | None, layout: Layout) -> None:
        if layout.kind != "array" or layout.data_dtype is not None:
            self._as_bytes = self._as_bytes or layout.kind == "array"
            entry = SavedLeaf(path=path, name=name, offset=offset, **layout._asdict())
            self._lines.append("  " + json.dumps(entry.to_json()))
            return
        shape = layout.shape
        shape_text = self._shapes.get(shape)
        if shape_text is None:
            shape_text = self._shapes[shape] = ", ".join(str(int(n)) for n in shape)
        quoted = _quoted
        line = (f'  {{"path": {quoted(path)}, "name": {quoted(name)}, "kind": "array", '
                f'"shape": [{shape_text}], "dtype": {quoted(layout.dtype)}')
        self._lines.append(line + "}" if offset is None else
                           f'{line}, "offset": {int(offset)}}}')

    def text(self, packs: list[dict[str, Any]]) -> str:
        """The whole of tree.json, with ``packs`` (name, dtype, size of each) listed."""
        version = (TREE_FORMAT_VERSION if self._as_bytes else
                   PACKED_TREE_VERSION if packs else UNPACKED_TREE_VERSION)
        head = [f'{{"format": {json.dumps(TREE_FORMAT)}, "version": {version},']
        if packs:
            head.append(' "packs": [' + ",\n  ".join(json.dumps(p) for p in packs) + "],")
        head.append(' "leaves": [')
        head.append(",\n".join(self._lines))
        head.append(" ]}")
        return "\n".join(head) + "\n"


def read_tree_json(root: epath.Path, directory: str) -> dict[str, SavedLeaf]:
    tree_file = root / TREE_FILE
    if not tree_file.exists():
        raise CheckpointCorruptError(
            f"{directory} has no {TREE_FILE}: it was not written by jaxckpt's Orbax backend, "
            "or its write did not finish. Fix: point at a checkpoint directory that the "
            "Orbax backend wrote completely.")
    document = parse_tree_record(tree_file.read_bytes(), directory)
    try:
        return parse_leaves(document["leaves"], document.get("packs") or [])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointCorruptError(f"{directory}/{TREE_FILE} is unreadable: {error}") \
            from error


def _listed_packs(packs: list[dict[str, Any]]) -> dict[str, tuple[np.dtype, int]]:
    """tree.json's list of packs, checked: name -> (dtype, size in elements)."""
    listed: dict[str, tuple[np.dtype, int]] = {}
    for pack in packs:
        name, size = pack["name"], pack["size"]
        if (not isinstance(name, str) or not name.startswith(PACK_PREFIX)
                or not STORAGE_NAME.match(name)):
            raise ValueError(f"pack name {name!r} is not a pack name this backend writes")
        if type(size) is not int or size < 0:
            raise ValueError(f"pack {name} has size {size!r}, not an integer >= 0")
        listed[name] = (np.dtype(pack["dtype"]), size)
    return listed


def parse_leaves(leaves: list[dict[str, Any]], packs: list[dict[str, Any]],
                 ) -> dict[str, SavedLeaf]:
    """tree.json's leaves by tree path, checked: every storage name one this backend
    makes (it becomes a path under arrays/), every packed leaf inside a listed pack of its
    stored dtype. ValueError, KeyError or TypeError for anything else.

    One pass, the usual entry spelled out: it runs once per saved leaf, and a restore of
    many small leaves reads tens of thousands."""
    listed = _listed_packs(packs)
    checked: set[str] = set()  # packed leaves share a few names: match each once
    saved: dict[str, SavedLeaf] = {}
    new, stored_dtype_of = _new_tuple, _stored_dtype
    for entry in leaves:
        # ``key in entry`` and ``entry[key]`` rather than entry.get(key): no call.
        name = entry["name"]
        offset = entry["offset"] if "offset" in entry else None
        data_shape = entry["data_shape"] if "data_shape" in entry else None
        if name not in checked:
            if not isinstance(name, str) or not STORAGE_NAME.match(name):
                raise ValueError(f"leaf {entry.get('path')!r} has storage name {name!r}, "
                                 "which is not one this backend writes (leaf_N or "
                                 "pack_DTYPE_N); refusing a name that could point outside "
                                 "the checkpoint")
            checked.add(name)
        # Positional, in field order: the keyword constructor costs twice as much.
        leaf = new(SavedLeaf, (
            entry["path"], name, entry["kind"], tuple(entry["shape"]), entry["dtype"],
            entry["impl"] if "impl" in entry else None,
            None if data_shape is None else tuple(data_shape),
            entry["data_dtype"] if "data_dtype" in entry else None,
            entry["python_type"] if "python_type" in entry else None, offset))
        saved[leaf.path] = leaf
        if offset is None:  # not packed
            continue
        if type(offset) is not int or offset < 0:
            raise ValueError(f"leaf {leaf.path!r} has offset {offset!r}, not an "
                             "integer >= 0")
        if name not in listed:
            raise ValueError(f"leaf {leaf.path} is packed into {name}, which is not in "
                             "the list of packs")
        found = listed[name]
        # stored_shape and stored_dtype spelled out.
        kind, data_dtype = leaf.kind, leaf.data_dtype
        if kind == "key" or (kind == "array" and data_dtype is not None):
            stored_shape, stored_dtype = leaf.data_shape or (), data_dtype
        else:
            stored_shape, stored_dtype = leaf.shape, leaf.dtype
        count = prod(stored_shape)
        if type(count) is not int or count < 0:
            raise ValueError(f"leaf {leaf.path} has stored shape {stored_shape!r}, "
                             "not a shape of integers >= 0")
        dtype, size = found
        if offset + count > size or dtype != stored_dtype_of(stored_dtype):
            raise ValueError(f"leaf {leaf.path} ({count} x {stored_dtype} at element "
                             f"{offset}) does not fit pack {name} ({size} x {dtype})")
    return saved
