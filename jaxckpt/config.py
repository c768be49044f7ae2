"""User-facing configuration: triggers, step counters, recovery and export settings.

Owns: the frozen, validated config dataclasses of the public API (``Every``, ``StepInfo``,
``RecoverConfig``, ``ExportConfig``, ``LocalTier``) and the literal types of their modes.
Validation happens once, in ``__post_init__``, and never rewrites another field.

Must not import: jax, orbax, torch (this module is part of the pure layer).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from .errors import ConfigError

__all__ = [
    "Every",
    "Versioned",
    "StepInfo",
    "KeepBest",
    "RecoverConfig",
    "ExportConfig",
    "LocalTier",
    "SaveMode",
    "RecoverMode",
    "SAVE_MODES",
    "RECOVER_MODES",
]

SaveMode = Literal["sync", "async", "auto"]
RecoverMode = Literal["on", "auto", "off", "disabled"]
SAVE_MODES: tuple[str, ...] = ("sync", "async", "auto")
RECOVER_MODES: tuple[str, ...] = ("on", "auto", "off", "disabled")


def _check_positive_int(owner: str, name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"{owner}.{name} must be a positive int or None, got {value!r}. "
            f"Use None to disable this trigger."
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Every:
    """Any-of trigger: a save is due when ANY set condition holds. All None means never.

    Example: ``Every(steps=1000, seconds=3600)``: every 1000 steps or every hour.

    Args:
        steps: due after every ``steps`` completed global steps; None: no step trigger.
        epochs: due at the end of every ``epochs``-th epoch; None: no epoch trigger.
        seconds: due once this many seconds passed since the last save of this kind.
    """

    steps: int | None = None
    """Due after every ``steps`` completed global steps (``(global_step + 1) % steps == 0``)."""
    epochs: int | None = None
    """Due at the end of every ``epochs``-th epoch (``epoch_end`` and
    ``(epoch + 1) % epochs == 0``)."""
    seconds: float | None = None
    """Due when this many seconds (monotonic clock) passed since the last save of this kind."""

    def __post_init__(self) -> None:
        _check_positive_int("Every", "steps", self.steps)
        _check_positive_int("Every", "epochs", self.epochs)
        if self.seconds is not None:
            ok = (not isinstance(self.seconds, bool) and isinstance(self.seconds, (int, float))
                  and math.isfinite(self.seconds) and self.seconds > 0)
            if not ok:
                raise ConfigError(
                    f"Every.seconds must be a positive finite number or None, got "
                    f"{self.seconds!r}. Use None to disable the time trigger."
                )

    @property
    def never(self) -> bool:
        """True when no condition is set."""
        return self.steps is None and self.epochs is None and self.seconds is None


@dataclasses.dataclass(frozen=True, slots=True)
class StepInfo:
    """Where a training loop is: 0-based indices of the step that just completed.

    ``maybe_save(step_info, ...)`` is called after step ``step_info`` completed; ``recover``
    returns the StepInfo of the last saved step, and training resumes at ``.next()``.

    Args:
        epoch: 0-based epoch index.
        epoch_step: 0-based index of the step within its epoch.
        global_step: 0-based index of the step over the whole run.
        steps_per_epoch: steps in one epoch; None when unknown.
        tokens_seen: (keyword) tokens or samples consumed up to and including this step.
        counters: (keyword) further user counters (JSON numbers), saved with the step.
    """

    epoch: int = 0
    """0-based epoch index."""
    epoch_step: int = 0
    """0-based index of the step within its epoch."""
    global_step: int = 0
    """0-based index of the step over the whole run."""
    steps_per_epoch: int | None = None
    """Steps in one epoch; None when unknown (then epoch ends must be signalled explicitly)."""
    _: dataclasses.KW_ONLY
    tokens_seen: int = 0
    """Tokens (or samples) consumed up to and including this step."""
    counters: Mapping[str, int | float] = dataclasses.field(default_factory=dict)
    """Any further user counters (JSON numbers), saved and restored with the step."""

    def __post_init__(self) -> None:
        # A private copy: the caller's dict may change after this step was recorded.
        object.__setattr__(self, "counters", dict(self.counters or {}))
        for name in ("epoch", "epoch_step", "global_step", "tokens_seen"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"StepInfo.{name} must be an int >= 0, got {value!r}.")
        spe = self.steps_per_epoch
        if spe is not None:
            if isinstance(spe, bool) or not isinstance(spe, int) or spe <= 0:
                raise ConfigError(
                    f"StepInfo.steps_per_epoch must be a positive int or None, got {spe!r}.")
            if self.epoch_step >= spe:
                raise ConfigError(
                    f"StepInfo.epoch_step={self.epoch_step} must be < steps_per_epoch={spe}.")
        for key, value in self.counters.items():
            if (not isinstance(key, str) or isinstance(value, bool)
                    or not isinstance(value, (int, float))):
                raise ConfigError(
                    f"StepInfo.counters[{key!r}] must map str to int or float, got {value!r}.")

    def __hash__(self) -> int:
        return hash((self.epoch, self.epoch_step, self.global_step, self.steps_per_epoch,
                     self.tokens_seen, tuple(sorted(self.counters.items()))))

    @property
    def is_epoch_end(self) -> bool:
        """True when this is the last step of its epoch (known only with steps_per_epoch)."""
        return self.steps_per_epoch is not None and self.epoch_step + 1 == self.steps_per_epoch

    def next(self, *, tokens: int = 0) -> StepInfo:
        """The StepInfo of the following step (rolls over to a new epoch at the epoch end)."""
        if self.is_epoch_end:
            epoch, epoch_step = self.epoch + 1, 0
        else:
            epoch, epoch_step = self.epoch, self.epoch_step + 1
        return StepInfo(epoch, epoch_step, self.global_step + 1, self.steps_per_epoch,
                        tokens_seen=self.tokens_seen + tokens, counters=self.counters)

    def replace(self, **changes: Any) -> StepInfo:
        """A copy with some fields changed (e.g. ``counters``)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "epoch_step": self.epoch_step,
            "global_step": self.global_step,
            "steps_per_epoch": self.steps_per_epoch,
            "tokens_seen": self.tokens_seen,
            "counters": dict(self.counters),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepInfo:
        # tokens_seen and counters were added after the first format: optional on read.
        return cls(int(data["epoch"]), int(data["epoch_step"]), int(data["global_step"]),
                   data.get("steps_per_epoch"), tokens_seen=int(data.get("tokens_seen", 0)),
                   counters=data.get("counters") or {})


