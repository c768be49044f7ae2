"""Staging overlapped with training: an async DCP save started on one reused worker thread.

Owns: ``StagingOverlap``: with it attached to a ``DcpBackend`` an async ``write`` returns at
once and the worker builds the state dicts, plans and copies the tensors to host memory
while the training loop goes on; ``fence`` blocks until that copy is finished. Whoever
attaches it must fence before anything changes the saved tensors (an integration's
optimizer step pre-hook); the next write and ``close`` wait for the whole save anyway.

Must not import: jax, orbax.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["StagingOverlap", "attach", "detach"]


class StagingOverlap:
    """One worker thread (kept between saves) and the event set once the current save's
    host copy is made (or its staging failed: the error stays on the write's handle).

    Concurrency contract: ``submit`` is called from the backend's writing thread with no
    other save in flight; ``fence`` from any thread, any number of times."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._staged = threading.Event()
        self._staged.set()

    def submit(self, stage: Callable[[], Any]) -> Future[None]:
        """Run ``stage`` (returns DCP's upload future, or None when nothing is left to wait
        for) on the worker; the returned future finishes when the upload does."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-dcp-stage")
        self._staged.clear()
        return self._executor.submit(self._run, stage)

    def _run(self, stage: Callable[[], Any]) -> None:
        try:
            upload = stage()
        finally:
            self._staged.set()
        if upload is not None:
            upload.result()

    def fence(self, timeout_s: float | None = None) -> bool:
        """Block until the in-flight save's host copy is made; False on a timeout."""
        return self._staged.wait(timeout_s)

    def close(self) -> None:
        """Stop the worker once its job is done. Idempotent."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def attach(backend: Any) -> StagingOverlap:
    """Make ``backend``'s async writes overlap their staging (the one attached already, if
    any); the caller fences before the saved tensors change.

    Args:
        backend: a ``torch_bridge.DcpBackend``.
    """
    current = getattr(backend, "_overlap", None)
    if current is None:
        current = StagingOverlap()
        backend._overlap = current
    return current


def detach(backend: Any) -> None:
    """Stage ``backend``'s next writes on the calling thread again (after any in flight).

    Args:
        backend: a ``torch_bridge.DcpBackend``.
    """
    current = getattr(backend, "_overlap", None)
    if current is not None:
        current.fence()
        backend._overlap = None
        current.close()
