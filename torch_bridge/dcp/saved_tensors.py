"""The tensors of one DCP checkpoint directory, listed and read one at a time, no live objects.

Owns: ``SavedTensors``: the tensor records of ``objects.json`` (key, tree path, shape, dtype
per state entry) and ``read(key)``, which loads that one tensor into a fresh CPU tensor
through the backend's restricted reader and planner (``dcp.metadata``: nothing unpickled but
DCP's ``.metadata``, read once); a local directory or a prefix of an object store
(``dcp.files``, whose reader fetches only the byte ranges of the tensor asked for).

Must not import: jax, orbax. ``torch.distributed.checkpoint`` is imported on first read.

Concurrency: one reader; ``read`` is called from one thread at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from jaxckpt.core import codec
from jaxckpt.errors import CheckpointCorruptError
from jaxckpt.storage.base import Storage
from torch_bridge.dcp.backend import (
    _parse_objects,
    _quiet_single_process_notice,
    safe_load,
)
from torch_bridge.dcp.files import LocalDcpFiles, StorageDcpFiles

__all__ = ["SavedTensor", "SavedTensors"]


@dataclasses.dataclass(frozen=True, slots=True)
class SavedTensor:
    """One tensor record of ``objects.json``."""

    key: str
    """Its DCP key, e.g. ``model/lm_head.weight``."""
    path: tuple[Any, ...]
    """Its tree path inside the entry (a module's: the one state-dict name)."""
    shape: tuple[int, ...]
    dtype: torch.dtype


class SavedTensors:
    """The tensors saved in ``directory`` (a step's ``state`` directory): ``storage`` reads
    a URL (an object-store prefix), None a local directory; ``references``: the keys of the
    checkpoint's manifest refs, whose files its records may point into (an incremental
    save's unchanged tensors), read from ``recover/<key>``."""

    def __init__(self, directory: str, storage: Storage | None = None,
                 references: Mapping[str, Any] | None = None):
        self.directory = directory
        self._references = dict(references or {})
        self._files = LocalDcpFiles() if storage is None else StorageDcpFiles(storage)
        self.entries: dict[str, dict[str, Any]] = _parse_objects(
            directory, self._files.read_document(directory))
        self._reader: Any = None
        _quiet_single_process_notice()  # one process reads: DCP's notice says only that

    def tensors(self, entry: str) -> list[SavedTensor]:
        """The tensors of state entry ``entry`` in their saved order (a module's state-dict
        order); ``KeyError`` for an entry that was not saved."""
        found = []
        for item in self.entries[entry].get("tensors", []):
            dtype = getattr(torch, str(item["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointCorruptError(f"{self.directory}: tensor {item['key']!r} has "
                                             f"the unknown dtype {item['dtype']!r}")
            found.append(SavedTensor(key=item["key"], shape=tuple(int(d) for d in item["shape"]),
                                     path=tuple(codec.decode(item["path"], "path")),
                                     dtype=dtype))
        return found

    def read(self, tensor: SavedTensor) -> torch.Tensor:
        """``tensor``'s saved value, read alone into a new CPU tensor."""

        if self._reader is None:
            self._reader = _metadata_once(self._files.reader(
                self.directory, references=self._references))
        target = torch.empty(tensor.shape, dtype=tensor.dtype)
        safe_load({tensor.key: target}, self.directory, self._reader, None, True)
        return target


def _metadata_once(reader: Any) -> Any:
    """``reader`` with its ``read_metadata`` answered from the first call's result: each
    ``dcp.load`` asks for it, and one tensor per load would otherwise fetch and unpickle
    ``.metadata`` once per tensor."""
    first = reader.read_metadata
    kept: list[Any] = []

    def read_metadata(*args: Any, **kwargs: Any) -> Any:
        if not kept:
            kept.append(first(*args, **kwargs))
        return kept[0]

    reader.read_metadata = read_metadata
    return reader
