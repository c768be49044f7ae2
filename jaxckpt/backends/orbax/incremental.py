"""Incremental writes and reads of the Orbax backend: which chunk files an earlier checkpoint
already holds, and where a read finds the files a checkpoint refers to.

Owns: :class:`Reuse` (one write's decisions against its ``IncrementalBase``: a chunk file is
referred to, not written, when the base holds a file at the same path whose size and
xxh3-128 equal those of the exact bytes this write would put there, and the base's
tree.json records the same leaves (paths, shapes, dtypes, pack offsets) under its storage
name; for a chunk of a grid, also the same zarr.json), and :func:`redirects` (a read's map
from a file of the checkpoint to the earlier file it refers to). Files keep their path
inside the checkpoint across checkpoints, so a reference is found from the manifest's ref
keys alone (``core.layout.parse_ref_key``).

Must not import: torch. Concurrency: a ``Reuse`` is used by every I/O thread of one write.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from jaxckpt.backends.base import IncrementalBase
from jaxckpt.backends.orbax import zarr_format
from jaxckpt.backends.orbax.files import ReadableFiles
from jaxckpt.backends.orbax.tree import ARRAYS_DIR, ZARR_JSON, SavedLeaf, parse_leaves
from jaxckpt.backends.orbax.unchanged import KnownHashes, Seen
from jaxckpt.core.content_hash import HASH_NAME, content_hash
from jaxckpt.core.layout import parse_ref_key
from jaxckpt.core.tree_record import parse_tree_record
from jaxckpt.storage.buffers import ALIGN
from jaxckpt.storage.threads import SharedThreads

_T = TypeVar("_T")

__all__ = ["Redirected", "Reuse", "redirects", "leaves_by_name"]


def leaves_by_name(tree_json: bytes | str, directory: str) -> dict[str, tuple[SavedLeaf, ...]]:
    """The leaves of a tree.json text grouped by storage name, in path order."""
    data = tree_json.encode("utf-8") if isinstance(tree_json, str) else tree_json
    document = parse_tree_record(data, directory)
    grouped: dict[str, list[SavedLeaf]] = {}
    for leaf in parse_leaves(document["leaves"], document.get("packs") or []).values():
        grouped.setdefault(leaf.name, []).append(leaf)
    return {name: tuple(sorted(leaves)) for name, leaves in grouped.items()}


class Reuse:
    """What one incremental write refers to instead of writing (see the module docstring).

    Args:
        base: the write's ``IncrementalBase`` (its ``files`` may be empty: the run's first
            incremental save, which refers to nothing but records the content hashes).
        tree_json: the text of the tree.json this write records.
        read_small: reads a small file of the base (its tree.json, a zarr.json) by path.
        known: the backend's ``unchanged.KnownHashes`` (a single-process native write), with
            ``seen``: what ``KnownHashes.see`` saw of each storage name's arrays. A file of
            the very arrays an earlier write hashed is decided without reading its bytes
            (``carry``), and a file that changes at every save is not hashed.

    The base's tree.json is read once, by the first I/O thread that asks; a base whose
    metadata cannot be read is referred to for nothing (the data is written again).
    """

    def __init__(self, base: IncrementalBase, tree_json: str,
                 read_small: Callable[[str], bytes], *, known: KnownHashes | None = None,
                 seen: Mapping[str, Seen] | None = None):
        self.base = base
        self._known = known if seen is not None else None
        self._seen = seen or {}
        self._tree_json = tree_json
        self._read_small = read_small
        self._lock = threading.Lock()
        self._ready = False
        self._same: set[str] = set()  # storage names recording the same leaves as the base
        self._keys: dict[str, str] = {}  # path inside the arrays dir -> the base's key
        self._zarr: dict[str, bytes | None] = {}  # the base's zarr.json by storage name
        #: ``{key: the base's entry}`` of the files referred to so far.
        self.references: dict[str, dict[str, Any]] = {}

    def _prepare(self) -> None:
        """Once, under the lock: which storage names match and where the base's files are."""
        self._ready = True
        if not self.base.files:
            return
        directory = self.base.directory.rstrip("/")
        prefix = f"{directory.rsplit('/', 1)[-1]}/{ARRAYS_DIR}/"
        try:
            mine = leaves_by_name(self._tree_json, "this write")
            theirs = leaves_by_name(self._read_small(f"{directory}/tree.json"), directory)
        except Exception:  # noqa: BLE001 - an unreadable base: write everything again
            return
        self._same = {name for name, leaves in mine.items() if theirs.get(name) == leaves}
        for key in self.base.files:
            parsed = parse_ref_key(key)
            if parsed is not None and parsed[1].startswith(prefix):
                self._keys[parsed[1][len(prefix):]] = key

    def _base_zarr(self, name: str) -> bytes | None:
        if name not in self._zarr:
            path = f"{self.base.directory.rstrip('/')}/{ARRAYS_DIR}/{name}/{ZARR_JSON}"
            try:
                self._zarr[name] = self._read_small(path)
            except Exception:  # noqa: BLE001 - unreadable: not the same array
                self._zarr[name] = None
        return self._zarr[name]

    @staticmethod
    def ahead(work: Callable[..., _T], *args: Any) -> concurrent.futures.Future[_T]:
        """``work(*args)`` started on the hashing threads (a write's decisions, made ahead
        of the I/O threads that write the files)."""
        return _hashing_threads.get().submit(work, *args)

    def _base_entry(self, relative: str) -> tuple[str | None, Mapping[str, Any] | None]:
        """The base's key and manifest entry of the file at ``relative`` (below ``arrays/``),
        where the base records the same leaves under its storage name; else (key, None)."""
        name = relative.split("/", 1)[0]
        with self._lock:
            if not self._ready:
                self._prepare()
            key = self._keys.get(relative)
            entry = self.base.files[key] if key is not None and name in self._same else None
        return key, entry

    def _refer(self, key: str | None, entry: Mapping[str, Any]) -> None:
        with self._lock:
            self.references[key] = dict(entry)  # type: ignore[index]

    def carry(self, relative: str, nbytes: int) -> tuple[int, str, bool] | None:
        """``consider``'s answer for the chunk file ``relative`` of ``nbytes`` data bytes
        without reading them, when its objects are those an earlier write hashed and the
        base's file has that hash (then it is referred to); else None (fill and consider)."""
        name = relative.split("/", 1)[0]
        seen = self._seen.get(name)
        if self._known is None or seen is None or seen.known is None:
            return None
        offset, digest = seen.known
        key, entry = self._base_entry(relative)
        if entry is None or not _same_file(entry, digest,
                                           offset + nbytes + zarr_format.INDEX_BYTES):
            return None
        self._refer(key, entry)
        self._known.record(name, seen, offset, digest, changed=False)
        return offset, digest, True

    def consider(self, relative: str, array: np.ndarray, offset: int, *,
                 zarr_json: str | None = None) -> tuple[int, str | None, bool]:
        """Where the chunk file ``relative`` (below ``arrays/``) holding ``array`` puts its
        bytes, the content hash of that file (None: not hashed, see ``known``), and whether
        the base's file is used instead of writing it. ``offset``: where this write would
        put them (``chunk_io.data_offset``, which follows the array's address); where the
        base holds the file at another offset, that one is taken, so that an array that
        moved in memory is still found equal. ``zarr_json`` (a chunk of a grid, always at
        offset 0): the array's zarr.json text, compared with the base's, as tree.json does
        not record the chunk shape."""
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        name = relative.split("/", 1)[0]
        key, entry = self._base_entry(relative)
        seen = self._seen.get(name) if self._known is not None else None
        known = None if seen is None else seen.known
        if known is not None and entry is None:
            offset = known[0]  # any offset will do: the one whose hash is known
        if entry is not None and zarr_json is None:
            theirs = entry.get("size", -1) - flat.size - zarr_format.INDEX_BYTES
            offset = theirs if 0 <= theirs < ALIGN and theirs % 64 == 0 else offset
        if known is not None and known[0] != offset:
            known = None
        if seen is not None:
            assert self._known is not None
            # The run's first incremental save (nothing to refer to) hashes everything: its
            # hashes are what the next save compares with.
            if known is None and self.base.files and self._known.skip_hash(name, seen):
                self._known.record(name, seen, offset, None, changed=True)
                return offset, None, False
        index = zarr_format.shard_index(flat.size, offset)
        digest = known[1] if known is not None else content_hash([bytes(offset), flat, index])
        referred = _same_file(entry, digest, offset + flat.size + len(index))
        if referred and zarr_json is not None:
            with self._lock:
                referred = self._base_zarr(name) == zarr_json.encode("utf-8")
        if referred:
            assert entry is not None
            self._refer(key, entry)
        if seen is not None:
            assert self._known is not None
            self._known.record(name, seen, offset, digest,
                               changed=None if entry is None else not referred)
        return offset, digest, referred


