"""Save reports and restore results: what the manager hands back to the training loop.

Owns: :class:`SaveReport` (what one save cost, completed by the background thread),
:class:`Recovered` (what ``recover``/``restore`` return), the ``CheckpointWriteError`` a failed
save turns into (``write_error``), and the few package-internal helpers that move a report
through its life (``mark_done``, ``deliver``, ``delivered``), so that no other module touches a
report's private fields.

Must not import: jax, orbax, torch, or any other part of the manager.

Concurrency contract: a report's fields are written by the one thread that runs its save (the
manager's background thread in async mode) before its completion event is set; other threads
read them after ``wait()`` or in the ``on_report`` callback. ``deliver`` is called from the
training thread only.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from jaxckpt.config import StepInfo
from jaxckpt.errors import CheckpointWriteError

__all__ = ["SaveReport", "Recovered", "write_error", "mark_done", "deliver", "delivered"]


class SaveReport:
    """What one save cost. Returned at once; the background part fills in the rest.

    ``blocking_s`` (time the training loop lost, the ``time/saving`` metric) is known when the
    report is returned; ``total_s``, ``bytes`` and ``bandwidth_gbps`` once ``done()`` (call
    ``wait()`` to block until then). Sizes come from the commit manifest, i.e. what the
    writer wrote, computed off the training thread.

    Concurrency contract: fields are written by the manager's background thread before the
    completion event is set; read them after ``wait()`` or in the ``on_report`` callback.
    """

    __slots__ = ("kind", "step", "path", "mode", "reason", "tier", "blocking_s", "total_s",
                 "bytes", "error", "_done", "_delivered")

    def __init__(self, *, kind: str, step: int, path: str, mode: str, reason: str,
                 tier: str = "durable"):
        self.kind = kind  #: "recover" or "export"
        #: where a recovery checkpoint went: "durable" (the root) or "local" (LocalTier)
        self.tier = tier
        self.step = step  #: global step saved
        self.path = path  #: directory of the checkpoint or export
        self.mode = mode  #: "sync" or "async"
        self.reason = reason  #: which trigger fired: steps, epochs, seconds, forced, preempted
        self.blocking_s: float = 0.0
        self.total_s: float | None = None
        self.bytes: int | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._delivered = False  # the error was raised to the user once already

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveReport:
        """Block until the save committed (or failed: then raise ``CheckpointWriteError``)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} to {self.path} still running after "
                               f"{timeout} s")
        if self.error is not None:
            raise deliver(self)
        return self

    @property
    def bandwidth_gbps(self) -> float | None:
        """Bytes written per second of total save time, in GB/s."""
        if self.bytes is None or not self.total_s:
            return None
        return self.bytes / self.total_s / 1e9

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """Numbers ready for a metrics logger, e.g. ``{"time/saving": 0.02, ...}``."""
        out = {f"{prefix}time/saving": self.blocking_s}
        if self.total_s is not None:
            out[f"{prefix}time/save_total"] = self.total_s
        if self.bytes is not None:
            out[f"{prefix}save/bytes"] = float(self.bytes)
        if self.bandwidth_gbps is not None:
            out[f"{prefix}save/gbps"] = self.bandwidth_gbps
        return out

    def __repr__(self) -> str:
        state = "failed" if self.error else ("done" if self.done() else "in flight")
        return (f"SaveReport({self.kind} step={self.step} {self.tier} {self.mode} {state} "
                f"blocking_s={self.blocking_s:.4f} total_s={self.total_s} bytes={self.bytes} "
                f"path={self.path!r})")


def write_error(report: SaveReport, cause: BaseException) -> CheckpointWriteError:
    err = CheckpointWriteError(
        f"{report.kind} save of step {report.step} to {report.path} failed: "
        f"{type(cause).__name__}: {cause}. Earlier checkpoints are intact; this one was not "
        f"committed and will never be restored.")
    err.__cause__ = cause
    return err


def mark_done(report: SaveReport) -> None:
    """The save finished (its fields are final): wake ``wait()`` and set ``done()``."""
    report._done.set()


def delivered(report: SaveReport) -> bool:
    """Whether the report's error was raised to the user already."""
    return report._delivered


def deliver(report: SaveReport) -> CheckpointWriteError:
    """The error to raise for a failed report, remembering that it was raised (a failure
    reaches the user once, from ``wait()`` or from the next manager call)."""
    report._delivered = True
    assert report.error is not None
    return write_error(report, report.error)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Recovered:
    """The result of ``recover``/``restore``."""

    state: Any
    """The restored state, with the structure, dtypes and placement of ``like``."""
    step_info: StepInfo
    """The step that was saved; resume training at ``step_info.next()``."""
    path: str
    """The checkpoint directory restored from."""
    metrics: dict[str, Any]
    """The metrics passed to the save that wrote this checkpoint."""
    skipped: tuple[str, ...] = ()
    """Newer checkpoints that were not usable, each with the reason."""
    items: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Restored auxiliary items (those asked for with ``items=``), by name."""
    item_versions: dict[str, int] = dataclasses.field(default_factory=dict)
    """The version of every item the checkpoint refers to."""
    saved_process_count: int = 1
    """How many processes wrote the checkpoint (compare with yours to detect a world-size
    change, e.g. to re-deal the rest of an epoch's samples)."""
    tier: str = "durable"
    """Where it was restored from: "durable" (the root) or "local" (``LocalTier``)."""
