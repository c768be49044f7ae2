"""Preemption: signals that ask for a checkpoint at the next step boundary, the decision of
what is due shared across processes, and ending the process once that checkpoint is safe.

Owns: ``Preemption``: installing the signal handlers (main thread only) and restoring the
previous ones, the pending request, ``agree`` (the primary's decision of what is due and its
signal, shared by one small broadcast per step) and ``end_after``/``end_process`` (with
``on_preemption="exit"``, the process ends by the signal's default action once the
checkpoint committed and the manager closed).

Must not import: jax, orbax, torch, or the other parts of the manager.

Concurrency: the training thread; a handler only records the signal, the save happens at
the next ``maybe_save``. ``agree`` is a collective: every process calls it at every step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

__all__ = ["Preemption", "end_process", "signal_name"]

log = logging.getLogger("jaxckpt")

# agree()'s broadcast: bit 0 recover due, bit 1 export due, bit 2 preempt, then the signal.
_SIGNAL_SHIFT = 3


class Preemption:
    """The preemption state of one manager.

    ``process_count`` and ``broadcast`` (the backend's ``broadcast_int``: the primary's value
    on every process) share the decision; ``timed``: some trigger has a seconds condition
    (clocks differ across hosts, so the primary decides those too); ``on_preemption``:
    "exit" or "continue" (see ``end_after``).
    """

    def __init__(self, *, process_count: int, broadcast: Callable[[int], int], timed: bool,
                 on_preemption: str = "exit"):
        self._count = process_count
        self._on_preemption = on_preemption
        self._broadcast = broadcast
        self._timed = timed
        self._signal: int | None = None
        self._preempted = False
        # The signal whose request was acted on (the primary's in a multi-process run): the
        # one the process ends by. 0: a request made without a signal.
        self._cause = 0
        self._previous_handlers: dict[int, Any] = {}

    @property
    def preempted(self) -> bool:
        """A request was turned into a checkpoint (or found recovery off): stop the loop."""
        return self._preempted

    @property
    def cause(self) -> int:
        """The signal number of the request acted on (the primary's, shared by ``agree``);
        0 when it came from ``request()`` without one, or nothing was acted on."""
        return self._cause

    @property
    def pending_signal(self) -> int:
        """The signal of a request not acted on yet (0: none, or one without a signal)."""
        return (self._signal or 0) if self.requested else 0

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
            if preempt:
                self._cause = self._signal or 0
            return recover_reason, export_reason, preempt
        bits = (1 if recover_reason else 0) | (2 if export_reason else 0) | (4 if preempt else 0)
        if preempt:
            bits |= (self._signal or 0) << _SIGNAL_SHIFT
        bits = self._broadcast(bits)
        if bits & 4:
            self._cause = bits >> _SIGNAL_SHIFT
        return ((recover_reason or "seconds") if bits & 1 else None,
                (export_reason or "seconds") if bits & 2 else None, bool(bits & 4))

    def end_after(self, saves: Sequence[Any], *, wait: Callable[[], None],
                  barrier: Callable[[str, float], None], close: Callable[[], None]) -> None:
        """With ``on_preemption="exit"`` and a request from a signal acted on by a
        ``maybe_save`` that started ``saves`` (its reports): ``wait`` for them to finish (the
        manager's ``wait``: it raises if the checkpoint failed, and the process then ends by
        that error; with ``on_write_error="warn"`` it only warns), ``barrier`` so that every
        process has, ``close`` the manager (lease released, backend closed), then end the
        process by that signal. Returns at once otherwise (``"continue"``, or a request made
        without a signal)."""
        signum = self._cause
        if self._on_preemption != "exit" or not signum:
            return
        wait()
        barrier("jaxckpt.preempted", 600.0)
        close()
        name = signal_name(signum)
        saved = [r for r in saves if r.kind == "recover" and r.error is None]
        log.warning("jaxckpt: %s: %s; ending the process as %s would "
                    "(CheckpointManager(on_preemption='continue') leaves that to a loop that "
                    "stops on mgr.preempted).", name,
                    f"the checkpoint of step {saved[0].step} is committed" if saved
                    else "no checkpoint was written (recovery is off, or the save failed)",
                    name)
        end_process(signum)

    def end_if_pending(self) -> None:
        """At a clean ``close``: a preemption signal that arrived after the last
        ``maybe_save`` (none acted on it) ends the process as it would have, now that every
        save finished, with ``on_preemption="exit"``."""
        signum = self.pending_signal
        if self._on_preemption != "exit" or not signum:
            return
        log.warning("jaxckpt: %s arrived after the last maybe_save; every save has finished; "
                    "ending the process as %s would.", signal_name(signum), signal_name(signum))
        end_process(signum)

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


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; the number when the platform has no name for it."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def end_process(signum: int) -> NoReturn:
    """End this process by ``signum``'s default action, as the signal would have without a
    handler: the exit status says "terminated by SIGTERM" (-15 to ``subprocess``, 143 to a
    shell), which schedulers and ``jaxckpt run`` read as a stop on request. Python's
    buffered output is flushed first (a signal death skips it); ``atexit`` and ``finally``
    blocks do not run, as with the signal itself. A signal whose default action is not to
    terminate ends the process with status 128 + ``signum`` instead."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signum, signal.SIG_DFL)  # main thread only; else the handler is ours
    with contextlib.suppress(ValueError, OSError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        signal.raise_signal(signum)
    os._exit(128 + signum)
