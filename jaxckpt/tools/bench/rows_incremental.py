"""``jaxckpt bench`` rows of incremental checkpoints (``RecoverConfig(incremental=True)``).

Owns: the "incremental" section's rows and targets (``INCREMENTAL_ROWS``,
``INCREMENTAL_TARGETS``), ``incremental_rows`` (one round) and ``incremental_checks`` (the
bytes target, after the last round). Two states share one frozen part
(``BenchConfig.incremental_frozen_mb`` in a few large leaves): "mixed" adds a small trained
part (``incremental_trained_mb``) that changes at every save; "all changed" swaps the whole
frozen part for other bytes at every save, so nothing is left to refer to. Each state is
saved by a plain and an incremental manager in turns (the order flips every round), async,
after an untimed first save. Bytes are counted through the storage layer
(``backends.orbax.backend.WRITTEN``) plus the files the manager writes beside the arrays.
The "dcp" rows do the same with ``DcpCheckpointManager`` on torch copies of the same
bytes; their bytes are the files each commit lists as its own (the writer's checksummed
streams: every byte written, none referenced).

Must not import at module level: jax, orbax, torch.
"""

from __future__ import annotations

import os
from typing import Any

from .config import _MiB
from .states import _jax_state, _leaf_arrays, _random_bytes, _tree_bytes
from .timing import _settle

__all__ = ["INCREMENTAL_ROWS", "INCREMENTAL_TARGETS", "incremental_checks", "incremental_rows"]

#: Leaves of the frozen part (large ones: a frozen encoder or embedding).
FROZEN_LEAVES = 8
#: Leaves of the trained part.
TRAINED_LEAVES = 4
#: The bytes target: what an incremental save writes / what a plain one writes.
BYTES_LIMIT = 0.05
#: The prefix of each state's lists of bytes written in the section's facts.
_FACTS = {"mixed": "", "all": "all_", "dcp_mixed": "dcp_", "dcp_all": "dcp_all_"}

#: (key, label) of each row, section "incremental".
INCREMENTAL_ROWS: tuple[tuple[str, str], ...] = (
    ("inc_plain", "incremental section: frozen + trained, plain save, committed"),
    ("inc_incr", "  the same, incremental=True (frozen part referred to)"),
    ("inc_plain_blocking", "  plain save: async blocking"),
    ("inc_incr_blocking", "  incremental save: async blocking"),
    ("inc_all_plain", "incremental section: every leaf changed, plain save, committed"),
    ("inc_all_incr", "  the same, incremental=True (hashes everything, refers to nothing)"),
    ("inc_all_plain_blocking", "  plain save: async blocking"),
    ("inc_all_incr_blocking", "  incremental save: async blocking"),
    ("inc_dcp_plain", "incremental section, DCP: frozen + trained, plain save, committed"),
    ("inc_dcp_incr", "  the same, incremental=True (frozen tensors referred to)"),
    ("inc_dcp_all_plain", "incremental section, DCP: every tensor changed, plain save"),
    ("inc_dcp_all_incr", "  the same, incremental=True (hashes everything, refers to nothing)"),
)

#: Keyword arguments of the section's time targets (the bytes target is a check).
INCREMENTAL_TARGETS: tuple[dict[str, Any], ...] = (
    {"label": "incremental save time / plain save, frozen + trained",
     "numerator": "inc_incr", "denominator": "inc_plain", "op": "<=", "limit": 0.1,
     "note": "async saves to committed; only the trained part changed"},
    {"label": "incremental save time / plain save, every leaf changed",
     "numerator": "inc_all_incr", "denominator": "inc_all_plain", "op": "<=", "limit": 1.05,
     "note": "the cost of incremental=True when nothing is frozen"},
    {"label": "DCP incremental save time / plain save, frozen + trained",
     "numerator": "inc_dcp_incr", "denominator": "inc_dcp_plain", "op": "<=", "limit": 0.1,
     "note": "DcpCheckpointManager, async saves to committed; only the trained part changed"},
    {"label": "DCP incremental save time / plain save, every tensor changed",
     "numerator": "inc_dcp_all_incr", "denominator": "inc_dcp_all_plain", "op": "<=",
     "limit": 1.05, "note": "the cost of incremental=True when nothing is frozen, DCP"},
)


def _states(bench: Any) -> dict[str, list[Any]]:
    """The section's states, built once: per kind, the states that take turns from one save
    to the next ("mixed": the frozen part with one of two trained parts; "all": one of two
    frozen-sized parts)."""
    states = getattr(bench, "incremental_states", None)
    if states is None:
        config = bench.config
        frozen = [_leaf_arrays(_random_bytes(config.incremental_frozen_mb * _MiB, seed=seed),
                               FROZEN_LEAVES) for seed in (11, 12)]
        trained = [_leaf_arrays(_random_bytes(config.incremental_trained_mb * _MiB,
                                              seed=seed), TRAINED_LEAVES) for seed in (13, 14)]
        frozen_jax = _jax_state(frozen[0])
        states = bench.incremental_states = {
            # One frozen part, the same arrays at every save (as a training loop keeps it).
            "mixed": [{"frozen": frozen_jax, "trained": _jax_state(part)} for part in trained],
            "all": [{"frozen": _jax_state(part)} for part in frozen]}
        states.update(_torch_states(frozen, trained))
        bench.result.nbytes["incremental"] = _tree_bytes(states["mixed"][0])
        bench.result.nbytes["incremental_all"] = _tree_bytes(states["all"][0])
    return states


