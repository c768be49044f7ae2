"""Incremental DCP saves: content hashes of every tensor record, and records kept in place.

Owns: ``content.json`` (one per checkpoint, beside ``objects.json``: each tensor record's
index, chunk, dtype, xxh3-128 of its bytes, a probe of a few windows of them, and where
DCP stored it), the writer mixin that hashes each write item and, given an
``IncrementalBase``, gives an unchanged item the base's storage record (the byte range of
an earlier data file, named ``../../<ref key>`` so that DCP's own reader finds it too)
instead of writing it again. An item that cannot be unchanged (no base record of its
shape and dtype, or another probe) is written at once while it is hashed; only the others
wait for their hash,
and ``resolve_relative``, the reader's rule for where a record's bytes may come from (this
checkpoint's own files, or a referenced key; anything else is corrupt).

Must not import: jax, orbax. ``torch.distributed.checkpoint`` is imported on first use.

Concurrency: a writer's ``Incremental`` serves one ``dcp.save``; ``write_data`` runs on DCP's
writer thread, ``references`` is read after the save finished.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import posixpath
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import xxhash

from jaxckpt.core.content_hash import HASH_NAME, content_hash, is_hash
from jaxckpt.core.layout import parse_ref_key
from jaxckpt.errors import CheckpointCorruptError

if TYPE_CHECKING:
    from jaxckpt.backends.base import IncrementalBase

__all__ = ["CONTENT_FILE", "BaseContent", "Incremental", "incremental_writer_class",
           "resolve_relative", "split_directory"]

#: the backend's per-checkpoint record of its tensor records' content hashes.
CONTENT_FILE = "content.json"
CONTENT_FORMAT = "jaxckpt.dcp.content"
CONTENT_VERSION = 1
#: a state directory is ``recover/step_N/state``: a ref's relative path climbs this far.
_DEPTH = 2
_UP = "../" * _DEPTH
#: threads hashing one rank's tensors (xxh3 runs near memory speed on each).
_HASH_THREADS = 4
#: a record's probe: xxh3-64 of this many windows of this many bytes, spread evenly (the
#: whole tensor where it is no larger). Another probe proves the bytes changed; an equal
#: one proves nothing (the full hash decides).
_PROBE_WINDOWS = 64
_PROBE_WINDOW = 256
#: where a probe sits in a content.json record (absent in records written before it).
_PROBE_NAME = "probe"
#: what the data files of items written after their hash are called, after DCP's
#: per-rank prefix (``__0_`` + this + a counter): never the name of a file written at once.
_LATE_PREFIX = "h"


def split_directory(directory: str) -> tuple[str, str]:
    """(recover dir, the state directory relative to it: ``step_N/state``) of a checkpoint's
    state directory, a local path or a URL."""
    parts = directory.rstrip("/").rsplit("/", _DEPTH)
    if len(parts) != _DEPTH + 1 or not parts[0]:
        return "", ""
    return parts[0], "/".join(parts[1:])


def _key_of(rel_dir: str, relative: str) -> str | None:
    """The ref key of a record's ``relative`` path in the state directory ``rel_dir`` (own
    file or a reference), or None where it does not name one safely."""
    if not isinstance(relative, str) or not relative:
        return None
    key = posixpath.normpath(f"{rel_dir}/{relative}")
    if key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")) \
            or parse_ref_key(key) is None:
        return None
    return key


def resolve_relative(directory: str, relative: str, references: Mapping[str, Any],
                     what: str) -> str | None:
    """Where the record ``what`` (its relative path in ``directory``'s DCP metadata) lies:
    None for a file of ``directory`` itself, else the full path of the referenced file
    (``recover/<key>``). A path that names neither (a key not in ``references``, a climb out
    of the root) raises ``CheckpointCorruptError`` naming the record."""
    if "/" not in relative and relative not in ("", ".", ".."):
        return None
    recover_dir, rel_dir = split_directory(directory)
    key = _key_of(rel_dir, relative) if recover_dir else None
    if key is None or key not in references:
        raise CheckpointCorruptError(
            f"{directory}: the DCP record of {what} points at {relative!r}, which is neither a "
            "file of this checkpoint nor one of the files its manifest refers to; refusing to "
            "read it. Restore another checkpoint.")
    return f"{recover_dir}/{key}"


def _index_key(fqn: str, offsets: Any) -> str:
    return json.dumps([fqn, [int(o) for o in offsets]])


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True, slots=True)
class _Saved:
    """One tensor record of a base: its facts and the key of the file holding it."""

    sizes: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    digest: str
    key: str
    offset: int
    length: int
    probe: str | None


class BaseContent:
    """The tensor records of a base checkpoint by (fqn, chunk offsets), read from its
    ``content.json``; empty where it has none (written without hashes)."""

    def __init__(self, records: dict[str, _Saved], files: Mapping[str, Mapping[str, Any]]):
        self.records = records
        self.files = files

    @classmethod
    def parse(cls, data: bytes | None, directory: str,
              files: Mapping[str, Mapping[str, Any]]) -> BaseContent:
        """The records of ``data`` (the base's content.json, None: none) whose file is in
        ``files`` (the base's listing). A malformed document gives no records: the save
        then writes everything, which is always correct."""
        records: dict[str, _Saved] = {}
        _, rel_dir = split_directory(directory)
        try:
            document = json.loads(data) if data is not None else {}
            items = document.get("records", []) if document.get("format") == CONTENT_FORMAT \
                and document.get("version") == CONTENT_VERSION else []
            for item in items:
                key = _key_of(rel_dir, item["path"])
                if key is None or key not in files or not is_hash(item[HASH_NAME]):
                    continue
                records[_index_key(item["fqn"], item["offsets"])] = _Saved(
                    sizes=tuple(int(s) for s in item["sizes"]),
                    shape=tuple(int(s) for s in item["shape"]), dtype=str(item["dtype"]),
                    digest=item[HASH_NAME], key=key, offset=int(item["offset"]),
                    length=int(item["length"]),
                    probe=item[_PROBE_NAME] if isinstance(item.get(_PROBE_NAME), str)
                    else None)
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls({}, files)
        return cls(records, files)


def _tensor_bytes(tensor: Any) -> Any:
    """The bytes of ``tensor`` (a CPU copy where it lives elsewhere), as a flat uint8 array."""
    import torch

    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg().contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _probe(data: Any) -> str:
    """The probe of ``data`` (a flat uint8 array): xxh3-64 of ``_PROBE_WINDOWS`` windows of
    ``_PROBE_WINDOW`` bytes, the first at the start and the last at the end."""
    size = int(data.size)
    if size <= _PROBE_WINDOWS * _PROBE_WINDOW:
        return xxhash.xxh3_64_hexdigest(data)
    running = xxhash.xxh3_64()
    stride = (size - _PROBE_WINDOW) // (_PROBE_WINDOWS - 1)
    for index in range(_PROBE_WINDOWS):
        start = index * stride if index < _PROBE_WINDOWS - 1 else size - _PROBE_WINDOW
        running.update(data[start:start + _PROBE_WINDOW])
    return running.hexdigest()


def _hash_item(data: Any, item: Any, planner: Any) -> str:
    """The content hash of a write item: of ``data`` (its bytes) when given, else of its
    tensor resolved here (a copy, on the hashing thread)."""
    if data is None:
        data = _tensor_bytes(planner.resolve_data(item))
    return content_hash([data])


def _norm(path: str) -> str:
    return path.rstrip("/") if "://" in path else os.path.abspath(path)


class Incremental:
    """One incremental write into ``directory`` on ``base`` (an ``IncrementalBase``, maybe
    without files: the first save, which only records hashes): the base's records, read
    by ``read_content(base directory)`` on the writer thread at ``split`` (as
    is ``base.files``, which the manager lists on first use), and the references made."""

    def __init__(self, base: IncrementalBase, directory: str,
                 read_content: Callable[[str], bytes | None]):
        self._given = base
        self._directory = directory
        self._read_content = read_content
        self.base: BaseContent | None = None
        #: ref key -> the base's manifest entry, for every file this rank's records use.
        self.references: dict[str, dict[str, Any]] = {}

    def _load(self) -> BaseContent | None:
        """The base's records, None for a base without files or one outside the
        ``recover/`` of ``directory`` (then everything is written, always correct)."""
        base = self._given
        if not base.directory or _norm(split_directory(self._directory)[0]) != _norm(
                base.recover_dir) or not base.files:
            return None
        return BaseContent.parse(self._read_content(base.directory), base.directory, base.files)

    def split(self, items: list[Any], planner: Any) -> _Split:
        """Start hashing the tensor items of ``items`` on a few threads (the hash releases
        the GIL) and sort them: those that cannot be unchanged (no base record of their
        chunk, shape and dtype, or another probe) are to be written now, alongside the
        hashing; the rest wait for ``_Split.settle``."""
        from torch.distributed.checkpoint.planner import WriteItemType

        self.base = self._load()
        split = _Split(self, planner)
        for item in items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                split.now.append(item)
                continue
            tensor = planner.resolve_data(item)
            # A CPU tensor in one piece is read in place; any other (on a device, strided)
            # is copied by the hashing thread that needs it, never all at once here.
            data = _tensor_bytes(tensor) if tensor.device.type == "cpu" \
                and tensor.is_contiguous() else None
            chunk = item.tensor_data.chunk
            fact = {"fqn": item.index.fqn, "offsets": [int(o) for o in chunk.offsets],
                    "sizes": [int(s) for s in chunk.sizes],
                    "shape": [int(s) for s in item.tensor_data.size],
                    "dtype": _dtype_name(item.tensor_data.properties.dtype),
                    _PROBE_NAME: None if data is None else _probe(data)}
            index_key = _index_key(fact["fqn"], fact["offsets"])
            split.facts[index_key] = fact
            saved = None if self.base is None else self.base.records.get(index_key)
            hashed = split.pool.submit(_hash_item, data, item, planner)
            if saved is None or (saved.sizes, saved.shape, saved.dtype) != (
                    tuple(fact["sizes"]), tuple(fact["shape"]), fact["dtype"]) or (
                    None not in (saved.probe, fact[_PROBE_NAME])
                    and saved.probe != fact[_PROBE_NAME]):
                split.now.append(item)
                split.hashes.append((fact, None, hashed))
            else:
                split.hashes.append((fact, (item, saved), hashed))
        return split


class _Split:
    """One rank's items of an incremental write, sorted by ``Incremental.split``: ``now``
    (written at once), the hashes under way (with the base record of each item that may be
    unchanged), ``facts`` by index key (each gets its hash in ``settle``)."""

    def __init__(self, incremental: Incremental, planner: Any):
        self.incremental = incremental
        self.planner = planner
        self.now: list[Any] = []
        self.hashes: list[tuple[dict[str, Any], tuple[Any, _Saved] | None,
                                concurrent.futures.Future[str]]] = []
        self.facts: dict[str, dict[str, Any]] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(_HASH_THREADS,
                                                          thread_name_prefix="jaxckpt-hash")

    def settle(self) -> tuple[list[Any], list[Any]]:
        """(items found changed, to write now; results of the items kept in the base),
        once every hash is known (the facts then carry them)."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.storage import WriteResult

        later, kept = [], []
        try:
            for fact, candidate, future in self.hashes:
                fact[HASH_NAME] = future.result()
                if candidate is None:
                    continue
                item, saved = candidate
                if saved.digest != fact[HASH_NAME]:
                    later.append(item)
                    continue
                self.incremental.references[saved.key] = dict(
                    self.incremental.base.files[saved.key])  # type: ignore[union-attr]
                kept.append(WriteResult(index=item.index, size_in_bytes=saved.length,
                                        storage_data=_StorageInfo(
                                            relative_path=_UP + saved.key,
                                            offset=saved.offset, length=saved.length)))
        finally:
            self.close()
        return later, kept

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


@dataclasses.dataclass(frozen=True)
class _Hashed:
    """A write result's storage record with the item's facts for content.json, while the
    results travel to the coordinator (never written: ``finish`` strips it)."""

    info: Any
    fact: dict[str, Any]


def _content_document(results: list[list[Any]]) -> tuple[bytes, list[list[Any]]]:
    """content.json's bytes from the gathered results, and the results as DCP expects them."""
    from torch.distributed.checkpoint.storage import WriteResult

    records, plain = [], []
    for batch in results:
        clean = []
        for result in batch:
            data = result.storage_data
            if isinstance(data, _Hashed):
                records.append({**data.fact, "path": data.info.relative_path,
                                "offset": int(data.info.offset),
                                "length": int(data.info.length)})
                result = WriteResult(index=result.index, size_in_bytes=result.size_in_bytes,
                                     storage_data=data.info)
            clean.append(result)
        plain.append(clean)
    records.sort(key=lambda item: (item["fqn"], item["offsets"]))
    body = {"format": CONTENT_FORMAT, "version": CONTENT_VERSION, "records": records}
    return json.dumps(body, indent=0, allow_nan=False).encode(), plain


@functools.cache
def incremental_writer_class(writer_class: type) -> type:
    """``writer_class`` (a DCP ``FileSystemWriter``) whose ``write_data``, once given an
    ``incremental`` (an incremental save, even on an empty base), hashes every tensor item
    and leaves out those found unchanged in the base, and whose ``finish`` (the
    coordinator) then writes ``content.json`` beside DCP's metadata."""
    from torch.futures import Future

    class IncrementalWriter(writer_class):
        incremental: Incremental

        def write_data(self, plan: Any, planner: Any) -> Any:
            if getattr(self, "incremental", None) is None:  # not an incremental save
                return super().write_data(plan, planner)
            split = self.incremental.split(list(plan.items), planner)
            try:
                written = super().write_data(dataclasses.replace(plan, items=split.now),
                                             planner).wait()
                later, kept = split.settle()
            finally:
                split.close()
            if later:
                prefix = dataclasses.replace(
                    plan.storage_data, prefix=plan.storage_data.prefix + _LATE_PREFIX)
                written = [*written, *super().write_data(dataclasses.replace(
                    plan, items=later, storage_data=prefix), planner).wait()]
            results = []
            for result in [*written, *kept]:
                fact = split.facts.get(_index_key(result.index.fqn, result.index.offset or ()))
                if fact is not None:
                    result = dataclasses.replace(result,
                                                 storage_data=_Hashed(result.storage_data, fact))
                results.append(result)
            done: Future[list[Any]] = Future()
            done.set_result(results)
            return done

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            if not any(isinstance(r.storage_data, _Hashed) for batch in results for r in batch):
                return super().finish(metadata, results)  # nothing hashed: no content.json
            document, plain = _content_document(results)
            with self.fs.create_stream(self.fs.concat_path(self.path, CONTENT_FILE),
                                       "wb") as stream:
                stream.write(document)
            super().finish(metadata, plain)

    IncrementalWriter.__qualname__ = f"Incremental{writer_class.__qualname__}"
    return IncrementalWriter
