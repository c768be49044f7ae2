"""When a save is due and which checkpoints to keep: pure decisions, no I/O.

Owns: the any-of trigger rule (``due_reason``), the per-kind trigger clock (``SaveTrigger``),
the retention rule (``steps_to_delete``) and the save-mode resolution (``resolve_mode``). Every
function here is a pure function of its arguments (plus an injectable clock), so the rules are
tested with tables and no filesystem.

Must not import: jax, orbax, torch, or any module that does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from ..config import Every, StepInfo
from ..errors import ConfigError

__all__ = ["due_reason", "SaveTrigger", "steps_to_delete", "writes_periodic", "resolve_mode"]


def due_reason(every: Every, step: StepInfo, *, epoch_end: bool,
               seconds_since_last: float | None) -> str | None:
    """Why a save is due after ``step`` completed, or None when it is not.

    Conditions are checked in a fixed order (steps, epochs, seconds) and the first that holds
    is named; any one suffices. ``seconds_since_last`` is None when the clock has not started.
    """
    if every.steps is not None and (step.global_step + 1) % every.steps == 0:
        return "steps"
    if every.epochs is not None and epoch_end and (step.epoch + 1) % every.epochs == 0:
        return "epochs"
    if (every.seconds is not None and seconds_since_last is not None
            and seconds_since_last >= every.seconds):
        return "seconds"
    return None


class SaveTrigger:
    """The trigger of one kind of save (recover or export) with its own seconds clock.

    The clock starts when the trigger is made (the start of a run or of a resumed run) and
    restarts at every save of this kind, forced saves included.

    Concurrency contract: not thread-safe; used from the training thread only. In a
    multi-process run only the primary's decision counts (the manager shares it).
    """

    def __init__(self, every: Every, *, clock: Callable[[], float] = time.monotonic):
        self.every = every
        self._clock = clock
        self._last = clock()

    def seconds_since_last(self) -> float:
        return self._clock() - self._last

    def due(self, step: StepInfo, *, epoch_end: bool) -> str | None:
        """Why a save is due now, or None. Does not restart the clock."""
        return due_reason(self.every, step, epoch_end=epoch_end,
                          seconds_since_last=self.seconds_since_last())

    def mark_saved(self) -> None:
        """Restart the seconds clock (call when a save of this kind starts)."""
        self._last = self._clock()


def writes_periodic(keep_last_n: int | None) -> bool:
    """``keep_last_n == 0`` means no intermediate checkpoints: only forced saves write."""
    return keep_last_n != 0


def steps_to_delete(committed: Iterable[int], keep_last_n: int | None, *,
                    protected: Iterable[int] = ()) -> list[int]:
    """Which committed steps retention deletes, oldest first.

    ``committed`` are the steps of valid committed checkpoints (any order). None keeps all; 0
    behaves as 1 for the forced saves it allows (the latest is kept); N keeps the newest N.
    Steps in ``protected`` (being restored or read) are never returned, and never count as
    kept: protecting an old checkpoint must not cost a new one.
    """
    if keep_last_n is None:
        return []
    keep = max(keep_last_n, 1)
    ordered = sorted(set(committed))
    if len(ordered) <= keep:
        return []
    guard = set(protected)
    return [s for s in ordered[:-keep] if s not in guard]


def resolve_mode(mode: str, *, supports_async: bool, field: str = "mode") -> str:
    """"auto" means async where the backend supports it; asking for async where it does not
    is an error rather than a silent downgrade."""
    if mode == "auto":
        return "async" if supports_async else "sync"
    if mode == "async" and not supports_async:
        raise ConfigError(
            f"{field}='async' but this backend cannot save asynchronously. Use 'auto' (async "
            f"where supported) or 'sync'.")
    if mode not in ("sync", "async"):
        raise ConfigError(f"{field} must be one of ('sync', 'async', 'auto'), got {mode!r}.")
    return mode

