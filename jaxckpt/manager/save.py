"""One recovery save, from the snapshot on the training thread to the committed marker and
retention on the background thread.

Owns: ``Saver``: snapshotting the driver state, making room for a step already on
disk, starting the driver file's and the backend's writes (``save``: its time is
``report.blocking_s``), committing each new item version and then the checkpoint (the
``done.p{i}`` handshake across processes), retention of checkpoints and items, and the
once-per-manager warning about what a save leaves out (docs/architecture.md, Walk 1).

Must not import: jax, orbax, torch, or the restore and export parts; the thread and the
error propagation are ``background.SavePipeline``'s.

Concurrency: ``save`` and ``warn_left_out`` on the training thread; commit, retention and
cleanup on the pipeline's thread (inline in sync mode), shared context fields under its
``state_lock``. Only the primary writes the driver, commits and deletes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
import types
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any

from jaxckpt.backends.base import IncrementalBase
from jaxckpt.commit.store import CheckpointStore, write_file_soon
from jaxckpt.config import Every, StepInfo, Versioned, check_item_name, item_version
from jaxckpt.core.layout import DRIVER_FILE, STATE_DIR, parse_step_dirname
from jaxckpt.core.retention import CheckpointFacts, RetentionRules, decide
from jaxckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointWarning, ConfigError
from jaxckpt.manager import driver_state as drv
from jaxckpt.manager.background import SavePipeline
from jaxckpt.manager.context import ManagerContext
from jaxckpt.manager.export import ExportRecord
from jaxckpt.manager.reports import SaveReport, mark_done

__all__ = ["Saver", "resolve_state", "known_checksums", "known_references",
           "durable_dirs", "incremental_base"]

log = logging.getLogger("jaxckpt")


class Saver:
    """Writes, commits and retains the recovery checkpoints of one manager."""

    def __init__(self, ctx: ManagerContext, pipeline: SavePipeline, *, mode: str,
                 item_cadences: Mapping[str, Every], export_record: ExportRecord | None,
                 tier: str = "durable"):
        self._ctx = ctx
        self._tier = tier  # "durable" or "local" (manager.local_tier), named on every report
        self._pipeline = pipeline
        self._mode = mode  # the manager's save mode ("sync" or "async")
        self._item_cadences = dict(item_cadences)
        self._export_record = export_record  # recorded in every driver.json (see exports)
        self.scope_checked = False  # see warn_left_out
        # Metrics of committed checkpoints by step, for retention's "best" rule (background
        # thread only). A step saved again (after a restore) is dropped in _make_room.
        self._metrics_cache: dict[int, dict[str, Any] | None] = {}

    def warn_left_out(self, state: Any, items: Mapping[str, Any] | None, caller: Any) -> None:
        """Once per manager, at its first recovery save: warn when the calling code's local
        variables hold framework objects whose state this save leaves out (e.g. an
        ``nnx.Rngs`` or metrics beside a saved model). The backend judges
        (``Backend.left_out(saved, scope)``; None when it has nothing to say); a diagnostic
        never fails a save. Call it from the
        public method the user called: the warning points at the caller's caller."""
        self.scope_checked = True
        judge = self._ctx.backend.left_out
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

    def save(self, step: StepInfo, state: Any, stateful: Mapping[str, Any] | None,
             metrics: Mapping[str, Any] | None, reason: str,
             mode: str | None = None, *, items: Mapping[str, Any] | None = None,
             epoch_end: bool = False) -> SaveReport:
        """Save a recovery checkpoint of ``step``; returns once the arrays are staged (sync:
        once committed). Call it from the manager's public method (warnings point two
        frames up)."""
        ctx = self._ctx
        start = time.perf_counter()
        mode = mode or self._mode
        last = ctx.last.get("recover")
        if last is not None and last.step == step.global_step and last.error is None:
            # This step is saved or being saved already (e.g. the final save after a loop
            # whose last maybe_save saved it): never written twice, but a sync save still
            # returns only once it committed and its retention ran, whichever call started it.
            if mode == "sync":
                self._pipeline.drain()
                self._pipeline.raise_unraised(stacklevel=4)
            return last
        if ctx.restored_step == step.global_step:
            existing = self._already_committed(step.global_step, mode, reason)
            if existing is not None:
                return existing
        state = resolve_state(state)  # a function: only now that this save happens
        self._pipeline.drain()
        self._pipeline.raise_unraised(stacklevel=4)  # the user's call, past the manager
        path = ctx.store.step_path(step.global_step)
        item_versions = self._item_versions(items, step, epoch_end)
        stateful = ctx.default_stateful if stateful is None else stateful
        driver_file, driver_bytes = self._snapshot(step, stateful, metrics, reason,
                                                   item_versions, state)
        if ctx.primary:
            self._make_room(path)
        ctx.barrier(f"jaxckpt.save.{step.global_step}", 600.0)
        report = SaveReport(kind="recover", step=step.global_step, path=path, mode=mode,
                            reason=reason, tier=self._tier)
        ctx.recover_trigger.mark_saved()
        try:
            handle, item_writes, driver_sent = self._start_writes(
                path, state, item_versions, mode, (driver_file, driver_bytes))
        except (CheckpointError, TypeError):
            raise  # bad input (a tree the backend refuses): the caller's to fix, not a write
            # failure
        except Exception as exc:  # the filesystem failed under the training thread
            return self._pipeline.failed_to_start(
                report, exc, start, functools.partial(self._discard_partial, path))
        report.blocking_s = time.perf_counter() - start
        ctx.last["recover"] = report

        def finish() -> None:
            # The primary's driver.json was written durably from these bytes: the commit
            # takes its entry instead of reading it back.
            driver_entry = {driver_file: driver_sent.result()} if ctx.primary else {}
            item_bytes = 0
            for name, version, item_dir, item_handle in item_writes:
                item_handle.wait()
                item_bytes += self._commit_dir(item_dir, version, known_checksums(item_handle),
                                               durable=durable_dirs(item_handle))
                with ctx.state_lock:
                    ctx.written_items.setdefault(name, set()).add(version)
            handle.wait()
            self._commit(path, step.global_step, report,
                         {**(known_checksums(handle) or {}), **driver_entry} or None,
                         known_references(handle) if ctx.recover_config.incremental else None,
                         durable=durable_dirs(handle))
            if report.bytes is not None:
                report.bytes += item_bytes

        self._pipeline.run(report, finish, start,
                           after=self.apply_retention if ctx.primary else None,
                           on_failure=lambda: self._discard_partial(path))
        return report

    def _snapshot(self, step: StepInfo, stateful: Mapping[str, Any] | None,
                  metrics: Mapping[str, Any] | None, reason: str,
                  item_versions: dict[str, tuple[int, Any]], state: Any) -> tuple[str, bytes]:
        """Training thread: everything mutable of the driver state, as the name and bytes of
        this process's driver file (the primary's driver.json, another's local file)."""
        ctx = self._ctx
        # Snapshot everything mutable now, on the training thread: the loop moves on at once.
        local = drv.build_local(
            process_index=ctx.process_index,
            stateful_state=drv.capture_stateful(stateful),
            rng=drv.capture_global_rng() if ctx.recover_config.restore_global_rng else None,
            backend_rng=ctx.backend.rng_state())
        saved_at = time.time()
        if not ctx.primary:
            return drv.local_filename(ctx.process_index), json.dumps(local).encode()
        body = drv.build_driver(
            kind="recover", reason=reason, step=step, backend_name=ctx.backend.name,
            backend_versions=ctx.backend.versions(), process_count=ctx.process_count,
            metrics=metrics, local=local, saved_at=saved_at)
        body["items"] = {name: {"version": v} for name, (v, _) in item_versions.items()}
        record = None if self._export_record is None else self._export_record(state)
        if record is not None:
            body["export"] = record
        # The rules, so `jaxckpt ls` can say why each checkpoint is kept without the config.
        body["retention"] = RetentionRules.of(ctx.recover_config).to_json()
        if ctx.recover_config.incremental:
            body["incremental"] = True  # what `jaxckpt ls` says of a root's saves
        # Compact separators keep json on its C encoder (indent= switches to the Python
        # one, a visible share of the blocking time with RNG states inside).
        return DRIVER_FILE, json.dumps(body, separators=(",", ":")).encode()

    def _start_writes(self, path: str, state: Any, item_versions: dict[str, tuple[int, Any]],
                      mode: str, driver: tuple[str, bytes],
                      ) -> tuple[Any, list[tuple[str, int, str, Any]], Future[dict[str, Any]]]:
        """Training thread: create the directories, start the driver file's write (it goes
        up while the arrays do: on an object store a sync save's data no longer waits for
        its round trip) and stage every write of one save. On a failure the driver file's
        write is waited for, and the file of a refused tree removed, before raising."""
        ctx = self._ctx
        ctx.store.storage.make_prefix(path)
        driver_sent = write_file_soon(ctx.store, path, *driver)
        try:
            handle, item_writes = self._start_array_writes(path, state, item_versions, mode)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                driver_sent.result()
                if isinstance(exc, (CheckpointError, TypeError)):  # nothing else was written
                    ctx.store.storage.delete(os.path.join(path, driver[0]))
            raise
        return handle, item_writes, driver_sent

    def _start_array_writes(self, path: str, state: Any,
                            item_versions: dict[str, tuple[int, Any]],
                            mode: str) -> tuple[Any, list[tuple[str, int, str, Any]]]:
        ctx = self._ctx
        # Item versions no checkpoint has written yet go first; the backend serialises writes,
        # so this costs time only on saves where an item changed.
        item_writes: list[tuple[str, int, str, Any]] = []
        with ctx.state_lock:
            written = {name: set(v) for name, v in ctx.written_items.items()}
        for name, (version, tree) in item_versions.items():
            if version in written.get(name, set()):
                continue
            item_dir = ctx.store.item_path(name, version)
            if ctx.primary and ctx.store.storage.is_prefix(item_dir):
                ctx.store.delete(item_dir)  # an uncommitted attempt at this version
            ctx.barrier(f"jaxckpt.item.{name}.{version}", 600.0)
            ctx.store.storage.make_prefix(item_dir)
            item_writes.append((name, version, item_dir, ctx.backend.write(
                os.path.join(item_dir, STATE_DIR), tree, asynchronous=mode == "async")))
        directory = os.path.join(path, STATE_DIR)
        if not ctx.recover_config.incremental:
            # Only an incremental backend is ever given ``base`` (a backend written before
            # the keyword existed keeps working).
            return ctx.backend.write(directory, state, asynchronous=mode == "async"), item_writes
        handle = ctx.backend.write(directory, state, asynchronous=mode == "async",
                                   base=incremental_base(ctx.store, path))
        return handle, item_writes

    def _discard_partial(self, path: str) -> None:
        """Primary, background: remove what a failed save left (frees a full disk)."""
        if not self._ctx.primary or self._ctx.store.is_committed(path):
            return
        with contextlib.suppress(OSError):
            self._ctx.store.delete(path)

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
                out[name] = (item_version(self._item_cadences[name], step, epoch_end=epoch_end),
                             value)
            else:
                raise ConfigError(
                    f"items[{name!r}] has no version: declare its cadence with "
                    f"CheckpointManager(items={{{name!r}: Every(steps=K)}}) or pass "
                    f"jaxckpt.Versioned(version, tree).")
        return out

    def _already_committed(self, step: int, mode: str, reason: str) -> SaveReport | None:
        """A done report for the checkpoint just restored, which a save of the same step
        (e.g. the final save of a run that resumed with nothing left to do) must not redo."""
        path = self._ctx.store.step_path(step)
        try:
            manifest = self._ctx.store.read_manifest(path)
        except CheckpointCorruptError:
            return None
        if manifest is None:
            return None
        report = SaveReport(kind="recover", step=step, path=path, mode=mode, reason=reason,
                            tier=self._tier)
        report.total_s, report.bytes = 0.0, manifest.total_bytes
        mark_done(report)
        self._ctx.last["recover"] = report
        return report

    def _make_room(self, path: str) -> None:
        """Primary: a directory already at this step's name is moved aside (committed: it
        belongs to a discarded future, e.g. after restoring an older step) or removed.
        Called from ``save`` only (its warning points at the user's call)."""
        if not self._ctx.store.storage.is_prefix(path):
            return
        self._metrics_cache.clear()  # rare: a step written again; forget what was read
        if self._ctx.store.is_committed(path):
            moved = self._ctx.store.quarantine(path, "superseded")
            warnings.warn(f"{path} already held a committed checkpoint from an earlier attempt "
                          f"at this step; it was moved to {moved} and is being replaced.",
                          CheckpointWarning, stacklevel=4)
        else:
            self._ctx.store.delete(path)

    def _commit(self, path: str, step: int, report: SaveReport,
                known: dict[str, dict[str, Any]] | None = None,
                refs: dict[str, dict[str, Any]] | None = None, *,
                durable: tuple[str, ...] = ()) -> None:
        """Background: every process's writes are done -> marker (sizes on the report)."""
        written = self._commit_dir(path, step, known, refs, durable=durable)
        report.bytes = written if self._ctx.primary else None

    def _commit_dir(self, path: str, step: int,
                    known: dict[str, dict[str, Any]] | None = None,
                    refs: dict[str, dict[str, Any]] | None = None, *,
                    durable: tuple[str, ...] = ()) -> int:
        """Once every process finished writing ``path``, the primary commits it. Returns the
        bytes committed (0 on other processes, which wait until the marker exists).
        ``known``: checksums the backend computed while writing (``known_checksums``);
        ``refs``: files of earlier checkpoints it referred to (``WriteHandle.references``);
        ``durable``: directories whose names the primary's write made durable
        (``durable_dirs``; another process's write syncs nothing of the primary's)."""
        ctx = self._ctx
        if ctx.process_count > 1:
            # The primary checksums what the others wrote without reading it back: their
            # writers' checksums (and refs) travel in their done markers.
            ctx.store.mark_done(path, ctx.process_index, None if ctx.primary else known,
                                refs=None if ctx.primary else refs)
        if not ctx.primary:
            self._pipeline.wait_for(lambda: ctx.store.is_committed(path),
                                    f"the primary process to commit {path}")
            return 0
        if ctx.process_count > 1:
            self._pipeline.wait_for(
                lambda: ctx.store.all_done(path, ctx.process_count),
                f"all {ctx.process_count} processes to finish writing {path}")
            known = {**ctx.store.done_checksums(path, ctx.process_count), **(known or {})}
            refs = ctx.store.done_refs(path, ctx.process_count, refs)
        durable = durable if ctx.process_count == 1 else ()
        return ctx.store.commit(path, step, known=known or None, refs=refs,
                                durable_dirs=durable).total_bytes

    def apply_retention(self) -> None:
        """Primary, background: delete the checkpoints no retention rule keeps (see
        ``jaxckpt.core.retention``: never the newest, a pinned one or one being restored), then
        the item versions nothing refers to."""
        ctx = self._ctx
        pins = ctx.pins
        with pins.lock if pins is not None else contextlib.nullcontext():
            try:
                pinned = pins.read() if pins is not None else set()
            except CheckpointCorruptError as exc:
                warnings.warn(f"retention deleted nothing: {exc}", CheckpointWarning,
                              stacklevel=2)
                return
            with ctx.state_lock:
                reading = set(ctx.reading)
            rules = RetentionRules.of(ctx.recover_config)
            committed = ctx.store.committed_steps()
            self._metrics_cache = {s: m for s, m in self._metrics_cache.items() if s in committed}
            facts = [CheckpointFacts(step=step, metrics=self._metrics_of(step, rules),
                                     pinned=step in pinned, reading=step in reading)
                     for step in committed]
            for verdict in decide(facts, rules):
                if not verdict.keep:
                    self._delete_quietly(ctx.store.step_path(verdict.step))
        self._prune_items()

    def _metrics_of(self, step: int, rules: RetentionRules) -> dict[str, Any] | None:
        """The metrics saved with ``step`` (only read when a rule needs them; cached, since
        a committed checkpoint never changes). None when they cannot be read: the checkpoint
        is then not eligible for "best", and nothing fails."""
        if rules.keep_best is None:
            return None
        if step not in self._metrics_cache:
            try:
                body = drv.read_driver(self._ctx.store, self._ctx.store.step_path(step))
                metrics = body.get("metrics")
                self._metrics_cache[step] = metrics if isinstance(metrics, dict) else None
            except (OSError, CheckpointError):
                return None  # not cached: a transient read error is retried next time
        return self._metrics_cache[step]

    def _prune_items(self) -> None:
        """Delete item versions that no committed checkpoint refers to any more (the newest
        version of each item is always kept: the next checkpoint may refer to it)."""
        ctx = self._ctx
        names = ctx.store.item_names()
        if not names:
            return
        referenced: dict[str, set[int]] = {name: set() for name in names}
        for step in ctx.store.committed_steps():
            try:
                driver = ctx.store.read_file(ctx.store.step_path(step), DRIVER_FILE)
                refs = json.loads(driver).get("items") or {}
            except (OSError, ValueError):
                return  # cannot tell what is referenced: keep everything this time
            for name, ref in refs.items():
                referenced.setdefault(name, set()).add(int(ref.get("version", -1)))
        for name in names:
            versions = ctx.store.item_versions(name)
            for version in versions[:-1]:
                if version not in referenced.get(name, set()):
                    if self._delete_quietly(ctx.store.item_path(name, version)):
                        with ctx.state_lock:
                            ctx.written_items.get(name, set()).discard(version)

    def _delete_quietly(self, path: str) -> bool:
        try:
            if self._ctx.store.delete(path):
                return True
            log.info("jaxckpt: %s is being read; deleting it later", path)
        except OSError as exc:  # never let housekeeping stop training
            warnings.warn(f"retention could not delete {path}: {exc}; it will be retried "
                          f"after the next save.", CheckpointWarning, stacklevel=3)
        return False


