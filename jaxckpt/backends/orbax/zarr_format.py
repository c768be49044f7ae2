"""The zarr3 form in which Orbax stores an array, and Orbax's metadata files around it.

Owns: each array's ``zarr.json`` (``metadata_text``; ``parse_metadata`` and ``parse_grid``
accept exactly the forms it writes, anything else is left to Orbax), the chunk keys and the
regular grid of an array sharded over processes (``chunk_relpath``, ``chunk_grid``), the
shard index that ends each chunk file (``shard_index``), Orbax's ``_METADATA``,
``_CHECKPOINT_METADATA`` and ``commit_success.txt``, and which arrays the native I/O stores
(``supported``). The one departure from tensorstore's bytes, an array starting up to 4 KiB
into its chunk file, is recorded in the shard index and in zarr.json's attributes
(``"jaxckpt": {"chunk_offset": N}``). The layout and why: docs/design.md, "Orbax's files,
our I/O"; ``tests/integration/test_zarr_io.py`` compares it byte for byte with Orbax's.

Must not import: jax, orbax, tensorstore, torch.
"""

from __future__ import annotations

import itertools
import json
import struct
import sys
from typing import Any

import ml_dtypes  # noqa: F401 - registers bfloat16 / float8 with numpy
import numpy as np

from jaxckpt.core.checksum import extend
from jaxckpt.storage.buffers import ALIGN

__all__ = [
    "INDEX_BYTES",
    "SUPPORTED_DTYPES",
    "checkpoint_metadata_text",
    "chunk_grid",
    "chunk_relpath",
    "commit_success_text",
    "metadata_text",
    "parse_grid",
    "parse_metadata",
    "shard_index",
    "supported",
    "tree_metadata_text",
]

_ATTRIBUTE = "jaxckpt"  # our key in zarr.json's attributes
#: Bytes of the shard index after the data: offset u64, length u64, crc32c u32.
INDEX_BYTES = 20

#: dtypes stored one element per ``itemsize`` bytes, as numpy holds them, that Orbax's
#: tensorstore writes with exactly this layout (checked by tests/integration/test_zarr_io.py).
#: Sub-byte types (int4, float4) and anything else go through Orbax.
SUPPORTED_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "bfloat16", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2",
})

_ORBAX_HANDLER = ("orbax.checkpoint._src.handlers.pytree_checkpoint_handler."
                  "PyTreeCheckpointHandler")


def supported(array: np.ndarray) -> bool:
    """Whether the native I/O writes ``array`` (else the whole write goes through Orbax)."""
    dtype = array.dtype
    return (dtype.name in SUPPORTED_DTYPES and array.size > 0
            and dtype.byteorder in "=|<" and sys.byteorder == "little")


def chunk_relpath(ndim: int, index: tuple[int, ...] | None = None) -> str:
    """Path of the chunk file at grid position ``index`` (default: the one chunk of a
    single-chunk array) of an array of ``ndim`` dimensions, below its directory: zarr3's
    default chunk key encoding, "c" then one component per dimension."""
    return "/".join(["c"] + [str(i) for i in (index if index is not None else (0,) * ndim)])