def _same_file(entry: Mapping[str, Any] | None, digest: str, size: int) -> bool:
    """Whether the base's manifest ``entry`` records a file of this content hash and size."""
    return entry is not None and entry.get(HASH_NAME) == digest and entry.get("size") == size


#: The threads that hash the files of incremental writes ahead of the I/O threads (two:
#: the hash runs at memory speed; more would take cores from the writes).
_hashing_threads = SharedThreads(2, "jaxckpt-hash")


def redirects(directory: str, references: Mapping[str, Mapping[str, Any]] | None,
              ) -> dict[str, str]:
    """Where a read of the state directory ``directory`` finds the files its checkpoint
    refers to: ``{path of the file in directory: path of the earlier checkpoint's file}``.
    The keys are relative to the parent of the checkpoint directory (``recover/``)."""
    if not references:
        return {}
    directory = directory.rstrip("/")
    checkpoint, _, state = directory.rpartition("/")
    recover_dir = checkpoint.rpartition("/")[0]
    found: dict[str, str] = {}
    for key in references:
        parsed = parse_ref_key(key)
        if parsed is None or not parsed[1].startswith(f"{state}/"):
            continue
        found[f"{checkpoint}/{parsed[1]}"] = f"{recover_dir}/{key}"
    return found


class Redirected:
    """The reading half of ``ArrayFiles`` (what ``read.read_native`` uses) for an incremental
    checkpoint: chunk files it refers to are read at the earlier checkpoint's path
    (``redirects``), everything else as ``files`` reads it.

    Args:
        files: the ``files.ArrayFiles`` of the checkpoint's directory.
        redirect: ``{path in the checkpoint: path of the file it refers to}``.
    """

    def __init__(self, files: ReadableFiles, redirect: Mapping[str, str]):
        self._files = files
        self._redirect = redirect

    def read_small(self, path: str, limit: int) -> bytes:
        return self._files.read_small(path, limit)

    def read_chunk(self, path: str, nbytes: int, *, algorithm: str | None,
                   offset: int) -> tuple[np.ndarray, str | None]:
        return self._files.read_chunk(
            self._redirect.get(path, path), nbytes, algorithm=algorithm, offset=offset)
