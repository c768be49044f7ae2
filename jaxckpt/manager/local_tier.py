"""A fast local tier over the durable root: frequent recovery checkpoints on local disk, and
recovery across both tiers.

Owns: :class:`LocalTierSet`, what ``local=LocalTier(...)`` adds: a second
``CheckpointStore`` at ``LocalTier.path`` (same protocol, its own lock and retention), its
trigger, pipeline and saver, the ``tier.json`` claim tying it to one durable root, and the
choice of the checkpoint to resume from across both tiers (newest first, local first at an
equal step, falling back, failing closed across both). The durable tier never waits for
the local one; where both are due only the durable root is written; a failed local write
is a ``CheckpointWarning``. docs/design.md has the rules.

Must not import: jax, orbax, torch, or the manager facade (``manager`` imports this).

Concurrency: the training thread; the local pipeline has a background thread of its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from jaxckpt.backends.base import Backend
from jaxckpt.commit.ownership import check_root
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.config import Every, LocalTier, RecoverConfig, StepInfo
from jaxckpt.core.layout import TIER_FILE
from jaxckpt.core.policy import SaveTrigger
from jaxckpt.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointRootError,
    CheckpointWarning,
    ConfigError,
)
from jaxckpt.manager.background import SavePipeline
from jaxckpt.manager.context import ManagerContext
from jaxckpt.manager.export import ExportRecord
from jaxckpt.manager.reports import Recovered, SaveReport
from jaxckpt.manager.restore import Restorer
from jaxckpt.manager.root import prepare_root
from jaxckpt.manager.save import Saver
from jaxckpt.storage.base import RootLock
from jaxckpt.storage.url import is_url

__all__ = ["LocalTierSet", "check_local", "local_rules"]

LOCAL = "local"
DURABLE = "durable"


def local_rules(durable: RecoverConfig, tier: LocalTier) -> RecoverConfig:
    """The recovery settings of the local tier: the durable ones (verification, RNG,
    on_corrupt) with the local cadence and plain keep-last-N retention."""
    return dataclasses.replace(durable, every=tier.every, keep_last_n=tier.keep_last_n,
                               keep_every=None, keep_best=None)


class LocalTierSet:
    """The local tier of one manager and recovery across it and the durable root."""

    def __init__(self, config: LocalTier, *, durable: ManagerContext, backend: Backend,
                 owns_backend: bool, mode: str, on_report: Callable[[SaveReport], Any] | None,
                 clock: Callable[[], float], commit_timeout_s: float,
                 item_cadences: Mapping[str, Every], export_record: ExportRecord | None):
        self._owns_backend = owns_backend  # ``backend`` is this tier's alone: close it
        self._backend = backend
        self._lock: RootLock | None = None
        try:
            if durable.process_count > 1:
                raise ConfigError(
                    f"CheckpointManager(local=LocalTier(...)) supports single-process runs "
                    f"only for now; this run has {durable.process_count} processes. Drop "
                    f"local= (every save then goes to the durable root).")
            path = os.fspath(config.path)
            check_local(config, durable.store.root)
            check_root(path)  # before anything is created: never write beside foreign files
            store = CheckpointStore(path)
            self._lock = prepare_root(store)
            _claim(store, durable.store.root)
        except BaseException:
            self.release()
            raise
        self._durable = durable
        self.config = config
        self.ctx = ManagerContext(
            store=store, backend=backend, recover_config=local_rules(durable.recover_config,
                                                                     config),
            export_config=None, process_index=0, process_count=1,
            written_items={name: set(store.item_versions(name)) for name in store.item_names()},
            recover_trigger=SaveTrigger(config.every, clock=clock), export_trigger=None)
        # Failures of local saves are warnings: the durable tier and training go on.
        self._pipeline = SavePipeline(on_report=on_report, on_write_error="warn", clock=clock,
                                      commit_timeout_s=commit_timeout_s)
        self._saver = Saver(self.ctx, self._pipeline, mode=mode,
                                    item_cadences=item_cadences, export_record=export_record,
                                    tier=LOCAL)
        self._saver.scope_checked = True  # the durable saver warns about left-out objects
        self._restorer = Restorer(self.ctx)

    @property
    def store(self) -> CheckpointStore:
        return self.ctx.store

    # --- saving ---------------------------------------------------------------------------
    def due(self, step: StepInfo, *, epoch_end: bool) -> str | None:
        """Why a local save is due after ``step``, or None."""
        return self.ctx.recover_trigger.due(step, epoch_end=epoch_end)

    def durable_saved(self) -> None:
        """The durable root took this step's save: the local clock restarts as if the
        local tier had (the newest state is saved; writing it twice gains nothing)."""
        self.ctx.recover_trigger.mark_saved()

    def save(self, step: StepInfo, state: Any, stateful: Mapping[str, Any] | None,
             metrics: Mapping[str, Any] | None, reason: str, *,
             items: Mapping[str, Any] | None, epoch_end: bool) -> SaveReport:
        """A recovery checkpoint of ``step`` in the local tier (report ``tier="local"``)."""
        return self._saver.save(step, state, stateful, metrics, reason, items=items,
                                epoch_end=epoch_end)

    def set_default_stateful(self, stateful: Mapping[str, Any]) -> None:
        self.ctx.default_stateful = stateful

    def wait(self) -> None:
        """Block until every local save started so far committed (failures are warned)."""
        self._pipeline.drain()
        self._pipeline.raise_unraised(stacklevel=4)

    def close(self) -> None:
        """Finish local saves, stop the local thread, release the local root."""
        try:
            self._pipeline.drain()
        finally:
            self._pipeline.shutdown()
            self.release()
        self._pipeline.raise_unraised(stacklevel=4)

    def release(self) -> None:
        """Release the local root (and close the backend this tier was given to own)."""
        if self._owns_backend:
            self._owns_backend = False
            self._backend.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # --- recovery -------------------------------------------------------------------------
    def restore(self, durable: Restorer, like: Any, *, stateful: Mapping[str, Any] | None,
                step: int | None, required: bool, items: Mapping[str, Any] | None,
                **options: Any) -> Recovered | None:
        """The newest checkpoint that verifies in either tier (``step``: that step, from the
        local tier when it holds a valid copy, else from the durable root), restored like
        ``Restorer.restore`` does, with ``Recovered.tier`` saying where it came from.
        ``options``: further arguments of ``Restorer.restore``, passed to each tier's."""
        self.wait()
        if step is not None:
            return self._restore_step(durable, like, stateful=stateful, step=step, items=items,
                                      **options)
        local_steps = self.store.committed_steps()
        candidates = sorted([(s, 1, LOCAL) for s in local_steps]
                            + [(s, 0, DURABLE) for s in self._durable.store.committed_steps()],
                            reverse=True)  # newest first; local first at an equal step
        failed: list[tuple[str, int, str, str]] = []  # (tier, step, path, why)
        for candidate, _, tier in candidates:
            recovery = self._restorer if tier == LOCAL else durable
            try:
                result = recovery.restore(like, stateful=stateful, step=candidate,
                                          required=True, items=items, **options)
            except CheckpointFormatError:
                raise  # newer, not damaged: skipping it would silently drop progress
            except (CheckpointCorruptError, CheckpointNotFoundError) as exc:
                failed.append((tier, candidate, self._ctx_of(tier).store.step_path(candidate),
                               str(exc)))
                continue
            self._set_aside(failed)
            self._warn_fallback(tier, result, failed, local_empty=not local_steps)
            return self._resumed(tier, result, failed)
        if failed:
            self._no_valid_checkpoint(failed)  # the durable root's were damaged: fail closed
        if required:
            raise CheckpointNotFoundError(
                f"no valid recovery checkpoint under {self._durable.store.recover_dir} or in "
                f"the local tier {self.store.recover_dir}. Train from scratch, or point the "
                f"manager at the root that holds the checkpoints.")
        return None

    def _restore_step(self, durable: Restorer, like: Any, *,
                      stateful: Mapping[str, Any] | None, step: int,
                      items: Mapping[str, Any] | None, **options: Any) -> Recovered:
        failed: list[tuple[str, int, str, str]] = []
        if step in self.store.committed_steps():
            try:
                result = self._restorer.restore(like, stateful=stateful, step=step,
                                                required=True, items=items, **options)
                return self._resumed(LOCAL, result, failed)
            except CheckpointFormatError:
                raise
            except CheckpointCorruptError as exc:
                if step not in self._durable.store.committed_steps():
                    raise  # the only copy is damaged: say so, not "not found"
                failed.append((LOCAL, step, self.store.step_path(step), str(exc)))
        result = durable.restore(like, stateful=stateful, step=step, required=True, items=items,
                                 **options)
        assert result is not None
        self._warn_fallback(DURABLE, result, failed, local_empty=False)
        return self._resumed(DURABLE, result, failed)

    def _ctx_of(self, tier: str) -> ManagerContext:
        return self.ctx if tier == LOCAL else self._durable

    def _resumed(self, tier: str, result: Recovered | None,
                 failed: list[tuple[str, int, str, str]]) -> Recovered:
        """Both tiers resume from the restored step: the other tier's saves before it are
        history too, and its clock restarts now."""
        assert result is not None
        other = self._durable if tier == LOCAL else self.ctx
        other.last.clear()
        other.restored_step = result.step_info.global_step
        other.recover_trigger.mark_saved()
        if other.export_trigger is not None:
            other.export_trigger.mark_saved()
        skipped = tuple(f"{tier_}: {path}: {why}" for tier_, _, path, why in failed)
        return dataclasses.replace(result, tier=tier, skipped=skipped + result.skipped)

    def _warn_fallback(self, tier: str, result: Recovered | None,
                       failed: list[tuple[str, int, str, str]], *, local_empty: bool) -> None:
        assert result is not None
        where = f"the {tier} tier at step {result.step_info.global_step} ({result.path})"
        if failed:
            warnings.warn(f"resuming from {where}, skipping newer unusable checkpoints: "
                          + " | ".join(f"{t} tier: {path}: {why}" for t, _, path, why in failed),
                          CheckpointWarning, stacklevel=5)
        elif tier == DURABLE and local_empty:
            warnings.warn(f"the local tier {self.store.root} holds no checkpoint (a new "
                          f"machine, a cleared disk, or no local save yet): resuming from "
                          f"{where}.", CheckpointWarning, stacklevel=5)

    def _set_aside(self, failed: list[tuple[str, int, str, str]]) -> None:
        """Unusable checkpoints newer than the one restored go to their tier's
        ``recover/superseded/`` (kept for inspection; steps about to be redone reuse their
        names)."""
        for tier, _, path, _ in failed:
            store = self._ctx_of(tier).store
            try:
                if store.storage.is_prefix(path):
                    store.quarantine(path, "corrupt")
            except OSError as exc:
                warnings.warn(f"could not move the unusable checkpoint {path} aside: {exc}",
                              CheckpointWarning, stacklevel=5)

    def _no_valid_checkpoint(self, failed: list[tuple[str, int, str, str]]) -> None:
        """Nothing verifies in either tier. The durable root is the record of the run: when
        it holds checkpoints and none verifies, fail closed (``RecoverConfig.on_corrupt``).
        When only local checkpoints are damaged, the local tier counts as lost (as on a new
        machine with an empty durable root): they are set aside and the run starts fresh,
        with a warning."""
        listing = "\n".join(f"  - {tier} tier: {path}: {why}" for tier, _, path, why in failed)
        if all(tier == LOCAL for tier, _, _, _ in failed):
            warnings.warn(f"the local tier {self.store.root} holds no usable checkpoint and the "
                          f"durable root {self._durable.store.root} none at all: starting "
                          f"fresh. Moved aside:\n" + listing, CheckpointWarning, stacklevel=5)
            self._set_aside(failed)
            return
        if self._durable.recover_config.on_corrupt == "start_fresh":
            warnings.warn("no checkpoint in either tier verifies; starting fresh as "
                          "RecoverConfig(on_corrupt='start_fresh') asks. Moved aside:\n"
                          + listing, CheckpointWarning, stacklevel=5)
            self._set_aside(failed)
            return
        raise CheckpointCorruptError(
            f"the durable root holds checkpoints but none verifies, nor does any of the local "
            f"tier, so there is nothing safe to resume from; nothing was restored, moved or "
            f"deleted:\n{listing}\nFix: repair or restore the files, point the manager at "
            f"other roots, or opt in to starting over with "
            f"RecoverConfig(on_corrupt=\"start_fresh\").")