@dataclasses.dataclass(frozen=True, slots=True)
class Versioned:
    """An auxiliary item (e.g. a GRPO reference policy) tagged with its version.

    Pass it in ``items=`` of ``maybe_save``/``save``: a version is written once, the first
    time a recovery checkpoint needs it, and every later checkpoint only refers to it.

    Args:
        version: an int >= 0 that increases whenever the item changes.
        tree: the item's arrays, in the backend's state format.
    """

    version: int
    """Increases whenever the item changes (e.g. the number of reference updates so far)."""
    tree: Any
    """The item's arrays, in the backend's state format."""

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ConfigError(f"Versioned.version must be an int >= 0, got {self.version!r}.")


def item_version(every: Every, step: StepInfo, *, epoch_end: bool) -> int:
    """The version an item updated on ``every``'s cadence has after ``step``: the number of
    updates completed so far, derived from the counters so a resumed run numbers them alike."""
    if every.steps is not None:
        return (step.global_step + 1) // every.steps
    assert every.epochs is not None
    completed_epochs = step.epoch + (1 if epoch_end else 0)
    return completed_epochs // every.epochs


_ITEM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_item_name(name: Any) -> None:
    """An item name becomes a directory name: letters, digits, '_', '.', '-'."""
    if not isinstance(name, str) or not _ITEM_NAME.match(name):
        raise ConfigError(f"items[{name!r}]: an item name must be 1-128 letters, digits, '_', "
                          f"'.' or '-' starting with a letter or digit (it names a directory).")


