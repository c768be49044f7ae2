"""Process-wide thread pools shared by the I/O code: ``SharedThreads``.

Owns one pattern the writers and readers repeat: a pool of a few threads started on first
use and kept from call to call (a pool made per call starts a thread per task, about a
millisecond each on a busy host), started afresh in a forked child, where the parent's
threads do not exist.

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["SharedThreads"]


class SharedThreads:
    """One lazily started ``ThreadPoolExecutor`` per instance (module-level constants).

    Concurrency contract: ``get`` may be called from any thread; the tasks callers submit
    must not wait on one another, since every caller in the process shares the threads.

    Args:
        workers: the pool's threads.
        name: their name prefix (``jaxckpt-...``), seen in stack dumps.
    """

    def __init__(self, workers: int, name: str):
        self._workers = workers
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def get(self) -> ThreadPoolExecutor:
        """The pool, started on the first call in this process."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._workers,
                                                thread_name_prefix=self._name)
            return self._pool

    def _forget(self) -> None:
        """In a forked child: the parent's threads are not there; start new ones on demand."""
        self._pool, self._lock = None, threading.Lock()
