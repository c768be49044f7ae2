"""Loading DCP checkpoints without trusting them: the one place jaxckpt reads a pickle.

Owns: the storage reader and load planner that ``DcpBackend.read`` gives ``dcp.load`` (the
object-store reader of ``_dcp_storage`` derives from this reader), and the bytes of a
``.metadata`` file for the object-store writer (``dump_metadata``).

torch.distributed.checkpoint stores its index (``.metadata``) as a pickle, and its default
reader unpickles it with no restriction: a checkpoint copied from elsewhere could run code on
restore. torch's own weights-only unpickler cannot read it (it supports pickle protocol 2;
DCP writes protocol 4 frames), so this module unpickles ``.metadata`` with a ``find_class``
that admits only the handful of classes DCP's metadata is made of (its dataclasses,
``torch.Size``, dtypes, the layout lookup, ``PosixPath``) and refuses every other global
with ``CheckpointCorruptError`` before anything is constructed.

The second door is DCP's byte items: the default planner turns them back into objects with
``torch.load(weights_only=False)``. ``DcpBackend`` never writes byte items (non-tensor values
go to ``objects.json`` through jaxckpt's JSON codec), so the planner here refuses them.

Must not import: jax. torch.distributed.checkpoint is imported when the classes are built.
"""

from __future__ import annotations

import functools
import io
import pathlib
import pickle  # restricted: find_class below admits only DCP's metadata classes
from typing import Any

import torch

from jaxckpt.errors import CheckpointCorruptError

__all__ = ["ALLOWED_GLOBALS", "dump_metadata", "load_metadata", "safe_planner", "safe_reader",
           "safe_reader_class"]

#: Every (module, name) a DCP ``.metadata`` pickle may name (dtypes are added below).
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name; constructs nothing
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
})


@functools.cache
def _dtype_names() -> frozenset[str]:
    return frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


def _allowed(module: str, name: str) -> bool:
    return (module, name) in ALLOWED_GLOBALS or (module == "torch" and name in _dtype_names())


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any global outside the allow-list is refused unresolved."""

    def __init__(self, file: Any, where: str):
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise CheckpointCorruptError(
                f"{self._where}: DCP metadata names {module}.{name}, which is not part of a "
                f"DCP index; refusing to load it (a crafted checkpoint could run code this "
                f"way). Restore another checkpoint.")
        return super().find_class(module, name)


def dump_metadata(metadata: Any) -> bytes:
    """A ``.metadata`` file's bytes, as DCP's own writer makes them (a pickle: DCP's format,
    written from DCP's own objects; only ``load_metadata`` reads one back)."""
    return pickle.dumps(metadata)


def load_metadata(data: bytes, where: str) -> Any:
    """Decode a ``.metadata`` file's bytes, refusing anything but DCP's metadata classes."""
    try:
        return _MetadataUnpickler(io.BytesIO(data), where).load()
    except CheckpointCorruptError:
        raise
    except Exception as exc:  # truncated or malformed stream
        raise CheckpointCorruptError(f"{where}: DCP metadata cannot be read ({exc})") from exc


@functools.cache
def _classes() -> tuple[type, type]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """FileSystemReader whose metadata is read with the restricted unpickler."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as handle:
                metadata = load_metadata(handle.read(), str(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner that refuses byte items instead of torch.load-ing them."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise CheckpointCorruptError(
                f"DCP checkpoint holds a serialized object for {read_item.dest_index.fqn!r}; "
                f"jaxckpt never writes those (values go to objects.json), so this checkpoint "
                f"was altered or written by another tool. Refusing to deserialize it.")

    return SafeReader, SafePlanner


def safe_reader_class() -> type:
    """The class of :func:`safe_reader`'s readers, for readers of other storages
    (``_dcp_storage``) to build on: its ``read_metadata`` reads through ``self.fs``."""
    return _classes()[0]


def safe_reader(directory: str | pathlib.Path) -> Any:
    """A DCP storage reader for ``directory`` that never unpickles anything but metadata."""
    return _classes()[0](directory)


def safe_planner() -> Any:
    """A DCP load planner that refuses serialized-object (byte) items."""
    return _classes()[1]()
