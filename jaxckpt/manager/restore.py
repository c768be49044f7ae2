"""Restorer: find the checkpoint to resume from, verify it, fall back past damaged ones, and
read it.

Owns: ``Restorer``: choosing the step (the primary walks committed checkpoints newest first,
checks each and its item versions, starts fetching bulk files early on an object store,
and shares its choice), failing closed (``RecoverConfig.on_corrupt``), reading driver,
arrays and items under a reader lock, judging the read once the deferred checksums are in,
falling back, setting unusable checkpoints aside, and restoring local state only once the
arrays are in; ``start_fresh``. docs/architecture.md, Walk 2, names the functions.

Must not import: jax, orbax, torch, or the save, export and pipeline parts: the manager
waits for in-flight saves before it calls ``restore``.

Concurrency: the training thread, no save in flight; the step being read is in the
context's ``reading`` set (under ``state_lock``), so retention leaves it alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from jaxckpt.commit import verification
from jaxckpt.commit.deferred_checks import DeferredChecks
from jaxckpt.commit.prefetch import ReadAhead
from jaxckpt.commit.store import Entry
from jaxckpt.commit.verification import DeferredChecksumsFailed, Verification, Verifier
from jaxckpt.config import StepInfo
from jaxckpt.core.layout import STATE_DIR
from jaxckpt.core.manifest import Manifest, deferrable
from jaxckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointWarning,
)
from jaxckpt.manager import driver_state as drv
from jaxckpt.manager.context import ManagerContext
from jaxckpt.manager.reports import Recovered
from jaxckpt.storage.posix import PosixStorage

__all__ = ["Restorer", "start_fresh"]

_FAIL_CLOSED = -2
"""What ``_choose`` shares when committed checkpoints exist and none verifies (-1: none)."""


def _fetch_state_ahead(ahead: ReadAhead, checks: Verification, path: str,
                       manifest: Manifest) -> None:
    """Start fetching the deferred files of ``path``'s state (those the backend claims)."""
    inside = STATE_DIR + "/"
    ahead.start((os.path.join(path, *rel.split("/")), info)
                for rel, info in sorted(manifest.files.items())
                if rel.startswith(inside) and checks.defer_over is not None
                and deferrable(rel, info, checks.defer_over))


def start_fresh(*contexts: ManagerContext) -> list[str]:
    """``RecoverConfig(resume=False)``: on each tier's context (the durable root, then the
    local tier's), the primary moves every committed checkpoint to ``recover/superseded/``
    and warns naming them, so that the run's new saves (from step 0) are the root's only
    checkpoints: retention and "latest" would otherwise prefer the older run's higher
    steps. Returns what was moved."""
    all_moved = []
    for ctx in contexts:
        moved = []
        if ctx.primary:
            for step in ctx.store.committed_steps():
                path = ctx.store.step_path(step)
                moved.append(f"{path} -> {ctx.store.quarantine(path, 'fresh')}")
        # No process writes step 0 of the new run while the old one is still being moved.
        ctx.barrier("jaxckpt.start_fresh", 600.0)
        if moved:
            warnings.warn(
                f"not resuming: RecoverConfig(resume=False) (torchtune: "
                f"resume_from_checkpoint: False) starts over although "
                f"{ctx.store.recover_dir} holds {len(moved)} committed checkpoint(s); moved "
                "aside for inspection: " + " | ".join(moved) + ". Set resume=True "
                "(resume_from_checkpoint: true) to resume from them instead.",
                CheckpointWarning, stacklevel=3)
        all_moved += moved
    return all_moved


