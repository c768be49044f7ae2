"""Deferred checksums of one restore, shared between a checking thread and the backend.

Owns: ``DeferredChecks``, the hand-over by which a backend that reads a file whole checks that
file's deferred checksum (``manifest.DEFER_CHECKSUMS_OVER``) from the bytes it read, so that
the file is not read twice, while the manager's checking thread checks the rest; the
hand-over of those files' bytes where the manager fetched them ahead (``prefetch``); and,
for a partial restore, the scope that a backend gives of the files its read can touch
(``limit``), outside which nothing is checked, since nothing there is read.

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from jaxckpt.commit.prefetch import Fetched, ReadAhead
from jaxckpt.core.manifest import algorithm_of, checksum_problem

__all__ = ["DeferredChecks"]


class DeferredChecks:
    """The deferred checksums of one restore, shared between the thread that checks them
    and a backend that checks some of them itself while it reads the same bytes.

    The manager offers the deferred entries of each directory being restored, before the
    read starts. A backend that reads a file whole ``claim``s it (it then computes the
    checksum of what it read and ``settle``s it, which records a mismatch) and ``close``s
    once it knows which files it claims; the checking thread waits for that, then checks
    the ``unclaimed`` rest. Each file is checked exactly once. ``close`` is idempotent; the
    manager also calls it when the read ends, so the checking thread never waits forever.

    Concurrency contract: every method may be called from any thread of one process.
    """

    def __init__(self, ahead: ReadAhead | None = None) -> None:
        """``ahead``: the fetches the manager started for this restore's bulk files, which a
        backend takes through ``fetched`` instead of fetching those files itself."""
        self._ahead = ahead
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # realpath of the file -> (directory it was offered with, manifest path, entry)
        self._offered: dict[str, tuple[str, str, dict[str, Any]]] = {}
        self._claimed: dict[str, tuple[str, str, dict[str, Any]]] = {}
        self._settled: set[str] = set()
        self._problems: dict[str, list[str]] = {}

    def offer(self, path: str, entries: list[tuple[str, dict[str, Any]]]) -> None:
        with self._lock:
            for rel, info in entries:
                full = os.path.realpath(os.path.join(path, *rel.split("/")))
                self._offered[full] = (path, rel, info)

    def limit(self, directory: str, prefixes: list[str]) -> None:
        """A partial restore's read of ``directory`` touches no file outside ``prefixes``
        (directories): the offered entries of ``directory`` outside them are withdrawn, as
        nothing restored comes from them (a backend calls this before ``close``; without it
        every offered file is checked)."""
        inside = os.path.realpath(directory) + os.sep
        scope = tuple(os.path.realpath(prefix).rstrip(os.sep) + os.sep for prefix in prefixes)
        with self._lock:
            for full in list(self._offered):
                if full.startswith(inside) and not full.startswith(scope):
                    del self._offered[full]

    def claim(self, file: str) -> tuple[str, str] | None:
        """Take over the check of ``file``: its (algorithm, expected checksum), or None when
        it is not offered (not deferred, already claimed, or claiming has closed)."""
        with self._lock:
            if self._closed.is_set():
                return None
            full = os.path.realpath(file)
            item = self._offered.pop(full, None)
            if item is None:
                return None
            self._claimed[full] = item
            algorithm = algorithm_of(item[2])
            return algorithm, item[2][algorithm]

    def offered(self, file: str) -> str | None:
        """The algorithm of ``file``'s check while it is offered and not claimed, else None:
        a backend that reads a file before it knows it will claim it checksums it with that
        as the bytes come, and claims it later."""
        with self._lock:
            item = self._offered.get(os.path.realpath(file))
            return None if item is None else algorithm_of(item[2])

    def fetched(self, file: str) -> Fetched | None:
        """The bytes of the claimed ``file`` as fetched ahead (``read_ahead``), with their
        checksum computed as they came, once the fetch ended; None when none was started
        for it (fetch it then). Settle the claim with that checksum before loading any of
        those bytes."""
        return None if self._ahead is None else self._ahead.take(file)

    def settle(self, file: str, checksum: str) -> None:
        """The checksum of what was read from a claimed ``file``."""
        with self._lock:
            full = os.path.realpath(file)
            path, rel, info = self._claimed[full]
            self._settled.add(full)
            problem = checksum_problem(rel, info, checksum)
            if problem:
                self._problems.setdefault(path, []).append(problem)

    def close(self) -> None:
        """No more claims: the checking thread may start on what is left."""
        with self._lock:
            self._closed.set()

    def unclaimed(self, path: str) -> list[tuple[str, dict[str, Any]]]:
        """Once claiming has closed: the entries of ``path`` that nobody claimed."""
        self._closed.wait()
        with self._lock:
            return sorted((rel, info) for owner, rel, info in self._offered.values()
                          if owner == path)

    def problems(self, path: str) -> list[str]:
        """Once the read ended: mismatches in the claimed files of ``path``, and claimed
        files whose checksum never came (a read that stopped half way vouches for nothing)."""
        with self._lock:
            unsettled = sorted(rel for full, (owner, rel, _) in self._claimed.items()
                               if owner == path and full not in self._settled)
            return list(self._problems.get(path, [])) + [
                f"{rel}: claimed by the reader but its checksum was never computed"
                for rel in unsettled]
