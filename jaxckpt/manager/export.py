"""Exports: model-only copies of the state written by the user's exporter, and their retention.

Owns: ``Exporter``: one export (a host copy where needed, by ``exporter.stage`` when the
exporter has one, ``exporter(state, tmp_dir)``, then the move to
``export/epoch{E}epochstep{S}globalstep{G}``), their retention (``keep_last_n`` of
``ExportConfig``), and ``export_record``, what ``driver.json`` says of the exporter (fixed, or
made per save from the state).

Must not import: jax, orbax, torch, or the restore and save parts; the thread and the error
propagation are the ``SavePipeline``'s.

Concurrency: ``save`` on the training thread (the host copy is a collective); the exporter,
the move and retention on the background thread (inline in sync mode), primary only.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

from jaxckpt.config import ExportConfig, StepInfo
from jaxckpt.core.layout import export_dirname
from jaxckpt.core.policy import steps_to_delete
from jaxckpt.errors import CheckpointWarning, ConfigError
from jaxckpt.manager.background import SavePipeline
from jaxckpt.manager.context import ManagerContext
from jaxckpt.manager.reports import SaveReport

__all__ = ["Exporter", "ExportRecord", "export_record"]


class Exporter:
    """Writes and retains the exports of one manager (one with an ``ExportConfig``)."""

    def __init__(self, ctx: ManagerContext, pipeline: SavePipeline, *, mode: str):
        assert ctx.export_config is not None and ctx.export_trigger is not None
        self._ctx = ctx
        self._pipeline = pipeline
        self._mode = mode  # ExportConfig.mode, resolved: "sync" or "async"

    def save(self, step: StepInfo, state: Any, reason: str) -> SaveReport:
        """Export ``state`` at ``step``; returns once the state may change again."""
        ctx = self._ctx
        start = time.perf_counter()
        last = ctx.last.get("export")
        if last is not None and last.step == step.global_step and last.error is None:
            return last
        self._pipeline.drain()
        self._pipeline.raise_unraised(stacklevel=4)  # the user's call, past the manager
        config = ctx.export_config
        assert config is not None and ctx.export_trigger is not None
        name = export_dirname(step.epoch, step.epoch_step, step.global_step)
        final = os.path.join(ctx.store.export_dir, name)
        report = SaveReport(kind="export", step=step.global_step, path=final,
                            mode=self._mode, reason=reason)
        ctx.export_trigger.mark_saved()
        # Async exports run from a host copy so training may update the arrays meanwhile; in
        # multi-process runs the copy also gathers the shards (a collective every process
        # joins), since only the primary writes the export.
        needs_copy = (report.mode == "async" or ctx.process_count > 1
                      or ctx.backend.features.export_needs_copy)
        exporter = config.exporter
        assert exporter is not None  # ExportConfig refuses None
        # An exporter with its own ``stage(state, copy=...)`` (torch_bridge's HF exporter of
        # torch models) makes the copy itself: it keeps what the write needs besides the
        # tensors (the model's config) and drops what it does not (optimizers).
        stage = getattr(exporter, "stage", None)
        if callable(stage):
            source = stage(state, copy=needs_copy)
        else:
            source = ctx.backend.host_copy(state) if needs_copy else state
        report.blocking_s = time.perf_counter() - start
        ctx.last["export"] = report

        def finish() -> None:
            if not ctx.primary:
                return
            tmp = ctx.store.export_tmp_path(name)
            ctx.store.storage.make_prefix(tmp)
            written = exporter(source, tmp)
            # Replaces an export of this step from a discarded attempt, if there is one.
            ctx.store.publish_export(tmp, final)
            report.bytes = written if isinstance(written, int) else ctx.store.size_of(final)

        self._pipeline.run(report, finish, start,
                           after=self.apply_retention if ctx.primary else None)
        return report

    def apply_retention(self) -> None:
        """Primary, background: delete the exports ``ExportConfig.keep_last_n`` no longer
        keeps; a failed delete is a warning, never an error."""
        config = self._ctx.export_config
        assert config is not None
        entries = self._ctx.store.export_entries()
        victims = set(steps_to_delete([s for s, _ in entries], config.keep_last_n))
        for step, path in entries:
            if step in victims:
                try:
                    self._ctx.store.delete_export(path)
                except OSError as exc:
                    warnings.warn(f"retention could not delete export {path}: {exc}",
                                  CheckpointWarning, stacklevel=2)


ExportRecord = Callable[[Any], "dict[str, Any] | None"]
"""``record(state)``: what driver.json says of the exporter at one save (see ``export_record``)."""


def export_record(export: ExportConfig | None) -> ExportRecord | None:
    """What the exporter says about itself, recorded in every recovery checkpoint's
    driver.json under "export" so a checkpoint can be exported later without being told how
    (``jaxckpt export-hf``): ``exporter.checkpoint_metadata`` (the same for every save, e.g.
    the HF arch and config; checked now), else ``exporter.checkpoint_record(state)`` (made
    at each save from the state saved, e.g. a torch model's own config). Returns
    ``record(state)``, or None when the exporter records nothing."""
    exporter = export.exporter if export else None
    fixed = getattr(exporter, "checkpoint_metadata", None)
    if fixed is not None:
        document = _json_safe(fixed, "checkpoint_metadata")
        return lambda state: document
    per_save = getattr(exporter, "checkpoint_record", None)
    if not callable(per_save):
        return None

    def record(state: Any) -> dict[str, Any] | None:
        # A diagnostic never fails a recovery save: the export reports its own errors.
        try:
            found = per_save(state)
            return None if found is None else _json_safe(found, "checkpoint_record(state)")
        except Exception as exc:
            warnings.warn(f"the exporter's checkpoint_record failed ({exc}); this checkpoint "
                          f"records no export settings (export-hf then needs --config).",
                          CheckpointWarning, stacklevel=2)
            return None

    return record


def _json_safe(record: Any, what: str) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(dict(record)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"ExportConfig.exporter.{what} must be a JSON-safe dict, got "
                          f"{type(record).__name__}: {exc}") from None