def check_item_cadences(items: Mapping[str, Any], recover: RecoverConfig) -> None:
    """Reject item cadences a resumed run could not reproduce, naming both settings."""
    for name, every in items.items():
        where = f"items[{name!r}]"
        check_item_name(name)
        if not isinstance(every, Every):
            raise ConfigError(f"{where} must be a jaxckpt.Every giving how often the item changes, "
                              f"got {every!r}. Write items={{{name!r}: Every(steps=100)}}.")
        if every.seconds is not None or every.never or (every.steps and every.epochs):
            raise ConfigError(
                f"{where}={every} is inconsistent with RecoverConfig.every={recover.every}: an "
                f"item's version is derived from the step counters, so it must change on exactly "
                f"one of steps=N or epochs=N (never on seconds: a resumed run would number its "
                f"versions differently than the checkpoints it resumes from). Use e.g. "
                f"Every(steps=...) matching how often you update the item, or pass "
                f"jaxckpt.Versioned(version, tree) yourself and leave it out of items=.")


def _check_keep_last_n(owner: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"{owner}.keep_last_n must be None (keep all), 0 (no intermediate checkpoints) or a "
            f"positive int N (keep the latest N), got {value!r}."
        )


def _check_every(owner: str, value: Any) -> None:
    if not isinstance(value, Every):
        raise ConfigError(
            f"{owner}.every must be a jaxckpt.Every, got {type(value).__name__} {value!r}. "
            f"Write e.g. every=jaxckpt.Every(steps=100, seconds=600)."
        )


