"""Orbax backends that let the demo and the benchmark watch or delay a write.

Owns: ``HeldBackend`` (the demo worker's test hook: keeps one save uncommitted a while
longer, so a parent process can SIGKILL the worker while that save is certainly in flight)
and ``TimedBackend`` (the benchmark's: records how long each ``write`` call took, which
splits a sync save into the backend's write and the manager's commit). Both subclass
``OrbaxBackend`` and override ``write`` alone: every other method, and every capability the
backend declares, is the Orbax backend's own, so the manager treats them exactly like it.

Importing this module imports jax and orbax (through ``jaxckpt.backends.orbax``); the demo and
the benchmark import it only where they build a backend. Never imported by the library.
"""

from __future__ import annotations

import time
from typing import Any

from jaxckpt.backends.base import IncrementalBase
from jaxckpt.backends.orbax.backend import OrbaxBackend, OrbaxWriteHandle

__all__ = ["HeldBackend", "TimedBackend"]


class _HeldWrite:
    """A write handle whose ``wait`` first sleeps, then waits for the real write."""

    def __init__(self, handle: OrbaxWriteHandle, hold_s: float):
        self._handle = handle
        self._hold_s = hold_s

    @property
    def references(self) -> dict[str, dict[str, Any]] | None:
        return self._handle.references

    @property
    def checksums(self) -> dict[str, dict[str, Any]] | None:
        """The real write's checksums (a ``WriteHandle`` member the commit reads)."""
        return self._handle.checksums

    @property
    def durable_dirs(self) -> tuple[str, ...]:
        """The real write's directories made durable (an optional member the commit reads)."""
        return self._handle.durable_dirs

    def wait(self) -> None:
        time.sleep(self._hold_s)
        self._handle.wait()


class HeldBackend(OrbaxBackend):
    """An Orbax backend that keeps the write of step ``at_step`` "in flight" for ``hold_s``
    more seconds before its commit may proceed. Only that one save is held (holding every
    save would make the next one wait). Numerics are untouched.

    Concurrency contract: as ``OrbaxBackend``; ``current_step`` is set by the training
    thread before each save call and read by ``write`` on that same thread.
    """

    def __init__(self, *, hold_s: float, at_step: int, **options: Any):
        super().__init__(**options)
        self.hold_s = hold_s
        self.at_step = at_step
        #: the step being saved; set by the training loop before each save call.
        self.current_step = -1

    def write(self, directory: str, state: Any, *, asynchronous: bool,
              base: IncrementalBase | None = None) -> Any:
        handle = super().write(directory, state, asynchronous=asynchronous, base=base)
        if self.current_step != self.at_step:
            return handle
        return _HeldWrite(handle, self.hold_s)


class TimedBackend(OrbaxBackend):
    """An Orbax backend that appends the duration of every ``write`` call to ``write_s``.

    Concurrency contract: as ``OrbaxBackend``; ``write_s`` is appended to on the thread
    that calls ``write`` (the manager's caller), and read there between saves.
    """

    def __init__(self, **options: Any):
        super().__init__(**options)
        #: seconds each ``write`` call took, in call order.
        self.write_s: list[float] = []

    def write(self, directory: str, state: Any, *, asynchronous: bool,
              base: IncrementalBase | None = None) -> OrbaxWriteHandle:
        start = time.perf_counter()
        handle = super().write(directory, state, asynchronous=asynchronous, base=base)
        self.write_s.append(time.perf_counter() - start)
        return handle
