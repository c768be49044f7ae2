"""Loading DCP checkpoints without trusting them: the one place jaxckpt reads a pickle.

Owns: the storage reader and load planner ``DcpBackend.read`` gives ``dcp.load``, and
``dump_metadata`` for the object-store writer. ``.metadata`` (a pickle) is unpickled with a
``find_class`` that admits only the classes DCP's metadata is made of and refuses any other
global with ``CheckpointCorruptError``; tensor records whose layout ``dcp.records`` proves
are copied from the file (or fetched ranges) straight into the live tensor, other records
go through DCP's ``read_data``; byte items (which ``DcpBackend`` never writes, and DCP
would ``torch.load``) are refused. Why not torch's weights-only unpickler: docs/torch.md.

Must not import: jax. torch.distributed.checkpoint is imported when the classes are built.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pathlib
import pickle  # restricted: find_class below admits only DCP's metadata classes
from typing import Any

import torch

from jaxckpt.errors import CheckpointCorruptError
from torch_bridge.dcp import records as dcp_records

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


#: the torch dtype of each storage name dcp_records takes (its ITEM_SIZES keys).
DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32,
    "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}
#: bytes of a record's start and end kept for the parser's small reads (its zip headers).
_EDGE = 4096


def _read_into(stream: Any, start: int, view: memoryview) -> None:
    """Fill ``view`` from ``stream`` at ``start`` (a read may return less than asked)."""
    stream.seek(start)
    filled = 0
    while filled < len(view):
        count = stream.readinto(view[filled:])
        if not count:
            raise CheckpointCorruptError(
                f"a DCP data file ends inside a tensor record (at byte {start + filled}): the "
                "file is truncated. Restore another checkpoint.")
        filled += count


def _record_reader(stream: Any, base: int, length: int) -> dcp_records.Read:
    """``read(offset, n)`` over the record at ``base``, its first and last ``_EDGE`` bytes
    read once (the parser's dozen small reads all fall there for a torch.save record)."""
    edges: list[tuple[int, bytes]] = []
    for start in sorted({0, max(0, length - _EDGE)}):
        edge = bytearray(min(_EDGE, length - start))
        _read_into(stream, base + start, memoryview(edge))
        edges.append((start, bytes(edge)))

    def read(offset: int, size: int) -> bytes:
        for start, edge in edges:
            if start <= offset and offset + size <= start + len(edge):
                return edge[offset - start:offset - start + size]
        if offset < 0 or size < 0 or offset + size > length:
            return b""
        data = bytearray(size)
        _read_into(stream, base + offset, memoryview(data))
        return bytes(data)

    return read


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _load_record(stream: Any, info: Any, item: Any, planner: Any) -> bool:
    """Copy the tensor record ``info`` of ``stream`` into ``item``'s target, as DCP's
    ``read_data`` would (narrowed to the item's region, cast to the target's dtype);
    False, having touched nothing, where the record's layout is not proven."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.planner import LoadItemType

    if item.type != LoadItemType.TENSOR or info.transform_descriptors:
        return False
    record = dcp_records.parse_record(_record_reader(stream, info.offset, info.length),
                                       info.length)
    if record is None:
        return False
    dtype = DTYPES[record.storage]
    target = planner.resolve_tensor(item).detach()
    if tuple(target.size()) != tuple(item.lengths):
        return False  # DCP's path raises its own error for this
    start = info.offset + record.data_offset
    whole = tuple(item.lengths) == record.shape and not any(item.storage_offsets)
    # Straight into the target only where its memory is exactly the record's bytes: a plain
    # CPU tensor, contiguous, of the record's dtype, no conjugate or negative view bit.
    if (whole and type(target) is torch.Tensor and target.dtype == dtype
            and target.device.type == "cpu" and target.is_contiguous()
            and not target.is_conj() and not target.is_neg()):
        if target.numel():
            _read_into(stream, start, _bytes_of(target))  # straight into the live tensor
    else:
        source = torch.empty(record.shape, dtype=dtype)
        if source.numel():
            _read_into(stream, start, _bytes_of(source))
        target.copy_(narrow_tensor_by_index(source, item.storage_offsets, item.lengths))
    planner.commit_tensor(item, target)
    return True


def _resolved(storage_data: dict[Any, Any], directory: str,
              references: dict[str, Any]) -> dict[Any, Any]:
    """``storage_data`` with each record that points into a referenced file given that
    file's full path (what ``fs.concat_path`` then returns as it is); a record pointing
    anywhere else raises ``CheckpointCorruptError`` before anything is read."""
    from torch_bridge.dcp.incremental import resolve_relative

    local = "://" not in directory
    if local:
        directory = os.path.abspath(directory)
    out = {}
    for index, info in storage_data.items():
        where = resolve_relative(directory, info.relative_path, references, repr(index.fqn))
        out[index] = info if where is None else dataclasses.replace(info, relative_path=where)
    return out


@functools.cache
def _classes() -> tuple[type, type]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.futures import Future

    class SafeReader(FileSystemReader):
        """FileSystemReader whose metadata is read with the restricted unpickler, whose
        tensor records are copied without torch.load where their layout is proven, and
        whose records may point only into its own directory or into ``references`` (the
        keys, relative to ``recover/``, an incremental checkpoint's manifest refers to)."""

        references: dict[str, Any] = {}

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any,
                                  **kwargs: Any) -> None:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            self.storage_data = _resolved(self.storage_data, str(self.path), self.references)

        def read_data(self, plan: Any, planner: Any) -> Any:
            per_file: dict[str, list[Any]] = {}
            for item in plan.items:
                relative = self.storage_data[item.storage_index].relative_path
                per_file.setdefault(relative, []).append(item)
            left: list[Any] = []
            for relative, items in per_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, relative),
                                           "rb") as stream:
                    left.extend(item for item in items if not _load_record(
                        stream, self.storage_data[item.storage_index], item, planner))
            if left:  # records not proven: DCP's own path (torch.load) for those alone
                return super().read_data(dataclasses.replace(plan, items=left), planner)
            done: Future[None] = Future()
            done.set_result(None)
            return done

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
    (``dcp_files``) to build on: its ``read_metadata`` reads through ``self.fs``."""
    return _classes()[0]


def safe_reader(directory: str | pathlib.Path) -> Any:
    """A DCP storage reader for ``directory`` that never unpickles anything but metadata."""
    return _classes()[0](directory)


def safe_planner() -> Any:
    """A DCP load planner that refuses serialized-object (byte) items."""
    return _classes()[1]()
