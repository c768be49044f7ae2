"""CheckpointManager: the policy, the store and the driver state tied to one array backend.

Owns: deciding when recovery checkpoints and exports are due (and sharing that decision
across processes), the save pipeline (snapshot driver state, stage arrays, write and commit
in the background, apply retention), restore/recover, save reports and the surfacing of
background failures.

The save pipeline of one recovery checkpoint at step S, directory D = recover/step_S:

1. training thread: wait for the previous save (only one is ever in flight), snapshot the
   driver state to JSON bytes, let the backend stage the arrays (``backend.write`` returns
   once the caller may touch its arrays again). This is ``report.blocking_s``.
2. background thread (or inline in sync mode): write the driver JSON, wait for the backend's
   write, then in multi-process runs every process drops ``done.p{i}`` and the primary waits
   for all of them; the primary checksums and fsyncs every file, writes ``COMMITTED``
   atomically, then deletes checkpoints that retention no longer keeps.

Concurrency contract: a manager is used from one training thread. It owns one background
thread, which runs commits, exports and deletions strictly in order. A failure there is
recorded on its report and raised (as ``CheckpointWriteError`` chained to the cause, naming
the step and path) by the next manager call, or only warned when
``on_write_error="warn"``. Across jobs: one job per root (an exclusive lock); across
processes of one job: the primary decides and commits, every process writes its share.

Must not import: jax, orbax, torch. The Orbax backend is imported lazily when no backend is
given.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from . import driver as drv
from .backend import Backend
from .config import (
    Every,
    ExportConfig,
    RecoverConfig,
    StepInfo,
    Versioned,
    check_item_cadences,
    check_item_name,
    item_version,
)
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointRootError,
    CheckpointWarning,
    CheckpointWriteError,
    ConfigError,
)
from .policy import SaveTrigger, resolve_mode, steps_to_delete, writes_periodic
from .layout import COMMIT_MARKER, DRIVER_FILE, STATE_DIR, export_dirname
from .manifest import DEFER_CHECKSUMS_OVER
from .read_claims import ReadClaims
from .roots import check_root
from .storage import RootLock, atomic_write
from .store import CheckpointStore, Entry

__all__ = ["CheckpointManager", "SaveReport", "Recovered"]

log = logging.getLogger("jaxckpt")

_POLL_S = 0.01


class SaveReport:
    """What one save cost. Returned at once; the background part fills in the rest.

    ``blocking_s`` (time the training loop lost, the ``time/saving`` metric) is known when the
    report is returned; ``total_s``, ``bytes`` and ``bandwidth_gbps`` once ``done()`` (call
    ``wait()`` to block until then). Sizes come from the commit manifest, i.e. what the
    writer wrote, computed off the training thread.

    Concurrency contract: fields are written by the manager's background thread before the
    completion event is set; read them after ``wait()`` or in the ``on_report`` callback.
    """

    __slots__ = ("kind", "step", "path", "mode", "reason", "blocking_s", "total_s", "bytes",
                 "error", "_done", "_delivered")

    def __init__(self, *, kind: str, step: int, path: str, mode: str, reason: str):
        self.kind = kind  #: "recover" or "export"
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
            self._delivered = True
            raise _write_error(self, self.error)
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
        return (f"SaveReport({self.kind} step={self.step} {self.mode} {state} "
                f"blocking_s={self.blocking_s:.4f} total_s={self.total_s} bytes={self.bytes} "
                f"path={self.path!r})")


def _write_error(report: SaveReport, cause: BaseException) -> CheckpointWriteError:
    err = CheckpointWriteError(
        f"{report.kind} save of step {report.step} to {report.path} failed: "
        f"{type(cause).__name__}: {cause}. Earlier checkpoints are intact; this one was not "
        f"committed and will never be restored.")
    err.__cause__ = cause
    return err


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


@dataclasses.dataclass(frozen=True, slots=True)
class _Verification:
    """How one restore checks the checkpoints it considers."""

    checksums: bool
    """Checksums as well as sizes (``RecoverConfig.verify == "checksums"``)."""
    defer_over: int | None
    """Bulk files larger than this are checksummed while the backend reads them, not before
    (``CheckpointStore.verify(defer_over=...)``); None: every checksum up front."""
    deferred_items: frozenset[str]
    """Items whose bulk checksums are deferred as well: those being restored."""


class _DeferredChecksumsFailed(Exception):
    """Internal: the checksums checked alongside a read failed (every process raises it,
    the primary with the problems it found). Never leaves the manager."""

    def __init__(self, path: str, own: list[str], items: list[str]):
        super().__init__(path)
        self.path = path
        self.own = own
        self.items = items

    @property
    def problems(self) -> tuple[str, ...]:
        return (*self.own, *self.items)

    def corrupt_error(self) -> CheckpointCorruptError:
        """What ``restore(step=...)`` raises, worded as when the checksums fail up front."""
        if self.own:
            return CheckpointCorruptError(
                f"checkpoint {self.path} failed verification: " + "; ".join(self.problems)
                + ". Restore another step (step=None picks the latest valid one).")
        if self.items:
            return CheckpointCorruptError(
                f"checkpoint {self.path} refers to unusable items: " + "; ".join(self.items)
                + ". Restore another step.")
        return CheckpointCorruptError(
            f"checkpoint {self.path} failed verification on the primary process (its error "
            f"names the damaged files). Restore another step (step=None picks the latest "
            f"valid one).")


class CheckpointManager:
    """Recovery checkpoints and exports for one training run under ``root``.

    ``backend`` defaults to the Orbax backend (JAX/Flax pytrees). ``on_report`` is called with
    every finished :class:`SaveReport` (from the background thread in async mode).
    ``on_write_error``: "raise" makes a failed save raise at the next call; "warn" turns it
    into a ``CheckpointWarning`` so training continues (earlier checkpoints stay valid).
    ``preemption_signals``: signals that request a checkpoint at the next step boundary
    (``maybe_save`` saves with reason "preempted" and ``preempted`` becomes True, so the loop
    can exit cleanly). Handlers are installed only from the main thread and the previous ones
    are put back by ``close``. Pass ``()`` to leave signals alone.
    ``items``: auxiliary items that change on their own cadence (e.g. a GRPO reference policy
    updated every K steps), ``{name: Every(steps=K)}``. Pass the item's tree in ``items=`` of
    ``maybe_save``/``save``: its version is derived from the step and it is written only the
    first time a checkpoint needs that version (``jaxckpt.Versioned(version, tree)`` gives the
    version explicitly instead). Every checkpoint restores the version current when it was taken.
    """

    def __init__(self, root: str | os.PathLike[str], *, recover: RecoverConfig | None = None,
                 export: ExportConfig | None = None, mode: str = "auto",
                 backend: Backend | None = None,
                 on_report: Callable[[SaveReport], Any] | None = None,
                 on_write_error: Literal["raise", "warn"] = "raise",
                 commit_timeout_s: float = 1800.0,
                 preemption_signals: Sequence[int] = (signal.SIGTERM,),
                 items: Mapping[str, Every] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not isinstance(root, (str, os.PathLike)):
            raise ConfigError(f"root must be a path (str or os.PathLike), got {root!r}.")
        recover = RecoverConfig() if recover is None else recover
        if not isinstance(recover, RecoverConfig):
            raise ConfigError(f"recover must be a jaxckpt.RecoverConfig, got {type(recover).__name__}.")
        if export is not None and not isinstance(export, ExportConfig):
            raise ConfigError(f"export must be a jaxckpt.ExportConfig or None, got "
                              f"{type(export).__name__}.")
        if on_write_error not in ("raise", "warn"):
            raise ConfigError(f"on_write_error must be 'raise' or 'warn', got {on_write_error!r}.")
        if on_report is not None and not callable(on_report):
            raise ConfigError(f"on_report must be callable(report) or None, got {on_report!r}.")
        if (isinstance(commit_timeout_s, bool) or not isinstance(commit_timeout_s, (int, float))
                or not commit_timeout_s > 0):
            raise ConfigError(f"commit_timeout_s must be a positive number of seconds, got "
                              f"{commit_timeout_s!r}.")
        signals = _check_signals(preemption_signals)
        if backend is not None and not all(
                hasattr(backend, a) for a in ("process_index", "process_count", "supports_async",
                                              "name", "barrier")):
            raise ConfigError(
                f"backend must be a jaxckpt.backend.Backend object, got {backend!r}. Leave "
                f"backend=None for Orbax (JAX) or pass an instance such as "
                f"jaxckpt.orbax_backend.OrbaxBackend(); for PyTorch use "
                f"torch_bridge.DcpCheckpointManager.")
        check_item_cadences(items or {}, recover)
        # Before anything is created or written (no backend, no lock, no recover/): a root
        # holding another tool's files is refused whole, never written beside.
        check_root(os.fspath(root))
        self.recover_config = recover
        self.export_config = export
        self._export_record = _export_record(export)
        self._item_cadences: dict[str, Every] = dict(items or {})
        self._owns_backend = backend is None
        self._backend = backend if backend is not None else _default_backend()
        self._mode = resolve_mode(mode, supports_async=self._backend.supports_async)
        self._export_mode = None if export is None else resolve_mode(
            export.mode, supports_async=True, field="ExportConfig.mode")
        self._on_report = on_report
        self._on_write_error = on_write_error
        self._commit_timeout_s = commit_timeout_s
        self._store = CheckpointStore(root)
        self._index = self._backend.process_index
        self._count = self._backend.process_count
        self._primary = self._index == 0
        self._lock: RootLock | None = None
        if self._primary:
            self._prepare_root()
        try:
            self._backend.barrier("jaxckpt.init", 120.0)
        except BaseException:
            self._release_lock()
            raise
        # Versions already on disk (committed) per item: never written twice.
        self._written_items: dict[str, set[int]] = {
            name: set(self._store.item_versions(name)) for name in self._store.item_names()}
        self._recover_trigger = SaveTrigger(recover.every, clock=clock)
        self._export_trigger = SaveTrigger(export.every, clock=clock) if export else None
        self._clock = clock
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="jaxckpt-commit")
        self._pending: list[concurrent.futures.Future[None]] = []
        self._unraised: list[SaveReport] = []
        self._last: dict[str, SaveReport] = {}
        self._default_stateful: Mapping[str, Any] | None = None
        self._reading: set[int] = set()
        self._state_lock = threading.Lock()
        self._closed = False
        self._restored_step: int | None = None
        # The last step the loop reported as completed (maybe_save) or resumed from (recover):
        # what save() records when given no step, and what it checks a given step against.
        self._last_completed: StepInfo | None = None
        self._preempt_signal: int | None = None
        self._preempted = False
        self._scope_checked = False  # see _warn_left_out
        self._previous_handlers: dict[int, Any] = {}
        self._install_signal_handlers(signals)

    # --- public API -----------------------------------------------------------------------
    @property
    def root(self) -> str:
        return self._store.root

    @property
    def store(self) -> CheckpointStore:
        return self._store

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def preempted(self) -> bool:
        """True once a preemption signal was turned into a checkpoint: stop the loop, then
        ``close()`` (which waits for that checkpoint to commit)."""
        return self._preempted

    def request_preemption_save(self, signum: int = 0) -> None:
        """Ask for a checkpoint at the next ``maybe_save``, as a preemption signal would (for
        schedulers that announce preemption some other way, e.g. a metadata endpoint)."""
        if self._preempt_signal is None:
            self._preempt_signal = signum

    def committed_steps(self) -> list[int]:
        """Steps of committed recovery checkpoints, oldest first."""
        return self._store.committed_steps()

    def recover(self, like: Any, *, stateful: Mapping[str, Any] | None = None,
                items: Mapping[str, Any] | None = None) -> Recovered | None:
        """Resume from the latest valid recovery checkpoint, or return None when there is
        none (or recovery is off). ``stateful`` objects are restored in place and remembered
        as the default for later saves. ``items`` maps item names to ``like`` trees: each is
        restored at the version the checkpoint refers to."""
        self._check_usable()
        if stateful is not None:
            drv.capture_stateful(stateful)  # validate early: a bad object fails now, not at the first save
            self._default_stateful = stateful
        if not self.recover_config.enabled:
            return None
        return self._restore(like, stateful=stateful, step=None, required=False, items=items)

    def restore(self, like: Any, *, step: int | None = None,
                stateful: Mapping[str, Any] | None = None,
                items: Mapping[str, Any] | None = None) -> Recovered:
        """Restore a recovery checkpoint (``step=None``: the latest valid one), whatever the
        recover mode. Raises ``CheckpointNotFoundError`` when there is none."""
        self._check_usable()
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ConfigError(f"restore(step=...) takes a global step (an int >= 0) or None for "
                              f"the latest valid checkpoint, got {step!r}.")
        result = self._restore(like, stateful=stateful, step=step, required=True, items=items)
        assert result is not None
        return result

    def maybe_save(self, step_info: StepInfo, state: Any, *,
                   stateful: Mapping[str, Any] | None = None,
                   metrics: Mapping[str, Any] | None = None,
                   epoch_end: bool | None = None,
                   items: Mapping[str, Any] | None = None) -> list[SaveReport]:
        """Save a recovery checkpoint and/or an export if one is due after ``step_info``.

        ``state`` is the array state, or a function of no arguments that returns it
        (e.g. ``lambda: nnx.state((model, optimizer))``): called only when something is
        due, so the steps between saves do not pay for building the state tree (~0.4 ms a
        step for the demo's MLP and Adam, 1% of its step). ``epoch_end`` defaults to what
        ``step_info`` says (last step of its epoch, when ``steps_per_epoch`` is known).
        ``items``: auxiliary items (see the class docstring), only touched when a recovery
        checkpoint is due. Returns the reports of the saves started (often [])."""
        self._check_usable()
        _check_step_info(step_info)
        self._last_completed = step_info
        if epoch_end is None:
            epoch_end = step_info.is_epoch_end
        recover_reason = None
        if self.recover_config.enabled and writes_periodic(self.recover_config.keep_last_n):
            recover_reason = self._recover_trigger.due(step_info, epoch_end=epoch_end)
        export_reason = None
        if self._export_trigger is not None and writes_periodic(self.export_config.keep_last_n):
            export_reason = self._export_trigger.due(step_info, epoch_end=epoch_end)
        preempt = self._preempt_signal is not None and not self._preempted
        recover_reason, export_reason, preempt = self._agree(recover_reason, export_reason, preempt)
        if preempt:
            self._preempted = True
            if self.recover_config.enabled:
                recover_reason = "preempted"
            else:
                warnings.warn("preemption requested but recovery is off: no checkpoint written.",
                              CheckpointWarning, stacklevel=2)
        reports = []
        if recover_reason or export_reason:
            state = _resolve_state(state)
        if recover_reason and not self._scope_checked:
            self._warn_left_out(state, items, sys._getframe(1))
        if recover_reason:
            reports.append(self._save_recover(step_info, state, stateful, metrics, recover_reason,
                                              items=items, epoch_end=epoch_end))
        if export_reason:
            reports.append(self._save_export(step_info, state, export_reason))
        return reports

    def save(self, step_info: StepInfo | None = None, state: Any = None, *,
             stateful: Mapping[str, Any] | None = None,
             metrics: Mapping[str, Any] | None = None,
             mode: str | None = None,
             items: Mapping[str, Any] | None = None,
             epoch_end: bool | None = None) -> SaveReport:
        """A forced recovery checkpoint (e.g. at the end of training), whatever the triggers
        and the recover mode. ``mode`` overrides the manager's save mode for this call (the
        final save of a run is usually ``mode="sync"``). Saving a step this manager already
        saved returns that save's report instead of writing it twice. ``state`` may be a
        function of no arguments that returns it, as in ``maybe_save``.

        ``step_info`` is the step that just completed, as everywhere in jaxckpt; None means
        the last completed step this manager was told about (the last ``maybe_save`` step,
        or the step ``recover`` resumed from), which is what a final save after the loop
        wants: ``mgr.save(state=..., mode="sync")``. A step one past that (the usual slip
        after ``step = step.next()`` ends the loop) is refused: it would record a step that
        never ran, and a resumed job would skip one."""
        self._check_usable()
        step_info = self._completed_step(step_info)
        if state is None:
            raise ConfigError("save() needs the state to write: mgr.save(step_info, state) or "
                              "mgr.save(state=...) for the last completed step.")
        override = None if mode is None else resolve_mode(
            mode, supports_async=self._backend.supports_async, field="save(mode=...)")
        if epoch_end is None:
            epoch_end = step_info.is_epoch_end
        if not self._scope_checked:
            state = _resolve_state(state)
            self._warn_left_out(state, items, sys._getframe(1))
        return self._save_recover(step_info, state, stateful, metrics, "forced", override,
                                  items=items, epoch_end=epoch_end)

    def _completed_step(self, step_info: StepInfo | None) -> StepInfo:
        """The step a forced save records: ``step_info``, checked against the last step
        the loop reported, or that last step when None."""
        last = self._last_completed
        if step_info is None:
            if last is None:
                raise ConfigError(
                    "save() without step_info records the last completed step, but this "
                    "manager has not seen one yet (no maybe_save or recover call). Pass the "
                    "StepInfo of the step that just completed: mgr.save(step_info, state).")
            return last
        _check_step_info(step_info)
        if last is not None and step_info.global_step == last.global_step + 1:
            raise ConfigError(
                f"save(step_info) got global_step={step_info.global_step}, one past the last "
                f"completed step this manager saw (global_step={last.global_step}, from "
                f"maybe_save or recover). A StepInfo names the step that just completed, so "
                f"this would record a step that never ran and a resumed job would skip it. "
                f"After a loop that ends with `step = step.next()`, call "
                f"mgr.save(state=...) (no step: the last completed one) or pass the previous "
                f"StepInfo.")
        return step_info

    def export(self, step_info: StepInfo, state: Any) -> SaveReport:
        """A forced export (needs ``export=ExportConfig(...)``)."""
        self._check_usable()
        _check_step_info(step_info)
        if self.export_config is None:
            raise ConfigError("export() needs CheckpointManager(export=ExportConfig(exporter=...)).")
        return self._save_export(step_info, state, "forced")

    def wait(self) -> None:
        """Block until every save started so far committed; raise the first failure."""
        self._drain()
        self._raise_unraised()

    def close(self) -> None:
        """Finish in-flight saves, stop the background thread, release the root."""
        if self._closed:
            return
        try:
            self._drain()
        finally:
            self._closed = True
            self._restore_signal_handlers()
            self._worker.shutdown(wait=True)
            closer = getattr(self._backend, "close", None)
            if self._owns_backend and callable(closer):
                closer()
            self._release_lock()
        self._raise_unraised()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # Do not mask the error that is propagating; still finish what can be finished.
        try:
            self.close()
        except Exception as close_exc:  # noqa: BLE001 - reported, original error wins
            log.error("jaxckpt: error while closing after %s: %s", exc_type.__name__, close_exc)

    # --- saving ---------------------------------------------------------------------------
    def _warn_left_out(self, state: Any, items: Mapping[str, Any] | None, caller: Any) -> None:
        """Once per manager, at its first recovery save: warn when the calling code's local
        variables hold framework objects whose state this save leaves out (e.g. an
        ``nnx.Rngs`` or metrics beside a saved model). The backend judges (optional
        ``left_out(saved, scope)``); a diagnostic never fails a save."""
        self._scope_checked = True
        judge = getattr(self._backend, "left_out", None)
        if judge is None:
            return
        try:
            trees = [v.tree if isinstance(v, Versioned) else v for v in (items or {}).values()]
            message = judge([state, *trees] if trees else state, dict(caller.f_locals))
        except Exception:  # noqa: BLE001 - only a hint; the save goes on regardless
            log.debug("jaxckpt: left-out check failed", exc_info=True)
            return
        finally:
            del caller
        if message:
            warnings.warn(message, CheckpointWarning, stacklevel=3)

    def _save_recover(self, step: StepInfo, state: Any, stateful: Mapping[str, Any] | None,
                      metrics: Mapping[str, Any] | None, reason: str,
                      mode: str | None = None, *, items: Mapping[str, Any] | None = None,
                      epoch_end: bool = False) -> SaveReport:
        start = time.perf_counter()
        mode = mode or self._mode
        last = self._last.get("recover")
        if last is not None and last.step == step.global_step and last.error is None:
            return last
        if self._restored_step == step.global_step:
            existing = self._already_committed(step.global_step, mode, reason)
            if existing is not None:
                return existing
        state = _resolve_state(state)  # a function: only now that this save happens
        self._drain()
        self._raise_unraised()
        path = self._store.step_path(step.global_step)
        item_versions = self._item_versions(items, step, epoch_end)
        stateful = self._default_stateful if stateful is None else stateful
        # Snapshot everything mutable now, on the training thread: the loop moves on at once.
        local = drv.build_local(
            process_index=self._index,
            stateful_state=drv.capture_stateful(stateful),
            rng=drv.capture_global_rng() if self.recover_config.restore_global_rng else None,
            backend_rng=self._backend.rng_state())
        saved_at = time.time()
        if self._primary:
            body = drv.build_driver(
                kind="recover", reason=reason, step=step, backend_name=self._backend.name,
                backend_versions=self._backend.versions(), process_count=self._count,
                metrics=metrics, local=local, saved_at=saved_at)
            body["items"] = {name: {"version": v} for name, (v, _) in item_versions.items()}
            if self._export_record is not None:
                body["export"] = self._export_record
            # Compact separators keep json on its C encoder (indent= switches to the Python
            # one: ~1.4 ms of a ~4 ms blocking time with RNG states inside).
            driver_file, driver_bytes = DRIVER_FILE, json.dumps(body, separators=(",", ":")).encode()
            self._make_room(path)
        else:
            driver_file = drv.local_filename(self._index)
            driver_bytes = json.dumps(local).encode()
        if self._count > 1:
            self._backend.barrier(f"jaxckpt.save.{step.global_step}", 600.0)
        report = SaveReport(kind="recover", step=step.global_step, path=path, mode=mode,
                            reason=reason)
        self._recover_trigger.mark_saved()
        try:
            handle, item_writes = self._start_writes(path, state, item_versions, mode)
        except (CheckpointError, TypeError):
            raise  # bad input (a tree the backend refuses): the caller's to fix, not a write failure
        except Exception as exc:  # the filesystem failed under the training thread
            return self._failed_to_start(report, exc, start, path)
        report.blocking_s = time.perf_counter() - start
        self._last["recover"] = report

        def finish() -> None:
            with open(os.path.join(path, driver_file), "wb") as handle_file:
                handle_file.write(driver_bytes)
            item_bytes = 0
            for name, version, item_dir, item_handle in item_writes:
                item_handle.wait()
                item_bytes += self._commit_dir(item_dir, version, _known_checksums(item_handle))
                with self._state_lock:
                    self._written_items.setdefault(name, set()).add(version)
            handle.wait()
            self._commit(path, step.global_step, report, _known_checksums(handle))
            if report.bytes is not None:
                report.bytes += item_bytes

        self._run(report, finish, start, after=self._apply_retention if self._primary else None,
                  on_failure=lambda: self._discard_partial(path))
        return report

    def _start_writes(self, path: str, state: Any, item_versions: dict[str, tuple[int, Any]],
                      mode: str) -> tuple[Any, list[tuple[str, int, str, Any]]]:
        """Training thread: create the directories and stage every write of one save."""
        os.makedirs(path, exist_ok=True)
        # Item versions no checkpoint has written yet go first; the backend serialises writes,
        # so this costs time only on saves where an item changed.
        item_writes: list[tuple[str, int, str, Any]] = []
        with self._state_lock:
            written = {name: set(v) for name, v in self._written_items.items()}
        for name, (version, tree) in item_versions.items():
            if version in written.get(name, set()):
                continue
            item_dir = self._store.item_path(name, version)
            if self._primary and os.path.lexists(item_dir):
                self._store.delete(item_dir)  # an uncommitted attempt at this version
            if self._count > 1:
                self._backend.barrier(f"jaxckpt.item.{name}.{version}", 600.0)
            os.makedirs(item_dir, exist_ok=True)
            item_writes.append((name, version, item_dir, self._backend.write(
                os.path.join(item_dir, STATE_DIR), tree, asynchronous=mode == "async")))
        handle = self._backend.write(os.path.join(path, STATE_DIR), state,
                                     asynchronous=mode == "async")
        return handle, item_writes

    def _failed_to_start(self, report: SaveReport, exc: BaseException, start: float,
                         path: str) -> SaveReport:
        """A save that failed on the training thread is reported like a background failure:
        CheckpointWriteError now (or a warning), and its partial directory removed."""
        report.error = exc
        report.total_s = report.blocking_s = time.perf_counter() - start
        report._done.set()
        with self._state_lock:
            self._unraised.append(report)
        self._pending.append(self._worker.submit(self._discard_partial, path))
        self._raise_unraised()
        return report

    def _discard_partial(self, path: str) -> None:
        """Primary, background: remove what a failed save left (frees a full disk)."""
        if not self._primary or os.path.exists(os.path.join(path, COMMIT_MARKER)):
            return
        with contextlib.suppress(OSError):
            self._store.delete(path)

    def _item_versions(self, items: Mapping[str, Any] | None, step: StepInfo,
                       epoch_end: bool) -> dict[str, tuple[int, Any]]:
        """name -> (version, tree) for the items of one save, validated."""
        out: dict[str, tuple[int, Any]] = {}
        if items is None:
            return out
        if not isinstance(items, Mapping):
            raise ConfigError(f"items must be a dict of name -> tree, got {type(items).__name__}.")
        for name, value in items.items():
            if isinstance(value, Versioned):
                check_item_name(name)
                out[name] = (value.version, value.tree)
            elif name in self._item_cadences:
                out[name] = (item_version(self._item_cadences[name], step, epoch_end=epoch_end), value)
            else:
                raise ConfigError(
                    f"items[{name!r}] has no version: declare its cadence with "
                    f"CheckpointManager(items={{{name!r}: Every(steps=K)}}) or pass "
                    f"jaxckpt.Versioned(version, tree).")
        return out

    def _already_committed(self, step: int, mode: str, reason: str) -> SaveReport | None:
        """A done report for the checkpoint just restored, which a save of the same step
        (e.g. the final save of a run that resumed with nothing left to do) must not redo."""
        path = self._store.step_path(step)
        try:
            manifest = self._store.read_manifest(path)
        except CheckpointCorruptError:
            return None
        if manifest is None:
            return None
        report = SaveReport(kind="recover", step=step, path=path, mode=mode, reason=reason)
        report.total_s, report.bytes = 0.0, manifest.total_bytes
        report._done.set()
        self._last["recover"] = report
        return report

    def _make_room(self, path: str) -> None:
        """Primary: a directory already at this step's name is moved aside (committed: it
        belongs to a discarded future, e.g. after restoring an older step) or removed."""
        if not os.path.lexists(path):
            return
        if os.path.exists(os.path.join(path, COMMIT_MARKER)):
            moved = self._store.quarantine(path, "superseded")
            warnings.warn(f"{path} already held a committed checkpoint from an earlier attempt "
                          f"at this step; it was moved to {moved} and is being replaced.",
                          CheckpointWarning, stacklevel=4)
        else:
            self._store.delete(path)

    def _commit(self, path: str, step: int, report: SaveReport,
                known: dict[str, dict[str, Any]] | None = None) -> None:
        """Background: every process's writes are done -> marker (sizes on the report)."""
        written = self._commit_dir(path, step, known)
        report.bytes = written if self._primary else None

    def _commit_dir(self, path: str, step: int,
                    known: dict[str, dict[str, Any]] | None = None) -> int:
        """Once every process finished writing ``path``, the primary commits it. Returns the
        bytes committed (0 on other processes, which wait until the marker exists).
        ``known``: checksums the backend computed while writing (``_known_checksums``)."""
        if self._count > 1:
            atomic_write(os.path.join(path, f"done.p{self._index:05d}"), b"")
        if not self._primary:
            self._wait_for(lambda: os.path.exists(os.path.join(path, COMMIT_MARKER)),
                           f"the primary process to commit {path}")
            return 0
        if self._count > 1:
            names = [f"done.p{i:05d}" for i in range(1, self._count)]
            self._wait_for(lambda: all(os.path.exists(os.path.join(path, n)) for n in names),
                           f"all {self._count} processes to finish writing {path}")
        return self._store.commit(path, step, known=known).total_bytes

    def _apply_retention(self) -> None:
        keep = self.recover_config.keep_last_n
        with self._state_lock:
            protected = set(self._reading)
        victims = steps_to_delete(self._store.committed_steps(), keep, protected=protected)
        for victim in victims:
            self._delete_quietly(self._store.step_path(victim))
        self._prune_items()

    def _prune_items(self) -> None:
        """Delete item versions that no committed checkpoint refers to any more (the newest
        version of each item is always kept: the next checkpoint may refer to it)."""
        names = self._store.item_names()
        if not names:
            return
        referenced: dict[str, set[int]] = {name: set() for name in names}
        for step in self._store.committed_steps():
            try:
                with open(os.path.join(self._store.step_path(step), DRIVER_FILE), "rb") as handle:
                    refs = json.loads(handle.read()).get("items") or {}
            except (OSError, ValueError):
                return  # cannot tell what is referenced: keep everything this time
            for name, ref in refs.items():
                referenced.setdefault(name, set()).add(int(ref.get("version", -1)))
        for name in names:
            versions = self._store.item_versions(name)
            for version in versions[:-1]:
                if version not in referenced.get(name, set()):
                    if self._delete_quietly(self._store.item_path(name, version)):
                        with self._state_lock:
                            self._written_items.get(name, set()).discard(version)

    def _delete_quietly(self, path: str) -> bool:
        try:
            if self._store.delete(path):
                return True
            log.info("jaxckpt: %s is being read; deleting it later", path)
        except OSError as exc:  # never let housekeeping stop training
            warnings.warn(f"retention could not delete {path}: {exc}; it will be retried "
                          f"after the next save.", CheckpointWarning, stacklevel=3)
        return False

    def _save_export(self, step: StepInfo, state: Any, reason: str) -> SaveReport:
        start = time.perf_counter()
        last = self._last.get("export")
        if last is not None and last.step == step.global_step and last.error is None:
            return last
        self._drain()
        self._raise_unraised()
        config = self.export_config
        assert config is not None and self._export_trigger is not None
        name = export_dirname(step.epoch, step.epoch_step, step.global_step)
        final = os.path.join(self._store.export_dir, name)
        report = SaveReport(kind="export", step=step.global_step, path=final,
                            mode=self._export_mode or "sync", reason=reason)
        self._export_trigger.mark_saved()
        # Async exports run from a host copy so training may update the arrays meanwhile; in
        # multi-process runs the copy also gathers the shards (a collective every process
        # joins), since only the primary writes the export.
        needs_copy = (report.mode == "async" or self._count > 1
                      or getattr(self._backend, "export_needs_copy", False))
        source = self._backend.host_copy(state) if needs_copy else state
        report.blocking_s = time.perf_counter() - start
        self._last["export"] = report

        def finish() -> None:
            if not self._primary:
                return
            tmp = self._store.export_tmp_path(name)
            os.makedirs(tmp)
            written = config.exporter(source, tmp)
            if os.path.lexists(final):  # an export of this step from a discarded attempt
                self._store.delete_export(final)
            os.rename(tmp, final)
            report.bytes = written if isinstance(written, int) else _tree_bytes(final)

        self._run(report, finish, start,
                  after=self._apply_export_retention if self._primary else None)
        return report

    def _apply_export_retention(self) -> None:
        assert self.export_config is not None
        entries = self._store.export_entries()
        victims = set(steps_to_delete([s for s, _ in entries], self.export_config.keep_last_n))
        for step, path in entries:
            if step in victims:
                try:
                    self._store.delete_export(path)
                except OSError as exc:
                    warnings.warn(f"retention could not delete export {path}: {exc}",
                                  CheckpointWarning, stacklevel=2)

    def _run(self, report: SaveReport, finish: Callable[[], None], start: float, *,
             after: Callable[[], None] | None = None,
             on_failure: Callable[[], None] | None = None) -> None:
        """Run the rest of a save inline (sync) or on the background thread (async); then
        ``after`` (retention) on the background thread in both modes, only if the save
        succeeded: housekeeping never runs on, nor blocks, the training thread."""

        def job() -> None:
            try:
                finish()
            except BaseException as exc:  # noqa: BLE001 - recorded, raised on the next call
                report.error = exc
                with self._state_lock:
                    self._unraised.append(report)
            finally:
                report.total_s = time.perf_counter() - start
                if report.mode == "sync":
                    report.blocking_s = report.total_s
                report._done.set()
            if report.error is None and self._on_report is not None:
                try:
                    self._on_report(report)
                except Exception as exc:  # noqa: BLE001 - a logging hook must not kill saves
                    log.warning("jaxckpt: on_report callback raised %r", exc)

        def housekeeping() -> None:
            if report.error is not None:
                if on_failure is not None:
                    with contextlib.suppress(Exception):
                        on_failure()
                return
            if after is None:
                return
            try:
                after()
            except Exception as exc:  # noqa: BLE001 - retention must never stop training
                warnings.warn(f"retention after {report.path} failed: {exc!r}; it is retried "
                              f"after the next save.", CheckpointWarning, stacklevel=2)

        if report.mode == "sync":
            job()
            self._pending.append(self._worker.submit(housekeeping))
            self._raise_unraised()
        else:
            self._pending.append(self._worker.submit(lambda: (job(), housekeeping())))

    # --- restoring ------------------------------------------------------------------------
    def _restore(self, like: Any, *, stateful: Mapping[str, Any] | None, step: int | None,
                 required: bool, items: Mapping[str, Any] | None = None) -> Recovered | None:
        self._drain()
        self._raise_unraised()
        checks = self._verification(items)
        bad: list[Entry] = []
        limit: int | None = None
        while True:
            chosen = self._choose(step, checks, limit, bad)
            skipped = [f"{item.path}: {item.status}: "
                       + ("; ".join(item.problems) or "no commit marker (interrupted save)")
                       for item in bad]
            if chosen == _FAIL_CLOSED:
                raise self._no_valid_checkpoint(skipped)
            if chosen < 0:
                if skipped:
                    warnings.warn("no valid checkpoint to resume from; unusable ones: "
                                  + " | ".join(skipped), CheckpointWarning, stacklevel=3)
                if self._primary and not required:
                    self._set_aside(bad)
                if required:
                    raise CheckpointNotFoundError(
                        f"no valid recovery checkpoint under {self._store.recover_dir}"
                        + (f" (unusable: {' | '.join(skipped)})" if skipped else "")
                        + ". Train from scratch, or point the manager at the root that holds "
                          "the checkpoints.")
                return None
            path = self._store.step_path(chosen)
            try:
                body, state, versions, restored_items = self._read_checkpoint(path, like, items,
                                                                              chosen, checks)
            except _DeferredChecksumsFailed as failed:
                # What was read went with the exception; nothing else was touched yet. The
                # same outcome as when these checksums fail up front: an explicit step is an
                # error, a resume falls back (the primary quarantines this one below).
                if step is not None:
                    raise failed.corrupt_error() from None
                if self._primary:
                    bad.append(Entry(step=chosen, path=path, status="corrupt",
                                     problems=failed.problems))
                limit = chosen - 1
                continue
            except CheckpointFormatError:
                raise  # newer, not damaged: skipping it would silently drop progress
            except CheckpointCorruptError as exc:
                # Verified files can still fail to decode (altered yet consistent metadata):
                # when resuming, fall back like for any other corrupt checkpoint.
                if step is not None or self._count > 1:
                    raise
                bad.append(Entry(step=chosen, path=path, status="corrupt", problems=(str(exc),)))
                limit = chosen - 1
                continue
            break
        if skipped:
            warnings.warn(f"resuming from step {chosen}, skipping newer unusable checkpoints: "
                          + " | ".join(skipped), CheckpointWarning, stacklevel=3)
        # Local state only once the arrays are in: never a half-restored loader or RNG.
        local = body.get("local") if self._primary else self._read_local(path)
        self._restore_local(local, stateful, path)
        self._set_aside(bad)
        step_info = StepInfo.from_json(body["step_info"])
        # Training goes on from the restored step: saves made before it are history, and a
        # later save of an equal step number is new work, not a duplicate.
        self._last.clear()
        self._restored_step = chosen
        self._last_completed = step_info
        self._recover_trigger.mark_saved()
        if self._export_trigger is not None:
            self._export_trigger.mark_saved()
        return Recovered(state=state, step_info=step_info, path=path,
                         metrics=dict(body.get("metrics") or {}), skipped=tuple(skipped),
                         items=restored_items, item_versions=versions,
                         saved_process_count=int(body.get("process_count", 1)))

    def _set_aside(self, bad: Sequence[Entry]) -> None:
        """Unusable checkpoints would collide with the steps about to be (re)done, and
        retention, which counts commit markers, could keep them over new valid ones: move
        them aside (kept for inspection; partial ones are just debris)."""
        for item in bad:
            with contextlib.suppress(OSError):
                if item.status == "partial":
                    self._store.delete(item.path)
                else:
                    self._store.quarantine(item.path, item.status)

    def _no_valid_checkpoint(self, skipped: Sequence[str]) -> CheckpointCorruptError:
        """Fail closed: committed checkpoints exist and none can be restored."""
        where = self._store.recover_dir
        if not self._primary:
            return CheckpointCorruptError(
                f"no checkpoint under {where} verifies (the primary process lists them); "
                f"nothing was restored.")
        listing = "\n".join(f"  - {line}" for line in skipped)
        return CheckpointCorruptError(
            f"the checkpoint root holds checkpoints but none verifies, so there is nothing "
            f"safe to resume from; nothing was restored, moved or deleted:\n{listing}\n"
            f"Starting from scratch here would silently drop that progress. Fix: repair or "
            f"restore the files (e.g. from a backup), point the manager at another root, or "
            f"opt in to starting over with RecoverConfig(on_corrupt=\"start_fresh\") (the "
            f"damaged checkpoints are then moved to {where}/superseded/).")

    def _verification(self, items: Mapping[str, Any] | None) -> _Verification:
        """How this restore checks checkpoints. With checksums on, the checksums of bulk array
        files are checked alongside the read (the read brings the same bytes in from disk,
        so the two share one pass) and the restored values are thrown away if it fails. A
        backend that reads into the caller's live objects (``reads_in_place``, e.g. DCP)
        could not take its values back, so it gets every checksum before the read."""
        checksums = self.recover_config.verify == "checksums"
        overlap = checksums and not getattr(self._backend, "reads_in_place", False)
        return _Verification(checksums=checksums,
                             defer_over=DEFER_CHECKSUMS_OVER if overlap else None,
                             deferred_items=frozenset(items or ()) if overlap else frozenset())

    def _choose(self, step: int | None, checks: _Verification, limit: int | None,
                bad: list[Entry]) -> int:
        """The step to restore (-1: none), decided by the primary and shared. Unusable newer
        checkpoints found on the way are appended to ``bad``. Checksums that
        ``checks.defer_over`` leaves out are checked later, by ``_read_checkpoint``."""
        chosen = -1
        if self._primary:
            if step is None:
                while True:
                    entry, newly_bad = self._store.latest_valid(
                        checksums=checks.checksums, at_or_before=limit,
                        defer_over=checks.defer_over)
                    bad += newly_bad
                    if entry is None:
                        break
                    problems = self._item_problems(entry.path, checks)
                    if not problems:
                        chosen = entry.step
                        break
                    # A checkpoint whose items are gone or damaged cannot be restored whole.
                    bad.append(dataclasses.replace(entry, status="corrupt",
                                                   problems=tuple(problems)))
                    limit = entry.step - 1
                if (chosen < 0 and self.recover_config.on_corrupt == "raise"
                        and any(entry.status != "partial" for entry in bad)):
                    chosen = _FAIL_CLOSED
            else:
                chosen = self._check_requested(step, checks)
                problems = self._item_problems(self._store.step_path(step), checks)
                if problems:
                    raise CheckpointCorruptError(
                        f"checkpoint {self._store.step_path(step)} refers to unusable items: "
                        + "; ".join(problems) + ". Restore another step.")
        return self._backend.broadcast_int(chosen) if self._count > 1 else chosen

    def _read_checkpoint(self, path: str, like: Any, items: Mapping[str, Any] | None,
                         step: int, checks: _Verification,
                         ) -> tuple[dict[str, Any], Any, dict[str, int], dict[str, Any]]:
        """Driver, arrays and requested items of one checkpoint, under a reader lock that
        keeps retention away from it.

        With deferred checksums the primary checks them in a thread while this reads, and
        the read is judged only once they are in: when they fail, what was read is dropped
        and ``_DeferredChecksumsFailed`` raised, on every process (the primary shares its
        verdict), also when the read itself failed (damaged bytes explain that failure)."""
        with self._state_lock:
            self._reading.add(step)
        try:
            with self._store.reading(path):
                claims = (ReadClaims() if checks.defer_over is not None and self._primary
                          and getattr(self._backend, "verifies_reads", False) else None)
                checking = self._start_deferred_checks(path, items, checks, claims)
                result: tuple[dict[str, Any], Any, dict[str, int], dict[str, Any]] | None = None
                error: Exception | None = None
                try:
                    body = self._read_driver(path)
                    if claims is not None:
                        state = self._backend.read(os.path.join(path, STATE_DIR), like,
                                                   claims=claims)
                    else:
                        state = self._backend.read(os.path.join(path, STATE_DIR), like)
                    versions = {name: int(ref["version"])
                                for name, ref in (body.get("items") or {}).items()}
                    result = body, state, versions, self._read_items(items, versions, path)
                except Exception as exc:  # noqa: BLE001 - judged once the checksums are in
                    if checks.defer_over is None:
                        raise
                    error = exc
                finally:
                    if claims is not None:
                        claims.close()
                    own, item_problems = (checking.result() if checking is not None
                                          else ([], []))
                    if claims is not None:
                        own = own + claims.problems(path)
                failed = bool(own or item_problems)
                if checks.defer_over is not None and self._count > 1:
                    # Only the primary checked: its verdict is every process's, so that
                    # all of them fall back (or raise) together.
                    failed = self._backend.broadcast_int(int(failed)) != 0
                if failed:
                    # Let go of every array read (error tracebacks hold some too) before the
                    # next checkpoint is read: two models may not fit in memory.
                    result = error = state = None
                    raise _DeferredChecksumsFailed(path, own, item_problems)
                if error is not None:
                    raise error
                assert result is not None
                return self._finish_read(result)
        finally:
            with self._state_lock:
                self._reading.discard(step)

    def _finish_read(self, result: tuple[dict[str, Any], Any, dict[str, int], dict[str, Any]],
                     ) -> tuple[dict[str, Any], Any, dict[str, int], dict[str, Any]]:
        """A read judged valid: a backend with ``finish_read`` (values for live objects,
        put into them in place only now) gets the state and every item."""
        finish = getattr(self._backend, "finish_read", None)
        if finish is None:
            return result
        body, state, versions, items = result
        return body, finish(state), versions, {name: finish(tree) for name, tree in items.items()}

    def _start_deferred_checks(self, path: str, items: Mapping[str, Any] | None,
                               checks: _Verification, claims: ReadClaims | None = None,
                               ) -> concurrent.futures.Future[tuple[list[str], list[str]]] | None:
        """Primary: start checking, in a thread, the checksums that ``_choose`` left out,
        of the checkpoint and of the item versions about to be restored with it. The
        result is (the checkpoint's problems, the items' problems).

        With ``claims`` the entries are offered first (here, before the read starts), the
        backend claims the files it checks while reading them, and the thread checks the
        rest once the backend closed its claims (``store.ReadClaims``)."""
        if checks.defer_over is None or not self._primary:
            return None
        over = checks.defer_over
        refs = [(name, version) for name, version in self._item_refs(path).items()
                if name in checks.deferred_items]
        directories = [(None, path)] + [(f"item {name!r} v{version}: ",
                                         self._store.item_path(name, version))
                                        for name, version in refs]
        offered: dict[str, list[str]] = {}  # directory -> problems found while offering
        if claims is not None:
            for _, directory in directories:
                try:
                    claims.offer(directory, self._store.deferred_entries(directory, over=over))
                except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
                    offered[directory] = [str(exc)]
                except Exception as exc:  # noqa: BLE001 - unverified bytes are never trusted
                    offered[directory] = [f"checksums could not be checked "
                                          f"({type(exc).__name__}: {exc})"]

        def problems_of(directory: str) -> list[str]:
            if claims is None:
                return self._deferred_problems(directory, over)
            if directory in offered:
                return offered[directory]
            return self._deferred_problems(directory, over, claims.unclaimed(directory))

        def run() -> tuple[list[str], list[str]]:
            own = problems_of(path)
            item_problems: list[str] = []
            for prefix, directory in directories[1:]:
                item_problems += [f"{prefix}{problem}" for problem in problems_of(directory)]
            return own, item_problems

        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                     thread_name_prefix="jaxckpt-verify")
        try:
            return pool.submit(run)
        finally:
            pool.shutdown(wait=False)  # the submitted check still runs to its end

    def _deferred_problems(self, path: str, over: int,
                           entries: list[tuple[str, dict[str, Any]]] | None = None) -> list[str]:
        """``store.verify_deferred`` (or ``verify_entries`` of the given ``entries``) under a
        reader lock, reporting instead of raising: a check that cannot run has not vouched
        for anything."""
        try:
            with self._store.reading(path):
                if entries is not None:
                    return self._store.verify_entries(path, entries)
                return self._store.verify_deferred(path, over=over)
        except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
            return [str(exc)]
        except Exception as exc:  # noqa: BLE001 - unverified bytes are never trusted
            return [f"checksums could not be checked ({type(exc).__name__}: {exc})"]

    def _item_refs(self, path: str) -> dict[str, int]:
        """Item name -> version that a committed checkpoint refers to ({} when its driver
        cannot be read: that problem is reported when the driver is read)."""
        try:
            with open(os.path.join(path, DRIVER_FILE), "rb") as handle:
                refs = json.loads(handle.read()).get("items") or {}
        except (OSError, ValueError):
            return {}
        return {name: int(ref.get("version", -1)) for name, ref in refs.items()}

    def _item_problems(self, path: str, checks: _Verification) -> list[str]:
        """What is wrong with the item versions a committed checkpoint refers to (the
        checksums of bulk files of the items in ``checks.deferred_items`` left out)."""
        problems = []
        for name, version in self._item_refs(path).items():
            item_dir = self._store.item_path(name, version)
            defer = checks.defer_over if name in checks.deferred_items else None
            try:
                for problem in self._store.verify(item_dir, checksums=checks.checksums,
                                                  defer_over=defer):
                    problems.append(f"item {name!r} v{version}: {problem}")
            except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
                problems.append(f"item {name!r} v{version}: {exc}")
        return problems

    def _read_items(self, items: Mapping[str, Any] | None, versions: Mapping[str, int],
                    path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, like in (items or {}).items():
            if name not in versions:
                warnings.warn(f"{path} refers to no version of item {name!r} (saved without it); "
                              f"it is not restored.", CheckpointWarning, stacklevel=4)
                continue
            item_dir = self._store.item_path(name, versions[name])
            with self._store.reading(item_dir):
                out[name] = self._backend.read(os.path.join(item_dir, STATE_DIR), like)
        return out

    def _check_requested(self, step: int, checks: _Verification) -> int:
        path = self._store.step_path(step)
        if not os.path.isdir(path):
            available = self._store.committed_steps()
            raise CheckpointNotFoundError(
                f"no checkpoint for step {step} under {self._store.recover_dir}; committed steps "
                f"are {available or 'none'}. Pass one of those, or step=None for the latest.")
        problems = self._store.verify(path, checksums=checks.checksums,
                                      defer_over=checks.defer_over)
        if problems:
            raise CheckpointCorruptError(
                f"checkpoint {path} failed verification: " + "; ".join(problems)
                + ". Restore another step (step=None picks the latest valid one).")
        return step

    def _read_driver(self, path: str) -> dict[str, Any]:
        file = os.path.join(path, DRIVER_FILE)
        try:
            with open(file, "rb") as handle:
                body = drv.parse_driver(handle.read(), path)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{path}: driver.json is missing") from None
        saved_backend = body.get("backend")
        if saved_backend is not None and saved_backend != self._backend.name:
            raise CheckpointError(
                f"{path} was written by the {saved_backend!r} backend but this manager uses "
                f"{self._backend.name!r}. Use the matching manager (jaxckpt.CheckpointManager "
                f"for 'orbax', torch_bridge.DcpCheckpointManager for 'dcp').")
        saved_count = body.get("process_count", 1)
        if saved_count != self._count:
            warnings.warn(
                f"{path} was saved by {saved_count} process(es) and is restored by {self._count}: "
                f"arrays are resharded; each process restores the local state (data-loader "
                f"position, RNG) saved by the process of the same index, and processes with no "
                f"saved counterpart keep their fresh local state. Check your data sharding.",
                CheckpointWarning, stacklevel=4)
        return body

    def _read_local(self, path: str) -> dict[str, Any] | None:
        try:
            with open(os.path.join(path, drv.local_filename(self._index)), "rb") as handle:
                return json.loads(handle.read())
        except FileNotFoundError:
            return None

    def _restore_local(self, local: Mapping[str, Any] | None,
                       stateful: Mapping[str, Any] | None, path: str) -> None:
        if local is None:
            if stateful:
                warnings.warn(f"{path} has no local state for process {self._index}; stateful "
                              f"objects keep their fresh state.", CheckpointWarning, stacklevel=4)
            return
        drv.restore_stateful(stateful, local.get("stateful") or {}, path)
        if self.recover_config.restore_global_rng:
            drv.restore_global_rng(local.get("rng") or {}, path)
        backend_rng = local.get("backend_rng")
        if backend_rng is not None:
            from . import codec

            self._backend.set_rng_state(codec.decode(backend_rng, "backend_rng"))

    # --- plumbing -------------------------------------------------------------------------
    def _agree(self, recover_reason: str | None, export_reason: str | None,
               preempt: bool) -> tuple[str | None, str | None, bool]:
        """In multi-process runs with time triggers or preemption handling, the primary's
        decision wins (clocks and signal delivery differ across hosts), shared by one small
        broadcast per step. Step and epoch triggers agree by construction."""
        timed = self.recover_config.every.seconds is not None or (
            self.export_config is not None and self.export_config.every.seconds is not None)
        if self._count == 1 or not (timed or self._previous_handlers):
            return recover_reason, export_reason, preempt
        bits = (1 if recover_reason else 0) | (2 if export_reason else 0) | (4 if preempt else 0)
        bits = self._backend.broadcast_int(bits)
        return ((recover_reason or "seconds") if bits & 1 else None,
                (export_reason or "seconds") if bits & 2 else None, bool(bits & 4))

    def _install_signal_handlers(self, signals: tuple[int, ...]) -> None:
        if not signals or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            # Only record: the save happens at the next step boundary, on the training thread.
            if self._preempt_signal is None:
                self._preempt_signal = signum

        for signum in signals:
            self._previous_handlers[signum] = signal.signal(signum, handler)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    def _wait_for(self, condition: Callable[[], bool], what: str) -> None:
        deadline = self._clock() + self._commit_timeout_s
        while not condition():
            if self._clock() > deadline:
                raise TimeoutError(f"gave up after {self._commit_timeout_s} s waiting for {what}")
            time.sleep(_POLL_S)

    def _drain(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()  # job() never raises; errors land on their reports

    def _raise_unraised(self) -> None:
        with self._state_lock:
            failed, self._unraised = self._unraised, []
        failed = [r for r in failed if not r._delivered]
        if not failed:
            return
        first = failed[0]
        if self._on_write_error == "warn":
            for report in failed:
                warnings.warn(str(_write_error(report, report.error)), CheckpointWarning,
                              stacklevel=3)
            return
        first._delivered = True
        raise _write_error(first, first.error)

    def _check_usable(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed; create a new one.")

    def _prepare_root(self) -> None:
        """Primary: create the layout, take the root lock, clean what a crash left behind.
        The lock is released again if anything after it fails."""
        root = self._store.root
        try:
            self._store.ensure_dirs()
            self._lock = RootLock(root)
            self._lock.acquire()
        except CheckpointError:
            raise
        except OSError as exc:
            raise CheckpointRootError(
                f"checkpoint root {root!r} cannot be used: {exc.strerror or exc} ({exc.filename}). "
                f"The root must be a directory this process can create and write (it is "
                f"created if missing). Fix: pass another root, or give this user write access "
                f"to it (chmod/chown).") from exc
        try:
            removed = self._store.cleanup_partial()
        except BaseException:
            self._release_lock()
            raise
        if removed:
            log.warning("jaxckpt: removed %d partial or temporary entries left by an "
                        "interrupted run: %s", len(removed), removed)

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


_FAIL_CLOSED = -2
"""What ``_choose`` shares when committed checkpoints exist and none verifies (-1: none)."""


def _export_record(export: ExportConfig | None) -> dict[str, Any] | None:
    """What the exporter says about itself (``exporter.checkpoint_metadata``, e.g. the HF arch
    and config), recorded in every recovery checkpoint's driver.json under "export" so a
    checkpoint can be exported later without being told how (``jaxckpt export-hf``)."""
    record = getattr(export.exporter, "checkpoint_metadata", None) if export else None
    if record is None:
        return None
    try:
        return json.loads(json.dumps(dict(record)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"ExportConfig.exporter.checkpoint_metadata must be a JSON-safe "
                          f"dict, got {type(record).__name__}: {exc}") from None


def _check_signals(signals: Any) -> tuple[int, ...]:
    try:
        values = tuple(signals)
    except TypeError:
        values = None
    if values is None or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"preemption_signals must be a tuple of signal numbers, got {signals!r}. "
                          f"Write e.g. (signal.SIGTERM,), or () to leave signals alone.")
    return values


def _check_step_info(step_info: Any) -> None:
    if not isinstance(step_info, StepInfo):
        raise ConfigError(f"step_info must be a jaxckpt.StepInfo, got {type(step_info).__name__} "
                          f"{step_info!r}. Write StepInfo(epoch, epoch_step, global_step, "
                          f"steps_per_epoch).")


def _resolve_state(state: Any) -> Any:
    """``state``, or what it returns when it is a plain function (lambda, def, bound
    method, functools.partial). Only those: a function is never an array state itself,
    while pytree containers and modules with ``__call__`` are."""
    if isinstance(state, (types.FunctionType, types.MethodType, functools.partial)):
        return state()
    return state


def _known_checksums(handle: Any) -> dict[str, dict[str, Any]] | None:
    """Manifest entries a backend's write handle offers for the files it wrote (optional
    ``checksums``: by path relative to the directory it wrote, ``STATE_DIR``), as paths
    relative to the checkpoint; the commit then does not read those files back."""
    entries = getattr(handle, "checksums", None)
    if not entries:
        return None
    return {f"{STATE_DIR}/{rel}": info for rel, info in entries.items()}


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, name))
    return total


def _default_backend() -> Backend:
    from .orbax_backend import OrbaxBackend  # the only path from here to jax/orbax

    return OrbaxBackend()
