"""``jaxckpt bench`` rows of the fast local tier: what the training loop loses to saving with
and without ``CheckpointManager(local=LocalTier(...))``.

Owns: the "local" section's rows and target (``LOCAL_ROWS``, ``LOCAL_TARGETS``, turned into
``results``' row and target types) and ``local_tier_rows``: a short loop of ``maybe_save``
calls with async saves, with the durable root alone (every ``DURABLE_EVERY`` steps) and with
a local tier too (every ``LOCAL_EVERY`` steps); a step's compute is a sleep long enough for
one save to finish before the next. Both roots share one disk: the rows show the blocking
cost of the extra saves, not a faster local disk's speed.

Must not import: torch. jax and orbax come with the manager's default backend.

Concurrency contract: called from the benchmark's one thread; it writes and removes files
only under the directory it is given.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Any

__all__ = ["DURABLE_EVERY", "LOCAL_EVERY", "LOCAL_ROWS", "LOCAL_TARGETS", "local_tier_rows"]

DURABLE_EVERY = 4
LOCAL_EVERY = 2
STEPS = 2 * DURABLE_EVERY
WARMUP = DURABLE_EVERY  # untimed steps first: the first saves build write plans and threads

#: (key, label) of each row, section "local".
LOCAL_ROWS: tuple[tuple[str, str], ...] = (
    ("local_loop_plain",
     (f"local tier: loop blocking, {STEPS} steps, durable root alone (async save every "
      f"{DURABLE_EVERY})")),
    ("local_loop_tiered",
     (f"local tier: loop blocking, {STEPS} steps, with a local tier (async save every "
      f"{LOCAL_EVERY})")),
    ("local_durable_plain", "local tier: one durable save's blocking, durable root alone"),
    ("local_durable_tiered", "local tier: one durable save's blocking, with the local tier"),
    ("local_save", "local tier: one local save's blocking"),
)

#: Keyword arguments of the benchmark's targets.
LOCAL_TARGETS: tuple[dict[str, Any], ...] = (
    {"label": "durable save blocking with a local tier / without",
     "numerator": "local_durable_tiered", "denominator": "local_durable_plain", "op": "<=",
     "limit": 1.5, "note": "the local tier must not hold up the durable root's saves"},
)


def local_tier_rows(state: Any, workdir: str, result: Any) -> None:
    """One round of the "local" rows into ``result`` (``BenchResult.add``)."""
    plain = _loop(state, os.path.join(workdir, "local-bench-plain"), tiered=False)
    tiered = _loop(state, os.path.join(workdir, "local-bench-tiered"), tiered=True,
                   step_s=plain["step_s"])
    result.add("local_loop_plain", plain["loop"])
    result.add("local_loop_tiered", tiered["loop"])
    result.add("local_durable_plain", statistics.median(plain["durable"]))
    result.add("local_durable_tiered", statistics.median(tiered["durable"]))
    result.add("local_save", statistics.median(tiered["local"]))
    result.facts["local_tier"] = {
        "steps": STEPS, "durable_every": DURABLE_EVERY, "local_every": LOCAL_EVERY,
        "step_s": round(plain["step_s"], 4),
        "saves_plain": len(plain["durable"]),
        "saves_tiered": {"durable": len(tiered["durable"]), "local": len(tiered["local"])}}


def _loop(state: Any, directory: str, *, tiered: bool,
          step_s: float | None = None) -> dict[str, Any]:
    """Time the ``maybe_save`` calls of a short loop (what the training thread loses) after
    ``WARMUP`` untimed steps; the blocking time of each durable and local save from its
    report. ``step_s``: the sleep standing for a step's compute (None: from a first, untimed
    save's total time)."""
    import jaxckpt

    local = (jaxckpt.LocalTier(os.path.join(directory, "local"),
                               every=jaxckpt.Every(steps=LOCAL_EVERY)) if tiered else None)
    manager = jaxckpt.CheckpointManager(
        os.path.join(directory, "durable"), mode="async", preemption_signals=(), local=local,
        recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=DURABLE_EVERY), keep_last_n=1))
    blocked = 0.0
    by_tier: dict[str, list[float]] = {"durable": [], "local": []}
    try:
        if step_s is None:
            first = manager.save(jaxckpt.StepInfo(0, 0, 0), state, mode="sync")
            step_s = 1.5 * (first.total_s or 0.0) / LOCAL_EVERY
        step = jaxckpt.StepInfo(0, 0, 0)
        for index in range(WARMUP + STEPS):
            time.sleep(step_s)  # the step's compute: saves write in the background meanwhile
            start = time.perf_counter()
            reports = manager.maybe_save(step, state)
            if index >= WARMUP:
                blocked += time.perf_counter() - start
                for report in reports:
                    by_tier[report.tier].append(report.blocking_s)
            step = step.next()
        manager.wait()
    finally:
        manager.close()
        shutil.rmtree(directory, ignore_errors=True)
    return {"loop": blocked, "step_s": step_s, **by_tier}