def check_local(config: Any, durable_root: str | os.PathLike[str]) -> None:
    """``ConfigError`` unless ``config`` is None or a ``LocalTier`` apart from the durable
    root: the two tiers must not share a directory, nor hold one another."""
    if config is None:
        return
    if not isinstance(config, LocalTier):
        raise ConfigError(f"local must be a jaxckpt.LocalTier or None, got {config!r}.")
    local, durable = os.fspath(config.path), os.fspath(durable_root)
    if is_url(durable):
        return
    a, b = os.path.realpath(local), os.path.realpath(durable)
    if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
        raise ConfigError(
            f"LocalTier.path={local!r} and the durable root {durable!r} overlap; the local "
            f"tier is a root of its own. Put it on the machine's local disk apart from the "
            f"durable root, e.g. /local_ssd/<run>.")


def _durable_id(root: str) -> str:
    return root if is_url(root) else os.path.abspath(root)


def _claim(store: CheckpointStore, durable_root: str) -> None:
    """Tie the local root to ``durable_root`` (``tier.json``), or refuse a local root that
    holds checkpoints of another durable root (resuming from them would continue another
    run)."""
    marker = os.path.join(store.root, TIER_FILE)
    owner = _durable_id(durable_root)
    try:
        recorded = json.loads(store.storage.read(marker)).get("durable_root")
    except FileNotFoundError:
        recorded = None
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointRootError(f"{marker} is unreadable ({exc}); it names the durable root "
                                  f"this local tier belongs to. Fix: delete the local tier "
                                  f"directory {store.root!r}.") from exc
    if recorded == owner:
        return
    if recorded is not None or store.committed_steps():
        raise CheckpointRootError(
            f"the local tier {store.root!r} belongs to another durable root "
            f"({recorded or 'none recorded'}), not {owner!r}: resuming from it would continue "
            f"another run. Fix: give each run its own LocalTier.path, or delete "
            f"{store.root!r} if its checkpoints are no longer wanted.")
    store.storage.write(marker, json.dumps({"durable_root": owner}).encode())
