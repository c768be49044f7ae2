"""A real backend whose asynchronous writes stay in flight a while: their handle's ``wait``
first sleeps ``seconds``, then waits for the real write.

Tests use it to make "this save is still uncommitted when the next call comes" certain
rather than likely (the data written, and so the checkpoint, are untouched). The sleep is
time that must pass for the failure being pinned to show, not a synchronisation: a test
never waits for it to end, it waits for the save.
"""

from __future__ import annotations

import time
from typing import Any


class _HeldHandle:
    def __init__(self, handle: Any, seconds: float):
        self._handle = handle
        self._seconds = seconds

    @property
    def checksums(self) -> Any:
        return self._handle.checksums

    def wait(self) -> None:
        if self._seconds:
            time.sleep(self._seconds)
            self._seconds = 0.0
        self._handle.wait()


def hold_async_writes(backend: Any, seconds: float) -> Any:
    """``backend`` (an OrbaxBackend or DcpBackend instance), its asynchronous writes held
    ``seconds`` before they can finish. Returns the same backend."""
    write = backend.write

    def held(directory: str, state: Any, *, asynchronous: bool) -> Any:
        handle = write(directory, state, asynchronous=asynchronous)
        return _HeldHandle(handle, seconds) if asynchronous else handle

    backend.write = held
    return backend