def _check_mode(owner: str, field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{owner}.{field} must be one of {allowed}, got {value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KeepBest:
    """Retention rule: keep the ``n`` checkpoints with the best value of one metric.

    The metric is the one given to ``maybe_save(..., metrics={metric: value})`` and stored in
    the checkpoint's ``driver.json``. A checkpoint without it (or with a value that is not a
    finite number) is not eligible; of equal values the newer step ranks first.

    Args:
        metric: the metric's name, a key of ``metrics=``.
        mode: "min" (lower is better, a loss) or "max" (higher is better).
        n: how many of the best checkpoints to keep.
    """

    metric: str
    """The name of the metric, a key of ``metrics=``."""
    mode: Literal["min", "max"] = "min"
    """"min": lower is better (a loss); "max": higher is better (an accuracy)."""
    n: int = 1
    """How many of the best checkpoints to keep (a positive int)."""

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"KeepBest.metric must be a non-empty metric name (a key of "
                              f"maybe_save(metrics=...)), got {self.metric!r}.")
        _check_mode("KeepBest", "mode", self.mode, ("min", "max"))
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n <= 0:
            raise ConfigError(f"KeepBest.n must be a positive int (how many of the best "
                              f"checkpoints to keep), got {self.n!r}.")


def _check_keep_every(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, Every) or value.steps is None or value.epochs is not None \
            or value.seconds is not None:
        raise ConfigError(
            f"RecoverConfig.keep_every must be None or jaxckpt.Every(steps=K) (steps only: "
            f"which checkpoints it keeps must follow from their step alone, not from epochs or "
            f"wall time), got {value!r}.")


def _check_keep_best(value: Any) -> None:
    if value is not None and not isinstance(value, KeepBest):
        raise ConfigError(
            f"RecoverConfig.keep_best must be None or a jaxckpt.KeepBest, got {value!r}. "
            f"Write keep_best=jaxckpt.KeepBest(metric='loss', mode='min').")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RecoverConfig:
    """Recovery checkpoints: complete training state, to resume a crashed or preempted run.

    Args (keyword only; each field's docstring below says more):
        mode: "on"/"auto" write and resume; "off"/"disabled" neither.
        every: when a recovery checkpoint is due (an ``Every``).
        keep_last_n: how many of the latest valid checkpoints to keep (None: all; 0: only
            forced saves, the latest kept).
        keep_every: also keep the steps of ``Every(steps=K)``.
        keep_best: also keep the best by a metric (a ``KeepBest``).
        retries: how many times ``jaxckpt run`` restarts a failed run.
        verify: "checksums" or "sizes": how ``recover`` checks a checkpoint.
        restore_global_rng: save and restore Python's and NumPy's global RNGs.
        on_corrupt: "raise" (fail closed) or "start_fresh" when nothing verifies.
        resume: False: still write checkpoints, but never resume from them.
        incremental: write only the data that changed since the newest checkpoint.
    """

    mode: RecoverMode = "auto"
    """"on"/"auto": write recovery checkpoints and resume from the latest valid one when it
    exists; "off"/"disabled": write none and never resume. The two spellings of each are
    synonyms kept for compatibility with AReaL-style configs."""
    every: Every = dataclasses.field(default_factory=Every)
    """When a recovery checkpoint is due (any-of)."""
    keep_last_n: int | None = 1
    """None keeps every checkpoint; 0 writes no intermediate (periodic) checkpoints, only
    forced ``save()`` calls, of which the latest is kept; 1 keeps the latest valid one; N the
    latest N."""
    keep_every: Every | None = None
    """Also keep every checkpoint whose step satisfies ``Every(steps=K)``: those with
    ``(global_step + 1) % K == 0``, the steps a ``steps=K`` trigger saves. Steps only."""
    keep_best: KeepBest | None = None
    """Also keep the best checkpoints by a metric given to ``maybe_save(metrics=...)``."""
    retries: int = 3
    """How many times ``jaxckpt run`` restarts a failed run from its latest checkpoint."""
    verify: Literal["checksums", "sizes"] = "checksums"
    """How ``recover`` checks a checkpoint before trusting it: "checksums" compares every
    file's checksum (crc32c) with the manifest (detects bit flips; large array files are
    checked while they are read, and what was read is dropped if they fail); "sizes" only
    compares file sizes (faster)."""
    restore_global_rng: bool = True
    """Save and restore Python's ``random`` and NumPy's global RNG state with each checkpoint."""
    on_corrupt: Literal["raise", "start_fresh"] = "raise"
    """What ``recover`` does when the root holds committed checkpoints and none of them
    verifies: "raise" (fail closed) raises ``CheckpointCorruptError`` listing each one and
    why, so a damaged root never turns silently into a run from scratch; "start_fresh"
    warns, moves them to ``recover/superseded/`` for inspection and returns None. Roots
    holding only interrupted (uncommitted) saves start fresh either way: nothing was lost."""
    resume: bool = True
    """True: ``recover`` resumes from the latest valid checkpoint (modes "on"/"auto").
    False: recovery checkpoints are still written, but ``recover`` never resumes: it moves
    the root's committed checkpoints to ``recover/superseded/`` (kept for inspection), warns
    naming them, and returns None, so the run starts over with a clean root (torchtune's
    ``resume_from_checkpoint: False``)."""
    incremental: bool = False
    """True: a save writes only the array data files whose bytes differ from those of the
    newest committed checkpoint of the root (equal by a 128-bit content hash, shape, dtype
    and sharding); the others are referred to, and retention keeps a file while any kept
    checkpoint refers to it. Pays when much of the state is frozen (adapters, a frozen
    encoder, an RL reference model). Needs a backend that supports it (the Orbax backend;
    ``BackendFeatures.incremental``)."""

    def __post_init__(self) -> None:
        _check_mode("RecoverConfig", "mode", self.mode, RECOVER_MODES)
        _check_every("RecoverConfig", self.every)
        _check_keep_last_n("RecoverConfig", self.keep_last_n)
        _check_keep_every(self.keep_every)
        _check_keep_best(self.keep_best)
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"RecoverConfig.retries must be an int >= 0, got {self.retries!r}.")
        _check_mode("RecoverConfig", "verify", self.verify, ("checksums", "sizes"))
        _check_mode("RecoverConfig", "on_corrupt", self.on_corrupt, ("raise", "start_fresh"))
        if not isinstance(self.resume, bool):
            raise ConfigError(f"RecoverConfig.resume must be True or False, got "
                              f"{self.resume!r}.")
        if not isinstance(self.incremental, bool):
            raise ConfigError(f"RecoverConfig.incremental must be True or False, got "
                              f"{self.incremental!r}.")
        if self.keep_last_n == 0 and not self.every.never:
            raise ConfigError(
                f"RecoverConfig.keep_last_n=0 writes no periodic checkpoints, but "
                f"RecoverConfig.every={self.every} asks for them. Use keep_last_n=1 (or more) to "
                f"keep periodic checkpoints, or remove the trigger (every=Every()) to write only "
                f"forced save() calls.")

    @property
    def enabled(self) -> bool:
        """Whether recovery checkpoints are written and resumed from."""
        return self.mode in ("on", "auto")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ExportConfig:
    """Periodic model-only exports (e.g. Hugging Face format) for evaluation and publishing.

    Args (keyword only):
        every: when an export is due (an ``Every``).
        exporter: ``exporter(state, out_dir)`` writes one export (required).
        mode: "sync", "async" (a host copy exported in the background) or "auto" (async).
        keep_last_n: None keeps every export; N the latest N; 0 only forced exports.
    """

    every: Every = dataclasses.field(default_factory=Every)
    """When an export is due (any-of)."""
    exporter: Callable[[Any, str], Any] | None = None
    """``exporter(state, out_dir)`` writes one export into ``out_dir`` (a fresh temp directory
    that is renamed into place afterwards)."""
    mode: SaveMode = "auto"
    """"sync" exports on the training thread; "async" exports a host copy in the background;
    "auto" is async."""
    keep_last_n: int | None = None
    """None keeps every export; N keeps the latest N; 0 keeps none but forced exports."""

    def __post_init__(self) -> None:
        _check_every("ExportConfig", self.every)
        if self.exporter is None or not callable(self.exporter):
            raise ConfigError(
                f"ExportConfig.exporter must be a callable(state, out_dir), got "
                f"{self.exporter!r}. For Hugging Face exports use "
                f"torch_bridge.hf_exporter(params_of=...) for a torch model, or "
                f"torch_bridge.hf_exporter(arch=..., config=..., params_of=...) for Flax params."
            )
        _check_mode("ExportConfig", "mode", self.mode, SAVE_MODES)
        _check_keep_last_n("ExportConfig", self.keep_last_n)


