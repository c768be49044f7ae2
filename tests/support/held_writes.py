"""A real backend whose asynchronous writes stay in flight a while: their handle's ``wait``
first sleeps ``seconds``, then waits for the real write. And the two checks of a sync save
that both managers (Orbax and DCP) run with it.

Tests use it to make "this save is still uncommitted when the next call comes" certain
rather than likely (the data written, and so the checkpoint, are untouched). The sleep is
time that must pass for the failure being pinned to show, not a synchronisation: a test
never waits for it to end, it waits for the save.
"""

from __future__ import annotations

import time
from pathlib import Path
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


def check_final_sync_save(manager_class: Any, backend: Any, root: Path, state: Any) -> None:
    """The README's final save: the loop's last ``maybe_save`` already started an async save
    of that step (held in flight 1 s). ``save(mode="sync")`` must not hand back that report
    still in flight (a SIGKILL after it lost the step): on return the step is committed and
    ``committed_steps()`` shows it and its retention (``keep_last_n=2``)."""
    from jaxckpt import Every, RecoverConfig, StepInfo
    from jaxckpt.core.layout import COMMIT_MARKER

    config = RecoverConfig(every=Every(steps=2), keep_last_n=2)
    with manager_class(root, recover=config, mode="async",
                       backend=hold_async_writes(backend, 1.0), preemption_signals=()) as mgr:
        for step in range(6):
            mgr.maybe_save(StepInfo(0, step, step), state)
        report = mgr.save(state=state, mode="sync")
        assert report.step == 5 and report.done() and report.error is None, report
        assert (root / "recover" / "step_00000005" / COMMIT_MARKER).exists()
        assert mgr.committed_steps() == [3, 5]
    backend.close()


def committed_after_each_sync_save(manager_class: Any, root: Path, state: Any,
                                   steps: int) -> list[list[int]]:
    """``committed_steps()`` right after each of ``steps`` sync saves (``keep_last_n=2``)."""
    from jaxckpt import Every, RecoverConfig, StepInfo

    config = RecoverConfig(every=Every(steps=1), keep_last_n=2)
    seen = []
    with manager_class(root, recover=config, mode="sync", preemption_signals=()) as mgr:
        for step in range(steps):
            mgr.maybe_save(StepInfo(0, step, step), state)
            seen.append(mgr.committed_steps())
    return seen