def resolve_state(state: Any) -> Any:
    """``state``, or what it returns when it is a plain function (lambda, def, bound
    method, functools.partial). Only those: a function is never an array state itself,
    while pytree containers and modules with ``__call__`` are."""
    if isinstance(state, (types.FunctionType, types.MethodType, functools.partial)):
        return state()
    return state


def known_checksums(handle: Any) -> dict[str, dict[str, Any]] | None:
    """Manifest entries a backend's write handle offers for the files it wrote (its
    ``checksums``, None when it computed none: by path relative to the directory it wrote,
    ``STATE_DIR``), as paths relative to the checkpoint; the commit then does not read those
    files back."""
    try:
        entries = handle.checksums
    except AttributeError:
        raise TypeError(
            f"the backend's write handle {type(handle).__name__} has no `checksums` member; "
            f"jaxckpt.backends.base.WriteHandle requires one (None when the backend computed no "
            f"checksums, so the commit computes them).") from None
    if not entries:
        return None
    return {f"{STATE_DIR}/{rel}": info for rel, info in entries.items()}


def durable_dirs(handle: Any) -> tuple[str, ...]:
    """Directories whose names a backend's write made durable itself (an optional member
    of a write handle, ``durable_dirs``: paths relative to the directory it wrote), as
    paths relative to the checkpoint; the commit syncs the others. A handle without the
    member: none (the commit syncs every directory)."""
    return tuple(f"{STATE_DIR}/{rel}" for rel in getattr(handle, "durable_dirs", ()) or ())