class Restorer:
    """Restores the recovery checkpoints of one manager."""

    def __init__(self, ctx: ManagerContext):
        self._ctx = ctx
        self._verifier = Verifier(ctx.store, primary=ctx.primary)

    def restore(self, like: Any, *, stateful: Mapping[str, Any] | None, step: int | None,
                required: bool, items: Mapping[str, Any] | None = None,
                partial: bool = False) -> Recovered | None:
        """Restore ``step`` (None: the latest valid checkpoint, falling back past unusable
        ones), or return None when there is none and it is not ``required``. Call it from
        the manager's public method, with no save in flight (warnings point two frames up).

        ``partial``: ``like`` is a subtree of the saved state; only it is read (and only
        its files checksummed, ``verification.plan``). The stateful objects given are
        restored; the process-global RNGs (Python, NumPy, the backend's) are not: they are
        no part of ``like``, and an evaluation or fine-tuning job keeps its own seeds."""
        ctx = self._ctx
        checks = verification.plan(ctx.recover_config, ctx.backend, items, partial=partial,
                                   processes=ctx.process_count)
        bad: list[Entry] = []
        limit: int | None = None
        ahead = self._read_ahead(checks)
        while True:
            chosen, manifest = self._choose(step, checks, limit, bad, ahead)
            skipped = [f"{item.path}: {item.status}: "
                       + ("; ".join(item.problems) or "no commit marker (interrupted save)")
                       for item in bad]
            if chosen == _FAIL_CLOSED:
                raise self._no_valid_checkpoint(skipped)
            if chosen < 0:
                self._nothing_valid(skipped, bad, required)  # raises when required
                return None
            path = ctx.store.step_path(chosen)
            try:
                body, state, versions, restored_items = self._read_checkpoint(
                    path, like, items, chosen, checks, partial=partial, manifest=manifest,
                    ahead=ahead)
            except DeferredChecksumsFailed as failed:
                # What was read went with the exception; nothing else was touched yet. The
                # same outcome as when these checksums fail up front: an explicit step is an
                # error, a resume falls back (the primary quarantines this one below).
                if step is not None:
                    raise failed.corrupt_error() from None
                if ctx.primary:
                    bad.append(Entry(step=chosen, path=path, status="corrupt",
                                     problems=failed.problems))
                limit = chosen - 1
                continue
            except CheckpointFormatError:
                raise  # newer, not damaged: skipping it would silently drop progress
            except CheckpointCorruptError as exc:
                # Verified files can still fail to decode (altered yet consistent metadata):
                # when resuming, fall back like for any other corrupt checkpoint.
                if step is not None or ctx.process_count > 1:
                    raise
                bad.append(Entry(step=chosen, path=path, status="corrupt", problems=(str(exc),)))
                limit = chosen - 1
                continue
            break
        if skipped:
            warnings.warn(f"resuming from step {chosen}, skipping newer unusable checkpoints: "
                          + " | ".join(skipped), CheckpointWarning, stacklevel=3)
        # Local state only once the arrays are in: never a half-restored loader or RNG.
        local = body.get("local") if ctx.primary else self._read_local(path)
        self._restore_local(local, stateful, path, (body.get("local") or {}).get("stateful"),
                            rngs=not partial)
        self._set_aside(bad)
        step_info = StepInfo.from_json(body["step_info"])
        # Training goes on from the restored step: saves made before it are history, and a
        # later save of an equal step number is new work, not a duplicate.
        ctx.last.clear()
        ctx.restored_step = chosen
        ctx.recover_trigger.mark_saved()
        if ctx.export_trigger is not None:
            ctx.export_trigger.mark_saved()
        return Recovered(state=state, step_info=step_info, path=path,
                         metrics=dict(body.get("metrics") or {}), skipped=tuple(skipped),
                         items=restored_items, item_versions=versions,
                         saved_process_count=int(body.get("process_count", 1)))

    def _nothing_valid(self, skipped: list[str], bad: list[Entry], required: bool) -> None:
        """No checkpoint to restore: warn about the unusable ones, set them aside (a resume
        only), and raise ``CheckpointNotFoundError`` when one was ``required``."""
        ctx = self._ctx
        if skipped:
            warnings.warn("no valid checkpoint to resume from; unusable ones: "
                          + " | ".join(skipped), CheckpointWarning, stacklevel=4)
        if ctx.primary and not required:
            self._set_aside(bad)
        if required:
            raise CheckpointNotFoundError(
                f"no valid recovery checkpoint under {ctx.store.recover_dir}"
                + (f" (unusable: {' | '.join(skipped)})" if skipped else "")
                + ". Train from scratch, or point the manager at the root that holds "
                  "the checkpoints.")
        return None

    def _set_aside(self, bad: Sequence[Entry]) -> None:
        """Unusable checkpoints would collide with the steps about to be (re)done, and
        retention, which counts commit markers, could keep them over new valid ones: move
        them aside (kept for inspection; partial ones are just debris)."""
        for item in bad:
            with contextlib.suppress(OSError):
                if item.status == "partial":
                    self._ctx.store.delete(item.path)
                else:
                    self._ctx.store.quarantine(item.path, item.status)

    def _no_valid_checkpoint(self, skipped: Sequence[str]) -> CheckpointCorruptError:
        """Fail closed: committed checkpoints exist and none can be restored."""
        where = self._ctx.store.recover_dir
        if not self._ctx.primary:
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

    def _read_ahead(self, checks: Verification) -> ReadAhead | None:
        """Where the plan allows it on an object store (a round trip per request; a disk
        is read by the backend itself), the primary's fetches of the state's bulk files,
        started as each candidate's manifest is read (``_choose``)."""
        ctx = self._ctx
        if (not checks.read_ahead or not ctx.primary
                or isinstance(ctx.store.storage, PosixStorage)):
            return None
        return ReadAhead(ctx.store.storage)

    def _choose(self, step: int | None, checks: Verification, limit: int | None,
                bad: list[Entry], ahead: ReadAhead | None = None,
                ) -> tuple[int, Manifest | None]:
        """The step to restore (-1: none), decided by the primary and shared, with the
        manifest the primary verified it by (None elsewhere). Unusable newer checkpoints
        found on the way are appended to ``bad``. Checksums that ``checks.defer_over``
        leaves out are checked later, by ``_read_checkpoint``, against that manifest.
        ``ahead``: started on each candidate's bulk state files as soon as its manifest is
        read; cancelled here unless a step is chosen."""
        try:
            chosen, manifest = self._choose_step(step, checks, limit, bad, ahead)
        except BaseException:
            if ahead is not None:
                ahead.cancel()
            raise
        if chosen < 0 and ahead is not None:
            ahead.cancel()
        return chosen, manifest

    def _choose_step(self, step: int | None, checks: Verification, limit: int | None,
                     bad: list[Entry], ahead: ReadAhead | None,
                     ) -> tuple[int, Manifest | None]:
        ctx = self._ctx
        chosen = -1
        manifest: Manifest | None = None
        on_manifest = None if ahead is None else functools.partial(_fetch_state_ahead, ahead,
                                                                    checks)
        if ctx.primary:
            if step is None:
                while True:
                    entry, newly_bad = ctx.store.latest_valid(
                        checksums=checks.checksums, at_or_before=limit,
                        defer_over=checks.defer_over, on_manifest=on_manifest)
                    bad += newly_bad
                    if entry is None:
                        break
                    problems = self._verifier.item_problems(entry.path, checks)
                    if not problems:
                        chosen, manifest = entry.step, entry.manifest
                        break
                    # A checkpoint whose items are gone or damaged cannot be restored whole.
                    bad.append(dataclasses.replace(entry, status="corrupt",
                                                   problems=tuple(problems)))
                    limit = entry.step - 1
                if (chosen < 0 and ctx.recover_config.on_corrupt == "raise"
                        and any(entry.status != "partial" for entry in bad)):
                    chosen = _FAIL_CLOSED
            else:
                manifest = self._verifier.check_requested_manifest(step, checks,
                                                                   on_manifest=on_manifest)
                chosen = step
                problems = self._verifier.item_problems(ctx.store.step_path(step), checks)
                if problems:
                    raise CheckpointCorruptError(
                        f"checkpoint {ctx.store.step_path(step)} refers to unusable items: "
                        + "; ".join(problems) + ". Restore another step.")
        if ctx.process_count > 1:
            chosen = ctx.backend.broadcast_int(chosen)
        return chosen, manifest

    def _read_checkpoint(self, path: str, like: Any, items: Mapping[str, Any] | None,
                         step: int, checks: Verification, *, partial: bool = False,
                         manifest: Manifest | None = None, ahead: ReadAhead | None = None,
                         ) -> tuple[dict[str, Any], Any, dict[str, int], dict[str, Any]]:
        """Driver, arrays and requested items of one checkpoint, under a reader lock that
        keeps retention away from it.

        With deferred checksums the primary checks them in a thread while this reads, and
        the read is judged only once they are in: when they fail, what was read is dropped
        and ``DeferredChecksumsFailed`` raised, on every process (the primary shares its
        verdict), also when the read itself failed (damaged bytes explain that failure)."""
        with self._ctx.state_lock:
            self._ctx.reading.add(step)
        try:
            with self._ctx.store.reading(path):
                claims = (DeferredChecks(ahead) if checks.defer_over is not None
                          and self._ctx.primary and self._ctx.backend.features.verifies_reads
                          else None)
                checking = self._verifier.start_deferred_checks(path, checks, claims,
                                                                manifest=manifest)
                result: tuple[dict[str, Any], Any, dict[str, int], dict[str, Any]] | None = None
                error: Exception | None = None
                try:
                    body = self._read_driver(path)
                    state = self._read_state(path, like, claims, partial, manifest)
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
                if checks.defer_over is not None and self._ctx.process_count > 1:
                    # Only the primary checked: its verdict is every process's, so that
                    # all of them fall back (or raise) together.
                    failed = self._ctx.backend.broadcast_int(int(failed)) != 0
                if failed:
                    # Let go of every array read (error tracebacks hold some too) before the
                    # next checkpoint is read: two models may not fit in memory.
                    result = error = state = None
                    raise DeferredChecksumsFailed(path, own, item_problems)
                if error is not None:
                    raise error
                assert result is not None
                return self._finish_read(result)
        finally:
            if ahead is not None:
                ahead.cancel()  # what the reader did not take is dropped
            with self._ctx.state_lock:
                self._ctx.reading.discard(step)

    def _read_state(self, path: str, like: Any, claims: DeferredChecks | None, partial: bool,
                    manifest: Manifest | None) -> Any:
        """The backend's read of the state of ``path``; an incremental backend is given the
        checkpoint's references (``Manifest.refs``, verified with its files)."""
        backend = self._ctx.backend
        directory = os.path.join(path, STATE_DIR)
        if not backend.features.incremental:
            return backend.read(directory, like, claims=claims, partial=partial)
        if manifest is None:
            manifest = self._ctx.store.committed_manifest(path)
        refs = manifest.refs or None
        return backend.read(directory, like, claims=claims, partial=partial, references=refs)

    def _finish_read(self, result: tuple[dict[str, Any], Any, dict[str, int], dict[str, Any]],
                     ) -> tuple[dict[str, Any], Any, dict[str, int], dict[str, Any]]:
        """A read judged valid: the backend's ``finish_read`` gets the state and every item
        (values for live objects are put into them in place only now)."""
        finish = self._ctx.backend.finish_read
        body, state, versions, items = result
        return body, finish(state), versions, {name: finish(tree) for name, tree in items.items()}

    def _read_items(self, items: Mapping[str, Any] | None, versions: Mapping[str, int],
                    path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, like in (items or {}).items():
            if name not in versions:
                warnings.warn(f"{path} refers to no version of item {name!r} (saved without it); "
                              f"it is not restored.", CheckpointWarning,
                              stacklevel=5)  # the user's call: past the read and the manager
                continue
            item_dir = self._ctx.store.item_path(name, versions[name])
            with self._ctx.store.reading(item_dir):
                out[name] = self._ctx.backend.read(os.path.join(item_dir, STATE_DIR), like)
        return out

    def _read_driver(self, path: str) -> dict[str, Any]:
        body = drv.read_driver(self._ctx.store, path)
        saved_backend = body.get("backend")
        if saved_backend is not None and saved_backend != self._ctx.backend.name:
            raise CheckpointError(
                f"{path} was written by the {saved_backend!r} backend but this manager uses "
                f"{self._ctx.backend.name!r}. Use the matching manager "
                f"(jaxckpt.CheckpointManager for 'orbax', torch_bridge.DcpCheckpointManager for "
                f"'dcp').")
        saved_count = body.get("process_count", 1)
        if saved_count != self._ctx.process_count:
            warnings.warn(
                f"{path} was saved by {saved_count} process(es) and is restored by "
                f"{self._ctx.process_count}: "
                f"arrays are resharded; each process restores the local state (data-loader "
                f"position, RNG) saved by the process of the same index, and processes with no "
                f"saved counterpart keep their fresh local state; objects with global state "
                f"(jaxckpt.IndexSampler) take the primary's on every process. Check your data "
                f"sharding.",
                CheckpointWarning, stacklevel=5)  # the user's call: past the read and the manager
        return body

    def _read_local(self, path: str) -> dict[str, Any] | None:
        try:
            name = drv.local_filename(self._ctx.process_index)
            return json.loads(self._ctx.store.read_file(path, name))
        except FileNotFoundError:
            return None

    def _restore_local(self, local: Mapping[str, Any] | None,
                       stateful: Mapping[str, Any] | None, path: str,
                       primary: Mapping[str, Any] | None, *, rngs: bool = True) -> None:
        """This process's saved state into its stateful objects, and with ``rngs`` the
        process-global RNGs; objects with global state (an IndexSampler) take the primary's
        copy, also on a process that has no saved counterpart (the run grew)."""
        primary = primary or {}
        if local is None:
            shared = {name: obj for name, obj in (stateful or {}).items()
                      if drv.has_global_state(obj)}
            drv.restore_stateful(shared, {}, path, primary=primary)
            fresh = sorted(set(stateful or {}) - set(shared))
            if fresh:
                warnings.warn(f"{path} has no local state for process {self._ctx.process_index}; "
                              f"stateful objects {fresh} keep their fresh state.",
                              CheckpointWarning, stacklevel=4)
            return
        drv.restore_stateful(stateful, local.get("stateful") or {}, path, primary=primary)
        if not rngs:
            return
        if self._ctx.recover_config.restore_global_rng:
            drv.restore_global_rng(local.get("rng") or {}, path)
        backend_rng = local.get("backend_rng")
        if backend_rng is not None:
            from jaxckpt.core import codec

            self._ctx.backend.set_rng_state(codec.decode(backend_rng, "backend_rng"))
