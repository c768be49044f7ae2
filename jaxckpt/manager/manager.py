"""CheckpointManager: the policy, the store and the driver state tied to one array backend.

Owns: the public API (``recover``, ``restore``, ``maybe_save``, ``save``, ``export``,
``wait``, ``close``, ``pin``), deciding at each step what is due (``core.policy``'s
triggers, agreed across processes by ``preemption``), the last completed step, and the
wiring of the parts, which share a ``context.ManagerContext``: ``arguments``,
``background``, ``save``, ``export``, ``restore``, ``commit.verification``,
``preemption``, ``root``, ``reports`` and ``local_tier``.

Must not import: jax, orbax, torch. The Orbax backend is imported lazily when no backend is
given.

Concurrency: one training thread uses a manager; its background thread runs commits,
exports and deletions in order, a failure there raised by the next call (or warned). One
job per root; across processes the primary decides and commits, each writes its share.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from jaxckpt.backends.base import Backend
from jaxckpt.commit.pins import Pins
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.config import (
    Every,
    ExportConfig,
    LocalTier,
    RecoverConfig,
    StepInfo,
    check_item_cadences,
)
from jaxckpt.core.policy import SaveTrigger, resolve_mode, writes_periodic
from jaxckpt.errors import CheckpointError, CheckpointWarning, ConfigError
from jaxckpt.manager import driver_state as drv
from jaxckpt.manager.arguments import check_arguments, check_step_info
from jaxckpt.manager.background import SavePipeline
from jaxckpt.manager.context import ManagerContext
from jaxckpt.manager.export import Exporter, export_record
from jaxckpt.manager.local_tier import LocalTierSet, check_local
from jaxckpt.manager.preemption import Preemption
from jaxckpt.manager.reports import Recovered, SaveReport
from jaxckpt.manager.restore import Restorer, start_fresh
from jaxckpt.manager.root import attach_backend, open_store, prepare_root
from jaxckpt.manager.save import Saver, resolve_state
from jaxckpt.storage.base import RootLock

__all__ = ["CheckpointManager", "SaveReport", "Recovered"]

log = logging.getLogger("jaxckpt")


class CheckpointManager:
    """Recovery checkpoints and exports for one training run under ``root``.

    Args:
        root: a local path, or ``s3://bucket/prefix`` / ``gs://bucket/prefix`` (docs/cloud.md).
        recover: the recovery checkpoints' config (default ``RecoverConfig()``).
        export: the exports' config; None: no exports.
        mode: "sync", "async" or "auto" (async where the backend supports it).
        backend: the array backend; default the Orbax backend (JAX/Flax pytrees).
        on_report: called with every finished :class:`SaveReport` (from the background thread
            in async mode).
        on_write_error: "raise": a failed save raises at the next call; "warn": a
            ``CheckpointWarning``, training goes on (earlier checkpoints stay valid).
        commit_timeout_s: how long a commit waits for the other processes' writes.
        preemption_signals: signals that request a checkpoint at the next step boundary
            (reason "preempted"); handlers installed from the main thread only, restored by
            ``close``; ``()`` leaves signals alone.
        on_preemption: "exit": once that checkpoint committed and the manager closed, end the
            process as the signal would have; "continue": the loop stops on ``preempted``.
        items: auxiliary items on their own cadence, ``{name: Every(steps=K)}``; their trees
            go in ``items=`` of ``maybe_save``/``save`` (version from the step, or
            ``Versioned(version, tree)``), written once per version.
        clock: the time source of the time triggers (tests inject one).
        local: a fast local tier (``LocalTier``) of frequent checkpoints between the durable
            root's; ``recover`` resumes from the newest valid one of either.
        storage_options: the object store's client settings (``endpoint_url``, credentials,
            ``max_attempts``, ``lease_s``/``heartbeat_s``...), else the standard environment.

    Concurrency: one training thread; one background thread; one job per root.
    """

    def __init__(self, root: str | os.PathLike[str], *, recover: RecoverConfig | None = None,
                 export: ExportConfig | None = None, mode: str = "auto",
                 backend: Backend | None = None,
                 on_report: Callable[[SaveReport], Any] | None = None,
                 on_write_error: Literal["raise", "warn"] = "raise",
                 commit_timeout_s: float = 1800.0,
                 preemption_signals: Sequence[int] = (signal.SIGTERM,),
                 on_preemption: Literal["exit", "continue"] = "exit",
                 items: Mapping[str, Every] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 local: LocalTier | None = None,
                 storage_options: Mapping[str, Any] | None = None):
        recover = RecoverConfig() if recover is None else recover
        signals = check_arguments(root, recover=recover, export=export, backend=backend,
                                   on_report=on_report, on_write_error=on_write_error,
                                   commit_timeout_s=commit_timeout_s,
                                   preemption_signals=preemption_signals,
                                   on_preemption=on_preemption)
        check_item_cadences(items or {}, recover)
        check_local(local, root)  # before anything is created
        # Before anything is created or written (no backend, no lock, no recover/): an
        # unknown scheme, and a root holding another tool's files, are refused whole.
        store = open_store(root, storage_options, backend)
        self.recover_config = recover
        self.export_config = export
        record = export_record(export)
        self._owns_backend = backend is None
        backend = backend if backend is not None else _default_backend()
        try:
            attach_backend(store, backend)  # an object-store root: a backend that writes there
        except BaseException:
            if self._owns_backend:
                backend.close()
            raise
        save_mode = resolve_mode(mode, supports_async=backend.features.supports_async)
        export_mode = None if export is None else resolve_mode(
            export.mode, supports_async=True, field="ExportConfig.mode")
        index, count = backend.process_index, backend.process_count
        self._lock: RootLock | None = prepare_root(store) if index == 0 else None
        try:
            backend.barrier("jaxckpt.init", 120.0)
        except BaseException:
            self._release_lock()
            raise
        self._ctx = ctx = ManagerContext(
            store=store, backend=backend, recover_config=recover, export_config=export,
            process_index=index, process_count=count,
            # Versions already on disk (committed) per item: never written twice.
            written_items={name: set(store.item_versions(name)) for name in store.item_names()},
            pins=Pins(store, primary=index == 0),
            recover_trigger=SaveTrigger(recover.every, clock=clock),
            export_trigger=SaveTrigger(export.every, clock=clock) if export else None)
        self._pipeline = SavePipeline(on_report=on_report, on_write_error=on_write_error,
                                      clock=clock, commit_timeout_s=commit_timeout_s)
        self._saver = Saver(ctx, self._pipeline, mode=save_mode,
                                    item_cadences=items or {}, export_record=record)
        self._exporter = (None if export_mode is None
                          else Exporter(ctx, self._pipeline, mode=export_mode))
        self._restorer = Restorer(ctx)
        self._local: LocalTierSet | None = None
        self._closed = False
        # The last step the loop reported as completed (maybe_save) or resumed from (recover):
        # what save() records when given no step, and what it checks a given step against.
        self._last_completed: StepInfo | None = None
        timed = recover.every.seconds is not None or (
            export is not None and export.every.seconds is not None)
        self._preemption = Preemption(process_count=count, timed=timed,
                                      broadcast=lambda bits: backend.broadcast_int(bits),
                                      on_preemption=on_preemption)
        self._preemption.install(signals)
        if local is not None:
            try:  # its own backend when this manager made its own: never queued behind durable
                self._local = LocalTierSet(
                    local, durable=ctx, backend=_default_backend() if self._owns_backend
                    else backend, owns_backend=self._owns_backend, mode=save_mode,
                    on_report=on_report, clock=clock, commit_timeout_s=commit_timeout_s,
                    item_cadences=items or {}, export_record=record)
            except BaseException:
                self.close()
                raise

    # --- public API ---------------------------------------------------------------------
    @property
    def root(self) -> str:
        return self._ctx.store.root

    @property
    def store(self) -> CheckpointStore:
        return self._ctx.store

    @property
    def backend(self) -> Backend:
        return self._ctx.backend

    @property
    def preempted(self) -> bool:
        """True once a preemption signal was turned into a checkpoint (a loop sees it with
        ``on_preemption="continue"``: stop, then ``close()``, which waits for its commit)."""
        return self._preemption.preempted

    def request_preemption_save(self, signum: int = 0) -> None:
        """Ask for a checkpoint at the next ``maybe_save``, as a preemption signal would (for
        schedulers that announce preemption some other way, e.g. a metadata endpoint); with a
        ``signum`` and ``on_preemption="exit"`` the process then ends as that signal would."""
        self._preemption.request(signum)

    def committed_steps(self) -> list[int]:
        """Steps of committed recovery checkpoints, oldest first."""
        return self._ctx.store.committed_steps()

    def pin(self, step: int) -> None:
        """Keep the checkpoint of ``step`` whatever the retention rules say, across restarts
        (stored in ``{root}/pins.json``). ``CheckpointNotFoundError`` (listing the committed
        steps) when no committed checkpoint is at ``step``. A save of ``step`` still in
        flight (async) is waited for first."""
        self._check_usable()
        last = self._ctx.last.get("recover")
        if last is not None and last.step == step:
            self.wait()
        pins = self._ctx.pins
        assert pins is not None  # a manager's context always has its root's pins
        pins.pin(step)

    def unpin(self, step: int) -> None:
        """Undo ``pin(step)``; retention may delete it after the next save."""
        self._check_usable()
        pins = self._ctx.pins
        assert pins is not None  # a manager's context always has its root's pins
        pins.unpin(step)

    def recover(self, like: Any, *, stateful: Mapping[str, Any] | None = None,
                items: Mapping[str, Any] | None = None,
                partial: bool = False) -> Recovered | None:
        """Resume from the latest valid recovery checkpoint, or return None when there is
        none (or recovery is off, or ``RecoverConfig.resume`` is False: see there).
        ``stateful`` objects are restored in place and remembered as the default for later
        saves. ``items`` maps item names to ``like`` trees: each is restored at the version
        the checkpoint refers to. ``partial``: as in ``restore``."""
        self._check_usable()
        if stateful is not None:
            # Validate early: a bad object fails now, not at the first save.
            drv.capture_stateful(stateful)
            self._ctx.default_stateful = stateful
            if self._local is not None:
                self._local.set_default_stateful(stateful)
        if not self.recover_config.enabled:
            return None
        self._pipeline.drain()
        self._pipeline.raise_unraised()
        if not self.recover_config.resume:
            start_fresh(self._ctx, *([self._local.ctx] if self._local is not None else []))
            return None
        result = self._restore(like, stateful=stateful, step=None, required=False, items=items,
                               partial=partial)
        if result is not None:
            self._last_completed = result.step_info  # what save() records with no step
        return result

    def restore(self, like: Any, *, step: int | None = None,
                stateful: Mapping[str, Any] | None = None,
                items: Mapping[str, Any] | None = None,
                partial: bool = False) -> Recovered:
        """Restore a recovery checkpoint (``step=None``: the latest valid one), whatever the
        recover mode. Raises ``CheckpointNotFoundError`` when there is none.

        ``partial=True``: ``like`` is a subtree of what was saved (e.g. ``{"model": model}``
        of a checkpoint of model and optimizer); only its arrays are read and checksummed,
        the result has exactly its keys, and a path of it that was never saved raises
        ``TreeMismatchError`` naming it. Stateful objects given are restored; the global
        RNGs are left alone (docs/guarantees.md)."""
        self._check_usable()
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ConfigError(f"restore(step=...) takes a global step (an int >= 0) or None for "
                              f"the latest valid checkpoint, got {step!r}.")
        self._pipeline.drain()
        self._pipeline.raise_unraised()
        result = self._restore(like, stateful=stateful, step=step, required=True, items=items,
                               partial=partial)
        assert result is not None
        # Not a resume point: restore() also serves evaluation and inspection, so it leaves
        # the last completed step (what save() records with no step) to maybe_save/recover.
        return result

    def maybe_save(self, step_info: StepInfo, state: Any, *,
                   stateful: Mapping[str, Any] | None = None,
                   metrics: Mapping[str, Any] | None = None,
                   epoch_end: bool | None = None,
                   items: Mapping[str, Any] | None = None) -> list[SaveReport]:
        """Save a recovery checkpoint and/or an export if one is due after ``step_info``.

        ``state`` is the array state, or a function of no arguments that returns it
        (e.g. ``lambda: nnx.state((model, optimizer))``): called only when something is
        due, so the steps between saves do not pay for building the state tree.
        ``epoch_end`` defaults to what
        ``step_info`` says (last step of its epoch, when ``steps_per_epoch`` is known).
        ``items``: auxiliary items (see the class docstring), only touched when a recovery
        checkpoint is due. Returns the reports of the saves started (often [])."""
        self._check_usable()
        check_step_info(step_info)
        self._last_completed = step_info
        if epoch_end is None:
            epoch_end = step_info.is_epoch_end
        recover_reason = None
        if self.recover_config.enabled and writes_periodic(self.recover_config.keep_last_n):
            recover_reason = self._ctx.recover_trigger.due(step_info, epoch_end=epoch_end)
        export_reason = None
        export_trigger, export = self._ctx.export_trigger, self.export_config
        if (export_trigger is not None and export is not None
                and writes_periodic(export.keep_last_n)):
            export_reason = export_trigger.due(step_info, epoch_end=epoch_end)
        recover_reason, export_reason, preempt = self._preemption.agree(
            recover_reason, export_reason, self._preemption.requested)
        local_reason = None  # a local save only where the durable root takes none
        if self._local is not None and self.recover_config.enabled:
            local_reason = self._local.due(step_info, epoch_end=epoch_end)
        if preempt:
            self._preemption.mark_preempted()
            if self.recover_config.enabled:
                recover_reason = "preempted"
            else:
                warnings.warn("preemption requested but recovery is off: no checkpoint written.",
                              CheckpointWarning, stacklevel=2)
        reports = []
        if recover_reason or export_reason or local_reason:
            state = resolve_state(state)
        if (recover_reason or local_reason) and not self._saver.scope_checked:
            self._saver.warn_left_out(state, items, sys._getframe(1))
        if recover_reason:
            reports.append(self._saver.save(step_info, state, stateful, metrics, recover_reason,
                                            items=items, epoch_end=epoch_end))
            if self._local is not None:
                self._local.durable_saved()
        elif local_reason:
            assert self._local is not None
            reports.append(self._local.save(step_info, state, stateful, metrics, local_reason,
                                            items=items, epoch_end=epoch_end))
        if export_reason:
            assert self._exporter is not None
            reports.append(self._exporter.save(step_info, state, export_reason))
        if preempt:  # "exit": the process ends in here, once the checkpoint committed
            self._preemption.end_after(reports, wait=self.wait, barrier=self._ctx.barrier,
                                       close=self._shut_down)
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
            mode, supports_async=self._ctx.backend.features.supports_async, field="save(mode=...)")
        if epoch_end is None:
            epoch_end = step_info.is_epoch_end
        if not self._saver.scope_checked:
            state = resolve_state(state)
            self._saver.warn_left_out(state, items, sys._getframe(1))
        return self._saver.save(step_info, state, stateful, metrics, "forced", override,
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
        check_step_info(step_info)
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
        check_step_info(step_info)
        if self._exporter is None:
            raise ConfigError(
                "export() needs CheckpointManager(export=ExportConfig(exporter=...)).")
        return self._exporter.save(step_info, state, "forced")

    def wait(self) -> None:
        """Block until every save started so far committed; raise the first failure (of the
        durable root: a failed local save is only warned)."""
        if self._local is not None:
            self._local.wait()
        self._pipeline.drain()
        self._pipeline.raise_unraised()

    def close(self) -> None:
        """Finish in-flight saves, stop the background thread, release the root; then a
        preemption signal no ``maybe_save`` acted on ends the process (``"exit"``)."""
        self._shut_down()
        self._preemption.end_if_pending()

    def _shut_down(self) -> None:
        """``close`` without ending the process (subclasses release their parts here)."""
        if self._closed:
            return
        try:
            self._pipeline.drain()
        finally:
            self._closed = True
            self._preemption.restore()
            self._pipeline.shutdown()
            if self._local is not None:
                self._local.close()
            if self._owns_backend:
                self._ctx.backend.close()
            self._release_lock()
        self._pipeline.raise_unraised()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # Do not mask the propagating error (nor end the process); finish what can be.
        try:
            self._shut_down()
        except Exception as close_exc:  # noqa: BLE001 - reported, original error wins
            log.error("jaxckpt: error while closing after %s: %s", exc_type.__name__, close_exc)

    def _restore(self, like: Any, **kwargs: Any) -> Recovered | None:
        """``Restorer.restore``, across both tiers when there is a local one."""
        if self._local is None:
            return self._restorer.restore(like, **kwargs)
        return self._local.restore(self._restorer, like, **kwargs)

    def _check_usable(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointManager is closed; create a new one.")

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _default_backend() -> Backend:
    from jaxckpt.backends.orbax.backend import OrbaxBackend  # the only path from here to jax/orbax

    return OrbaxBackend()
