"""Fetching a restore's bulk files before its reader asks for them.

Owns: ``ReadAhead``, whole objects of one ``Storage`` fetched on background threads as soon
as the commit manifest names them, each into a fresh buffer with its checksum computed as
the bytes land (``Storage.read_into``'s ``progress``), and handed over once (``take``) to
the reader; what it takes is checked against the manifest before anything is loaded.

Must not import: jax, orbax, torch.

Concurrency: ``start``, ``take`` and ``cancel`` may be called from any thread; each fetch
is taken at most once; after ``cancel`` nothing started before it is handed out, and
running fetches stop at their next piece (``start`` cancels the previous candidate's).
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading
from collections.abc import Iterable
from typing import Any

from jaxckpt.core.checksum import extend
from jaxckpt.core.manifest import algorithm_of
from jaxckpt.storage.base import Storage

__all__ = ["Fetched", "ReadAhead"]

#: fetches run at once (a restore of several processes' files has a few of them).
_THREADS = 8

Fetched = tuple[memoryview, str]
"""The bytes of one object as fetched, and their checksum (8 hex digits, in the algorithm of
the manifest entry it was started with)."""


class _Cancelled(Exception):
    """Raised inside a fetch's progress call to stop a fetch nobody will take."""


def _fresh(nbytes: int) -> memoryview:
    """A buffer of ``nbytes`` filled once and handed over: an anonymous private map, not
    ``bytearray``/numpy memory (numpy advises huge pages, whose cost swings with the
    memory's history on a VM: ``storage.buffers.fresh_blocks`` has the figures)."""
    if nbytes <= 0:
        return memoryview(bytearray(0))
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def key(path: str) -> str:
    """The name a fetch is filed under: its path normalised as ``DeferredChecks`` does."""
    return os.path.realpath(path)


class ReadAhead:
    """Whole objects of ``storage`` fetched ahead of their reader (module docstring)."""

    def __init__(self, storage: Storage):
        self._storage = storage
        self._lock = threading.Lock()
        self._futures: dict[str, concurrent.futures.Future[Fetched]] = {}
        self._stop = threading.Event()

    def start(self, files: Iterable[tuple[str, dict[str, Any]]]) -> None:
        """Fetch each of ``files`` ((path, manifest entry)) in the background, replacing
        (cancelling) whatever an earlier ``start`` fetched. One byte more than the entry's
        size is asked for, so an object longer than its manifest says shows in the bytes
        taken (and then fails their checksum)."""
        self.cancel()
        stop = threading.Event()
        files = list(files)
        if not files:
            return
        pool = concurrent.futures.ThreadPoolExecutor(min(_THREADS, len(files)),
                                                     thread_name_prefix="jaxckpt-ahead")
        try:
            with self._lock:
                self._stop = stop
                for path, info in files:
                    self._futures[key(path)] = pool.submit(
                        self._fetch, path, int(info["size"]) + 1, algorithm_of(info), stop)
        finally:
            pool.shutdown(wait=False)  # the fetches run on; the threads end with them

    def _fetch(self, path: str, nbytes: int, algorithm: str,
               stop: threading.Event) -> Fetched:
        view = _fresh(nbytes)
        state = {"crc": 0, "done": 0}

        def landed(count: int) -> None:  # bytes [0, count) of view are in: checksum the news
            if stop.is_set():
                raise _Cancelled
            state["crc"] = extend(algorithm, state["crc"], view[state["done"]:count])
            state["done"] = count

        count = self._storage.read_into(path, view, progress=landed)
        if state["done"] != count:  # a storage that reports less often than it reads
            landed(count)
        return view[:count], f"{state['crc']:08x}"

    def take(self, path: str) -> Fetched | None:
        """The fetched bytes of ``path`` and their checksum, waiting for the fetch to end;
        None when none was started for it (or it was cancelled or failed: the caller then
        fetches it itself, meeting the error, if any, where it can report it)."""
        with self._lock:
            future = self._futures.pop(key(path), None)
        if future is None:
            return None
        try:
            return future.result()
        except Exception:  # noqa: BLE001 - the caller's own fetch reports it
            return None

    def cancel(self) -> None:
        """Stop every fetch started so far and drop what they fetched."""
        with self._lock:
            self._stop.set()
            futures, self._futures = self._futures, {}
        for future in futures.values():
            future.cancel()