def _torch_states(frozen: list[Any], trained: list[Any]) -> dict[str, list[Any]]:
    """The "dcp_mixed" and "dcp_all" states: torch copies of the same parts, flat dicts of
    tensors as DcpCheckpointManager saves them; none where torch is not installed."""
    try:
        import torch
    except ImportError:
        return {}
    from .rows_torch import _to_torch

    def tensors(part: list[Any], prefix: str) -> dict[str, Any]:
        return {f"{prefix}_{i:05d}": _to_torch(torch, array) for i, array in enumerate(part)}

    frozen_tensors = [tensors(part, "frozen") for part in frozen]
    return {"dcp_mixed": [{**frozen_tensors[0], **tensors(part, "trained")} for part in trained],
            "dcp_all": frozen_tensors}


def _manager(bench: Any, name: str, *, incremental: bool) -> Any:
    import jaxckpt

    manager = getattr(bench, f"_manager_{name}", None)
    if manager is None:
        manager_class: Any = jaxckpt.CheckpointManager
        if name.startswith("inc_dcp_"):
            from torch_bridge import DcpCheckpointManager as manager_class
        manager = manager_class(
            os.path.join(bench.workdir, f"jaxckpt-{name}"), mode="async",
            recover=jaxckpt.RecoverConfig(keep_last_n=1, incremental=incremental),
            preemption_signals=())
        setattr(bench, f"_manager_{name}", manager)
        setattr(bench, f"_step_{name}", 0)
        bench.closers.append(manager.close)
    return manager


def _save(bench: Any, name: str, state: Any, *, incremental: bool) -> tuple[Any, int]:
    """One async save to committed; its report and the bytes it wrote."""
    import jaxckpt
    from jaxckpt.backends.orbax.backend import WRITTEN

    manager = _manager(bench, name, incremental=incremental)
    step = getattr(bench, f"_step_{name}")
    setattr(bench, f"_step_{name}", step + 1)
    _settle()
    before = WRITTEN.total()
    report = manager.save(jaxckpt.StepInfo(0, step, step), state)
    report.wait()
    arrays = WRITTEN.total() - before
    manager.wait()  # retention of the previous checkpoint is not the next save's cost
    if name.startswith("inc_dcp_"):
        return report, int(report.bytes)
    beside = sum(size for rel, size in manager.store.storage.list_files(report.path).items()
                 if not rel.startswith("state/arrays/"))
    return report, arrays + beside


def incremental_rows(bench: Any, round_index: int) -> None:
    """One round of the "incremental" rows (``bench`` is bench._Bench): for each state, a
    plain and an incremental save in turns; the bytes each wrote go to the facts."""
    states = _states(bench)
    facts = bench.result.facts.setdefault("incremental", {"bytes_plain": [],
                                                          "bytes_incremental": [],
                                                          "bytes_all_plain": [],
                                                          "bytes_all_incremental": []})
    sides = [("plain", False), ("incr", True)]
    if round_index % 2:
        sides.reverse()
    kinds = [("mixed", "inc_"), ("all", "inc_all_")]
    if "dcp_mixed" in states:
        kinds += [("dcp_mixed", "inc_dcp_"), ("dcp_all", "inc_dcp_all_")]
    else:
        for key, _ in INCREMENTAL_ROWS:
            if key.startswith("inc_dcp_"):
                bench.result.unavailable[key] = "torch not installed"
    for kind, prefix in kinds:
        for side, incremental in sides:
            name = f"{prefix}{side}"
            if getattr(bench, f"_step_{name}", 0) == 0:  # the first save writes everything
                _save(bench, name, states[kind][0], incremental=incremental)
            state = states[kind][getattr(bench, f"_step_{name}") % 2]
            report, written = _save(bench, name, state, incremental=incremental)
            bench.result.add(name, report.total_s)
            if not kind.startswith("dcp_"):
                bench.result.add(f"{name}_blocking", report.blocking_s)
            what = "incremental" if incremental else "plain"
            facts.setdefault(f"bytes_{_FACTS[kind]}{what}", []).append(written)


def incremental_checks(bench: Any) -> None:
    """After the last round: the bytes target (per-round ratio, median), and the sizes."""
    from .results import target_row

    facts = bench.result.facts.get("incremental")
    if not facts:
        return
    facts["trained_mib"] = bench.config.incremental_trained_mb
    facts["frozen_mib"] = bench.config.incremental_frozen_mb
    for prefix, what in (("", ""), ("dcp_", "DCP ")):
        if not facts.get(f"bytes_{prefix}plain"):
            continue
        ratios = [i / p for i, p in zip(facts[f"bytes_{prefix}incremental"],
                                        facts[f"bytes_{prefix}plain"], strict=True)]
        bench.result.checks.append(target_row(
            f"{what}incremental save bytes written / plain save, frozen + trained", ratios,
            "<=", BYTES_LIMIT, "counted through the storage layer (the writer's count + the "
                               "manager's files)" if not prefix else
            "the files each commit lists as written by its save (refs not counted)"))