@dataclasses.dataclass(frozen=True, slots=True)
class LocalTier:
    """A fast local tier under the durable root: frequent recovery checkpoints on local disk.

    ``CheckpointManager(root, recover=..., local=LocalTier(path, every=Every(steps=50)))``
    writes a recovery checkpoint to ``path`` whenever ``every`` is due and the durable
    root's own ``RecoverConfig.every`` is not (at a step where both are due only the durable
    root is written). ``recover`` restores the newest checkpoint that verifies in either
    tier (see docs/design.md, "Two tiers"). ``path`` is a root of its own (same layout and
    commit protocol, its own lock) and must be a local filesystem path apart from the
    durable root.

    Args:
        path: the local root, e.g. a directory on the machine's NVMe disk (created if missing).
        every: (keyword) when a local checkpoint is due; default ``Every(steps=50)``.
        keep_last_n: (keyword) how many local checkpoints to keep (>= 1).
    """

    path: str | os.PathLike[str]
    """The local root, e.g. a directory on the machine's NVMe disk (created if missing)."""
    _: dataclasses.KW_ONLY
    every: Every = dataclasses.field(default_factory=lambda: Every(steps=50))
    """When a local checkpoint is due (any-of); never all None."""
    keep_last_n: int = 1
    """How many local checkpoints to keep (>= 1): local disk is small and the durable root
    holds the history."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ConfigError(f"LocalTier.path must be a directory path (str or "
                              f"os.PathLike), got {self.path!r}.")
        if "://" in str(os.fspath(self.path)):
            raise ConfigError(
                f"LocalTier.path must be a local filesystem path, got {self.path!r}: the local "
                f"tier is the machine's own disk; put object storage in the durable root.")
        _check_every("LocalTier", self.every)
        if self.every.never:
            raise ConfigError(
                f"LocalTier.every={self.every} never fires, so the local tier would never be "
                f"written. Write e.g. every=jaxckpt.Every(steps=50), or drop local=.")
        value = self.keep_last_n
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"LocalTier.keep_last_n must be an int >= 1 (how many local "
                              f"checkpoints to keep), got {value!r}.")
