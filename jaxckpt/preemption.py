"""Preemption: signals that ask for a checkpoint at the next step boundary, and the decision
of what is due shared across processes.

Owns: installing the preemption signal handlers (only from the main thread) and putting the
previous ones back, the pending request (from a signal or ``request``), whether the run was
preempted, and ``agree``: in multi-process runs with time triggers or signal handling, the
primary's decision of what is due wins, shared by one small broadcast per step.

Must not import: jax, orbax, torch, or the other parts of the manager.

Concurrency contract: used from the training thread. A handler only records the signal (it
runs on the main thread between bytecodes); the save itself happens at the next
``maybe_save``. ``agree`` is a collective: every process calls it at every step, or none.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Preemption"]


class Preemption:
    """The preemption state of one manager.

    ``process_count`` and ``broadcast`` (the backend's ``broadcast_int``: the primary's value
    on every process) share the decision; ``timed``: some trigger has a seconds condition
    (clocks differ across hosts, so the primary decides those too).
    """

    def __init__(self, *, process_count: int, broadcast: Callable[[int], int], timed: bool):
        self._count = process_count
        self._broadcast = broadcast
        self._timed = timed
        self._signal: int | None = None
        self._preempted = False
        self._previous_handlers: dict[int, Any] = {}

    @property
    def preempted(self) -> bool:
        """A request was turned into a checkpoint (or found recovery off): stop the loop."""
        return self._preempted

    @property
    def requested(self) -> bool:
        """A request arrived and has not been acted on yet."""
        return self._signal is not None and not self._preempted

    def request(self, signum: int = 0) -> None:
        """Ask for a checkpoint at the next step boundary (the first request wins)."""
        if self._signal is None:
            self._signal = signum

    def mark_preempted(self) -> None:
        """The request is being acted on: the loop should stop after this step."""
        self._preempted = True

    def agree(self, recover_reason: str | None, export_reason: str | None,
              preempt: bool) -> tuple[str | None, str | None, bool]:
        """In multi-process runs with time triggers or preemption handling, the primary's
        decision wins (clocks and signal delivery differ across hosts), shared by one small
        broadcast per step. Step and epoch triggers agree by construction."""
        if self._count == 1 or not (self._timed or self._previous_handlers):
            return recover_reason, export_reason, preempt
        bits = (1 if recover_reason else 0) | (2 if export_reason else 0) | (4 if preempt else 0)
        bits = self._broadcast(bits)
        return ((recover_reason or "seconds") if bits & 1 else None,
                (export_reason or "seconds") if bits & 2 else None, bool(bits & 4))

    def install(self, signals: tuple[int, ...]) -> None:
        """Record ``signals`` as requests from now on (main thread only; else nothing)."""
        if not signals or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            # Only record: the save happens at the next step boundary, on the training thread.
            self.request(signum)

        for signum in signals:
            self._previous_handlers[signum] = signal.signal(signum, handler)

    def restore(self) -> None:
        """Put back the handlers ``install`` replaced (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