def chunk_grid(shape: tuple[int, ...],
               chunk_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """Every chunk of an array of ``shape`` cut into ``chunk_shape`` (which divides it):
    its grid position and the slices of the array it holds, in C order."""
    counts = [size // chunk for size, chunk in zip(shape, chunk_shape, strict=True)]
    return [(index, tuple(slice(i * chunk, (i + 1) * chunk)
                          for i, chunk in zip(index, chunk_shape, strict=True)))
            for index in itertools.product(*(range(count) for count in counts))]


def _fill_value(dtype_name: str) -> Any:
    if dtype_name == "bool":
        return False
    if dtype_name.startswith("complex"):
        return [0.0, 0.0]
    if dtype_name.startswith(("int", "uint")):
        return 0
    return 0.0


def _metadata(shape: tuple[int, ...], dtype_name: str,
              chunk_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    chunk = list(shape if chunk_shape is None else chunk_shape)
    inner: dict[str, Any] = {"name": "bytes"}
    if np.dtype(dtype_name).itemsize > 1:  # one-byte types carry no endianness
        inner["configuration"] = {"endian": "little"}
    return {
        "chunk_grid": {"configuration": {"chunk_shape": chunk}, "name": "regular"},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"configuration": {
            "chunk_shape": chunk,
            "codecs": [inner],
            "index_codecs": [{"configuration": {"endian": "little"}, "name": "bytes"},
                             {"name": "crc32c"}]},
            "name": "sharding_indexed"}],
        "data_type": dtype_name,
        "fill_value": _fill_value(dtype_name),
        "node_type": "array",
        "shape": list(shape),
        "zarr_format": 3,
    }


def metadata_text(shape: tuple[int, ...], dtype_name: str, offset: int = 0,
                  chunk_shape: tuple[int, ...] | None = None) -> str:
    """The ``zarr.json`` of one array, as tensorstore writes it (sorted keys, compact);
    with ``offset`` (where the bytes start in the chunk file, see ``chunk_io.data_offset``) also
    the attribute that records it. ``chunk_shape``: a grid of chunks of that shape (one
    file each, every one at offset 0: several processes write them), else one chunk."""
    if chunk_shape is not None and tuple(chunk_shape) != tuple(shape) and offset:
        raise ValueError("a data offset is recorded only for single-chunk arrays")
    document = _metadata(shape, dtype_name, chunk_shape)
    if offset:
        document["attributes"] = {_ATTRIBUTE: {"chunk_offset": offset}}
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def parse_metadata(text: bytes | str) -> tuple[tuple[int, ...], np.dtype, int] | None:
    """Shape, dtype and data offset of a single-chunk ``zarr.json`` in exactly a form this
    module writes, or None when it is anything else (then Orbax reads that array)."""
    parsed = parse_grid(text)
    if parsed is None or parsed[3] != parsed[0]:
        return None
    return parsed[:3]


def parse_grid(text: bytes | str) -> tuple[tuple[int, ...], np.dtype, int,
                                           tuple[int, ...]] | None:
    """Shape, dtype, data offset and chunk shape of a ``zarr.json`` in exactly a form this
    module writes (one chunk, or a regular grid of chunks that divides the shape, each a
    file holding one inner chunk at offset 0: what Orbax writes for a sharded array), or
    None when it is anything else (then Orbax reads that array)."""
    try:
        found = json.loads(text)
        shape = tuple(int(n) for n in found["shape"])
        chunk_shape = tuple(int(n) for n in found["chunk_grid"]["configuration"]["chunk_shape"])
        name = found["data_type"]
        offset = 0
        attributes = found.pop("attributes", None)
        if attributes is not None:  # only ours, and only the one key
            if set(attributes) != {_ATTRIBUTE} or set(attributes[_ATTRIBUTE]) != {"chunk_offset"}:
                return None
            offset = attributes[_ATTRIBUTE]["chunk_offset"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if (name not in SUPPORTED_DTYPES or len(chunk_shape) != len(shape)
            or found != _metadata(shape, name, chunk_shape) or 0 in shape
            or 0 in chunk_shape or any(s % c for s, c in zip(shape, chunk_shape, strict=True))
            or type(offset) is not int or not 0 <= offset < ALIGN
            or (offset and chunk_shape != shape)):
        return None
    return shape, np.dtype(name), offset, chunk_shape


def _crc32c(data: bytes) -> int:
    return extend("crc32c", 0, data)


def shard_index(nbytes: int, offset: int = 0) -> bytes:
    """The shard index that ends a chunk file: where its one chunk starts and its length."""
    head = struct.pack("<QQ", offset, nbytes)
    return head + struct.pack("<I", _crc32c(head))


def tree_metadata_text(names: list[str]) -> str:
    """Orbax's ``_METADATA`` for a flat dict of numpy arrays named ``names``."""
    tree = {f"('{name}',)": {"key_metadata": [{"key": name, "key_type": 2}],
                             "value_metadata": {"value_type": "np.ndarray",
                                                "skip_deserialize": False}}
            for name in sorted(names)}
    return json.dumps({"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": True,
                       "store_array_data_equal_to_fill_value": True, "custom_metadata": None})


def checkpoint_metadata_text(init_ns: int, commit_ns: int) -> str:
    """Orbax's ``_CHECKPOINT_METADATA`` of a PyTreeCheckpointHandler checkpoint."""
    return json.dumps({"item_handlers": _ORBAX_HANDLER, "metrics": {},
                       "performance_metrics": {}, "init_timestamp_nsecs": init_ns,
                       "commit_timestamp_nsecs": commit_ns, "custom_metadata": {}})


def commit_success_text(directory: str) -> str:
    return f"Checkpoint commit was successful to {directory}"
