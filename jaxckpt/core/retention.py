"""Which recovery checkpoints to keep, and why: the retention engine as one pure function.

Owns: the facts retention decides on (``CheckpointFacts``), the rules (``RetentionRules``,
from a ``RecoverConfig``, recorded in ``driver.json`` so tools can replay them) and
``decide``: for every checkpoint, kept or not and every reason (``resume-point``, the
newest valid one; ``last-N``; ``every-K``; ``best`` by a finite metric, newer first on
ties; ``pinned``; ``being-read``, never counted towards last-N; ``unverified``, a failed
one with no valid one newer). A failed checkpoint is kept by ``pinned``, ``being-read`` or
``unverified`` only. The manager and ``jaxckpt ls`` gather the facts; no I/O here.

Must not import: jax, orbax, torch, or any module that does I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from ..config import Every, KeepBest, RecoverConfig

__all__ = ["CheckpointFacts", "RetentionRules", "Verdict", "decide", "REASONS"]

#: Every reason ``decide`` gives, in the order it lists them.
REASONS: tuple[str, ...] = ("resume-point", "pinned", "being-read", "unverified", "last-N",
                            "every-K", "best")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointFacts:
    """What retention knows about one committed checkpoint."""

    step: int
    """Its global step."""
    status: Literal["committed", "corrupt"] = "committed"
    """"committed": valid as far as known; "corrupt": failed verification."""
    metrics: Mapping[str, Any] | None = None
    """The metrics saved with it (``driver.json``), None when unknown or unreadable."""
    pinned: bool = False
    """Pinned by hand (``CheckpointManager.pin``)."""
    reading: bool = False
    """Being restored or read right now."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RetentionRules:
    """The retention rules of a run (the retention fields of its ``RecoverConfig``).

    ``known=False`` stands for "no rules recorded" (``jaxckpt ls`` on a root written before
    rules were recorded): only the rules that need no configuration (resume point, pins,
    being read, unverified) keep anything, and nothing else is decided.
    """

    keep_last_n: int | None = 1
    keep_every: Every | None = None
    keep_best: KeepBest | None = None
    known: bool = True

    @classmethod
    def of(cls, config: RecoverConfig) -> RetentionRules:
        return cls(keep_last_n=config.keep_last_n, keep_every=config.keep_every,
                   keep_best=config.keep_best)

    def to_json(self) -> dict[str, Any]:
        """The small record stored in every ``driver.json`` (key ``"retention"``)."""
        best = self.keep_best
        return {
            "keep_last_n": self.keep_last_n,
            "keep_every": None if self.keep_every is None else {"steps": self.keep_every.steps},
            "keep_best": None if best is None else {"metric": best.metric, "mode": best.mode,
                                                    "n": best.n},
        }

    @classmethod
    def from_json(cls, record: Any) -> RetentionRules:
        """The rules a ``driver.json`` recorded; unknown rules when the record is missing
        or not understood (an older or a newer writer)."""
        try:
            every = record.get("keep_every")
            best = record.get("keep_best")
            # Through RecoverConfig, so a record is held to the same validation as a config.
            return cls.of(RecoverConfig(
                keep_last_n=record.get("keep_last_n"),
                keep_every=None if every is None else Every(steps=every["steps"]),
                keep_best=None if best is None else KeepBest(**best)))
        except Exception:  # noqa: BLE001 - a record we cannot read means "unknown", never a crash
            return cls(known=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """The decision for one checkpoint: kept when ``reasons`` is not empty."""

    step: int
    reasons: tuple[str, ...]

    @property
    def keep(self) -> bool:
        return bool(self.reasons)


def _metric_value(metrics: Mapping[str, Any] | None, name: str) -> float | None:
    value = (metrics or {}).get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _best_steps(valid: list[CheckpointFacts], best: KeepBest) -> set[int]:
    scored = [(value, c.step) for c in valid
              if (value := _metric_value(c.metrics, best.metric)) is not None]
    sign = 1.0 if best.mode == "min" else -1.0
    # Best first; of equal values the newer (larger) step first.
    scored.sort(key=lambda pair: (sign * pair[0], -pair[1]))
    return {step for _, step in scored[:best.n]}


def decide(checkpoints: Iterable[CheckpointFacts], rules: RetentionRules) -> list[Verdict]:
    """For every checkpoint (oldest first) whether it is kept and every reason it is.

    A verdict with no reason means retention may delete it now. When ``rules.known`` is
    False nothing but the configuration-free reasons is decided, so callers must not delete
    on such verdicts (``jaxckpt ls`` shows them as undecided).
    """
    ordered = sorted(checkpoints, key=lambda c: c.step)
    valid = [c for c in ordered if c.status == "committed"]
    newest_valid = valid[-1].step if valid else None
    last_n: set[int] = set()
    best: set[int] = set()
    if rules.known:
        if rules.keep_last_n is None:
            last_n = {c.step for c in valid}
        else:
            last_n = {c.step for c in valid[-max(rules.keep_last_n, 1):]}
        if rules.keep_best is not None:
            best = _best_steps(valid, rules.keep_best)
    every = rules.keep_every.steps if rules.known and rules.keep_every is not None else None
    verdicts = []
    for c in ordered:
        ok = c.status == "committed"
        held = {
            "resume-point": c.step == newest_valid,
            "pinned": c.pinned,
            "being-read": c.reading,
            "unverified": not ok and (newest_valid is None or c.step > newest_valid),
            "last-N": c.step in last_n,
            "every-K": ok and every is not None and (c.step + 1) % every == 0,
            "best": c.step in best,
        }
        verdicts.append(Verdict(c.step, tuple(r for r in REASONS if held[r])))
    return verdicts