def known_references(handle: Any) -> dict[str, dict[str, Any]] | None:
    """The files of earlier checkpoints a write given a base used instead of writing them
    (its handle's ``references``: ``{key relative to recover/: entry}``), or None. Asked only
    of writes given a base: handles of other writes need not have the member."""
    refs = handle.references
    return dict(refs) if refs else None


def incremental_base(store: CheckpointStore, path: str) -> IncrementalBase:
    """What the save into ``path`` may refer to: the newest committed checkpoint of an
    earlier step, with its files and those it refers to that are still there with their
    size (``store.incremental_files``, listed lazily: by the backend's write thread when it
    first asks, not by the training loop). None committed yet: a base with no files, on
    which the backend refers to nothing but records the content hashes the next save
    compares."""
    step = parse_step_dirname(os.path.basename(path.rstrip("/")))
    earlier = [s for s in store.committed_steps() if step is None or s < step]
    if not earlier:
        return IncrementalBase(step=-1, directory="", recover_dir=store.recover_dir, files={})
    base_path = store.step_path(earlier[-1])
    return IncrementalBase(step=earlier[-1], directory=os.path.join(base_path, STATE_DIR),
                           recover_dir=store.recover_dir,
                           files=_ListedOnDemand(store, base_path))


class _ListedOnDemand(Mapping[str, Mapping[str, Any]]):
    """``store.incremental_files(path)``, listed on first use (from any thread, once). A
    listing that fails counts as empty: the save then writes everything again."""

    def __init__(self, store: CheckpointStore, path: str):
        self._store, self._path = store, path
        self._lock = threading.Lock()
        self._files: dict[str, Mapping[str, Any]] | None = None

    def _listed(self) -> dict[str, Mapping[str, Any]]:
        with self._lock:
            if self._files is None:
                try:
                    self._files = dict(self._store.incremental_files(self._path))
                except (OSError, CheckpointError) as exc:
                    log.info("jaxckpt: %s cannot be listed (%s); writing everything", self._path,
                             exc)
                    self._files = {}
            return self._files

    def __getitem__(self, key: str) -> Mapping[str, Any]:
        return self._listed()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._listed())

    def __len__(self) -> int:
        return len(self._listed())
