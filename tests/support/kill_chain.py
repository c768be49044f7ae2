"""Chains of kill trials with many processes, on any root: a 2-process JAX job
(``mp_jax_worker.py``: ``jax.distributed`` on 127.0.0.1, CPU devices) or a 2-rank torch job
(``torch_worker.py``: gloo) runs segment after segment on one root; in each, one process
SIGKILLs itself at a point of a save (``kill_points``), the scheduler (``pair_trials``) kills
the survivor after a grace period, and the next segment starts both again on the same root,
until one runs to the end.

Used by tests/system/test_multiprocess_kill.py (local roots) and
tests/system/test_multiprocess_kill_remote.py (``s3://`` against moto, ``gs://`` against the
GCS emulator). Owns the jobs, the chain and the checks made after every segment (listed in
``run_chain``); which plans to run, and what else to assert, stay in the tests. The root is a
``ChainRoot``: a local path, or a URL with its ``storage_options``, read through the
library's own ``CheckpointStore`` and checked at the end with ``jaxckpt verify`` as a user
would. Losses, reports and final states are worker outputs in a local scratch directory.

Concurrency: used from the test thread only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxckpt.tools import cli

from support import kill_points
from support.pair_trials import (
    Outcome,
    broken_committed,
    committed_steps,
    run_job,
    step_entries,
)
from support.paths import SUPPORT, TORCH_WORKER
from support.two_processes import free_port

JAX_WORKER = SUPPORT / "mp_jax_worker.py"

#: The soak (behind ``@pytest.mark.slow``): ``JAXCKPT_SOAK=1`` runs 50 random trials per
#: test, ``JAXCKPT_SOAK_TRIALS=N`` runs N.
SOAK_TRIALS = int(os.environ.get("JAXCKPT_SOAK_TRIALS") or 0) or 50
SOAK_ENABLED = bool(os.environ.get("JAXCKPT_SOAK_TRIALS")) or os.environ.get("JAXCKPT_SOAK") == "1"


def harness_seed() -> int:
    pinned = os.environ.get("JAXCKPT_CRASH_SEED")
    return int(pinned) if pinned else random.SystemRandom().randrange(2**31)


@dataclasses.dataclass(frozen=True)
class ChainRoot:
    """Where a chain checkpoints: a local path, or an ``s3://`` / ``gs://`` URL whose client
    ``options`` configures."""

    url: str
    options: dict[str, Any] | None = None

    def child(self, name: str) -> ChainRoot:
        """A fresh root below this one (one per soak chain)."""
        return ChainRoot(f"{self.url}/{name}", self.options)

    def worker_args(self) -> list[str]:
        """What a worker is given to open this root."""
        extra = ["--storage-options", json.dumps(self.options)] if self.options else []
        return ["--root", self.url, *extra]

    def cli_args(self) -> list[str]:
        """``jaxckpt`` flags for the same client."""
        return [arg for key, value in (self.options or {}).items()
                for arg in ("--storage-option", f"{key}={value}")]

    def committed(self) -> list[int]:
        return committed_steps(self.url, self.options)

    def broken(self) -> dict[int, list[str]]:
        return broken_committed(self.url, self.options)

    def entries(self, step: int) -> list[str]:
        return step_entries(self.url, step, self.options)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Process ``process`` dies at ``point`` of the save of ``step`` (+ ``delay_s``); the
    survivor is killed ``grace_s`` after that."""

    process: int
    point: str
    step: int
    delay_s: float = 0.0
    grace_s: float = 1.0

    def env(self) -> dict[str, str]:
        return {"JAXCKPT_KILL_POINT": kill_points.spec(self.process, self.point, self.step,
                                                      self.delay_s)}


@dataclasses.dataclass
class Trial:
    """What one killed segment did and left."""

    plan: Plan
    outcomes: list[Outcome]
    committed_before: list[int]
    committed_after: list[int]
    step_dir_names: list[str]  # what the plan's step directory held after the kill


# ------------------------------------------------------------------------ frameworks


class JaxJob:
    """The JAX worker (tests/support/mp_jax_worker.py): ``steps`` steps (default 10), saves
    every 2 (1, 3, 5, 7, 9), keep_last_n=1, async. The first job it starts also runs the
    uninterrupted reference (on a local root of its own, in the same processes, before the
    segment)."""

    save_every = 2

    def __init__(self, tmp: Path, steps: int = 10, *, compile_cache: Path | None = None):
        self.tmp, self.steps = tmp, steps
        self.reference: str | None = None  # the label whose processes ran the reference
        self.last_outcomes: list[Outcome] = []  # the segment that ran to the end
        self.env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        self.env.update({"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3",
                         "JAX_COMPILATION_CACHE_DIR": str(compile_cache or tmp / "jax-cache"),
                         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})

    def commands(self, label: str, root: ChainRoot) -> list[list[str]]:
        port = str(free_port())
        reference = self.reference is None
        if reference:
            self.reference = label
        return [[sys.executable, str(JAX_WORKER), "--index", str(i), "--count", "2",
                 "--port", port, *root.worker_args(), "--steps", str(self.steps),
                 "--save-every", str(self.save_every),
                 "--log", str(self.tmp / f"{label}.p{i}.jsonl"),
                 "--final", str(self.tmp / f"{label}.p{i}.npz"),
                 *(["--reference-root", str(self.tmp / "reference-root")] if reference else [])]
                for i in range(2)]

    def losses(self, label: str, process: int, suffix: str = "") -> dict[int, str]:
        path = self.tmp / f"{label}.p{process}.jsonl{suffix}"
        if not path.exists():
            return {}
        return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}

    def reference_losses(self, process: int) -> dict[int, str]:
        return self.losses(str(self.reference), process, ".reference")

    def resumed_from(self, label: str, process: int, outcome: Outcome) -> int | None:
        if "FRESH" in outcome.lines:
            return -1
        resumed = outcome.tagged("RESUMED")
        return json.loads(resumed[0])["step"] if resumed else None

    def final(self, label: str, process: int) -> dict[str, bytes]:
        return _npz_bytes(self.tmp / f"{label}.p{process}.npz")

    def reference_final(self, process: int) -> dict[str, bytes]:
        return _npz_bytes(self.tmp / f"{self.reference}.p{process}.npz.reference.npz")


class TorchJob:
    """The torch worker (tests/support/torch_worker.py) on 2 gloo ranks: ``steps`` steps
    (default 14; 6 per epoch), saves every 4 (3, 7, 11) and a final one, keep_last_n=2,
    async DCP. Losses are compared with the sample ids of each batch (data order); the final
    state by digests. The reference runs on a local root."""

    save_every = 4

    def __init__(self, tmp: Path, steps: int = 14):
        self.tmp, self.steps = tmp, steps
        self.reference: str | None = None
        self.last_outcomes: list[Outcome] = []
        self.env = dict(os.environ)

    def commands(self, label: str, root: ChainRoot) -> list[list[str]]:
        port = str(free_port())
        reference = self.reference is None
        if reference:
            self.reference = label
        return [[sys.executable, str(TORCH_WORKER), "--phase", "train", *root.worker_args(),
                 "--out", str(self.tmp), "--label", label, "--world", "2", "--rank", str(rank),
                 "--port", port, "--steps", str(self.steps),
                 "--save-every", str(self.save_every),
                 *(["--reference-root", str(self.tmp / "reference-root")] if reference else [])]
                for rank in range(2)]

    def _records(self, label: str, rank: int) -> list[dict[str, Any]]:
        path = self.tmp / f"{label}.rank{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def losses(self, label: str, rank: int) -> dict[int, str]:
        return {r["step"]: f"{r['loss']} {r['ids']}" for r in self._records(label, rank)
                if "step" in r}

    def reference_losses(self, rank: int) -> dict[int, str]:
        return self.losses("reference", rank)

    def resumed_from(self, label: str, rank: int, outcome: Outcome) -> int | None:
        return JaxJob.resumed_from(self, label, rank, outcome)  # type: ignore[arg-type]

    def final(self, label: str, rank: int) -> Any:
        (last,) = [r for r in self._records(label, rank) if "final" in r]
        return {key: last[key] for key in ("final", "table", "rng")}

    def reference_final(self, rank: int) -> Any:
        return self.final("reference", rank)


def _npz_bytes(path: Path) -> dict[str, bytes]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name].dtype.str.encode() + data[name].tobytes() for name in data.files}


# ----------------------------------------------------------------------------- chain

#: The plan of each segment of a chain: (segment index, step it resumes from) -> the kill,
#: or None to run to the end.
Planner = Callable[[int, int], "Plan | None"]


def fixed(plans: list[Plan]) -> Planner:
    return lambda index, resume_from: plans[index] if index < len(plans) else None


def run_chain(job: Any, root: ChainRoot, planner: Planner, *, prefix: str = "",
              where: str = "", strict: bool = True) -> list[Trial]:
    """Run segments on ``root``, each killed as ``planner`` says, until one runs to the end;
    returns the killed trials. Checked after every segment:

    - every committed checkpoint verifies against its manifest (none is ever partial), and
      at the end of a chain ``jaxckpt verify ROOT`` passes;
    - every process resumed from the newest committed step (a partial one is never
      restored);
    - every loss any process logged equals the uninterrupted reference run's, step by step
      with none skipped, and at the end the final state is byte-identical to the reference;
    - a save the primary reported complete is committed; the other process reports a save
      only once its marker exists.

    ``prefix`` starts the segments' file names, ``where`` the failure messages. ``strict``:
    a planned process must reach its kill point (False: a plan whose process finished
    first, e.g. a delayed kill after the last save, ends the chain)."""
    trials: list[Trial] = []
    reported_ever = -1
    for index in range(100):
        label = f"{prefix}seg{index + 1}"
        before = root.committed()
        resume_from = before[-1] if before else -1
        plan = planner(index, resume_from)
        env = dict(job.env, **(plan.env() if plan else {}))
        started = time.monotonic()
        outcomes = run_job(job.commands(label, root), env=env,
                           grace_s=plan.grace_s if plan else 1.0)
        print(f"{label}: {time.monotonic() - started:.1f} s, plan {plan}")
        for out in outcomes:  # what the reference run printed first is not this segment's
            if "REFERENCE DONE" in out.lines:
                del out.lines[:out.lines.index("REFERENCE DONE") + 1]
        here = f"{where} {label} on {root.url} plan {plan}; before {before}"
        if plan is not None and not strict and all(o.code == 0 for o in outcomes):
            plan = None  # the run ended before the kill point: it ran to the end
        check_segment(job, label, outcomes, plan, resume_from, here)
        after = root.committed()
        broken = root.broken()
        assert not broken, f"{here}: committed checkpoints fail verification: {broken}"
        reported = [int(r.split()[0]) for r in outcomes[0].tagged("REPORTED")]
        reported_ever = max([reported_ever, *reported])
        assert (after[-1] if after else -1) >= reported_ever, \
            f"{here}: step {reported_ever} was reported committed; on disk {after}"
        if plan is None:
            for i in range(len(outcomes)):
                assert job.final(label, i) == job.reference_final(i), \
                    f"{here}: process {i}'s final state differs from the reference"
            # What a user would run: every checkpoint under the root verifies, none partial.
            assert cli.main(["verify", root.url, *root.cli_args()]) == cli.EXIT_OK, \
                f"{here}: jaxckpt verify"
            job.last_outcomes = outcomes
            return trials
        # Restarted at once, as a scheduler does: a killed primary's root lease is taken
        # over (its process on this host is gone).
        trials.append(Trial(plan, outcomes, before, after, root.entries(plan.step)))
    raise AssertionError(f"{where} {prefix}: the chain never ran to its end")


def check_segment(job: Any, label: str, outcomes: list[Outcome], plan: Plan | None,
                  resume_from: int, here: str) -> None:
    """Exit codes, resume point, losses and reports of one segment's processes."""
    # In a killed job the survivor may end any way (killed by the harness, or aborted by
    # jax.distributed / gloo once its peer is gone): what it left on disk is what is checked.
    for i, out in enumerate(outcomes):
        if plan is None:
            assert out.code == 0 and "DONE" in out.lines, \
                f"{here}: process {i} exit {out.code}\n{out.lines[-10:]}\n{out.stderr}"
    if plan is not None:
        assert outcomes[plan.process].died_by_itself, \
            f"{here}: process {plan.process} never reached its kill point: " \
            f"{outcomes[plan.process].lines[-10:]}\n{outcomes[plan.process].stderr}"
    for i, out in enumerate(outcomes):
        started = job.resumed_from(label, i, out)
        if started is not None:
            assert started == resume_from, f"{here}: process {i} resumed from {started}"
        logged = job.losses(label, i)
        if logged:
            assert sorted(logged) == list(range(resume_from + 1, max(logged) + 1)), here
        reference = job.reference_losses(i)
        differ = {s: (v, reference[s]) for s, v in logged.items() if v != reference[s]}
        assert not differ, f"{here}: process {i} losses differ: {differ}"
        # The other process hears of a save only once the primary committed it.
        assert all(r.endswith("COMMITTED") for r in out.tagged("REPORTED")), \
            f"{here}: process {i} reported before the commit: {out.tagged('REPORTED')}"


# ------------------------------------------------------------------------------ soak


def random_planner(rng: random.Random, job: Any, kills: int) -> Planner:
    """Up to ``kills`` random kills, each at a random point of one of the next two saves
    after the resume point, by a random process (commit and retention: the primary's), at
    once or up to 0.3 s later, the survivor killed 0-3 s after."""

    def plan(index: int, resume_from: int) -> Plan | None:
        saves = [s for s in range(job.steps)
                 if (s + 1) % job.save_every == 0 and s > resume_from]
        if index >= kills or not saves:
            return None
        step = rng.choice(saves[:2])
        point = rng.choice(kill_points.POINTS)
        if point == "retention" and step == saves[0] and resume_from < 0:
            point = "commit"  # nothing to delete after the very first save
        process = 0 if point in ("commit", "retention") else rng.randrange(2)
        return Plan(process, point, step, delay_s=rng.choice([0.0, rng.uniform(0.0, 0.3)]),
                    grace_s=rng.uniform(0.0, 3.0))

    return plan


def run_soak(job: Any, root: ChainRoot, trials: int, name: str) -> None:
    """At least ``trials`` random kills over chains of 1-3 kills on fresh roots below
    ``root``."""
    seed = harness_seed()
    rng = random.Random(seed)
    done, chain = 0, 0
    while done < trials:
        chain += 1
        planner = random_planner(rng, job, rng.randint(1, 3))
        done += len(run_chain(job, root.child(f"chain-{chain}"), planner, prefix=f"c{chain}-",
                              where=f"{name} soak [JAXCKPT_CRASH_SEED={seed}]",
                              strict=False))
    print(f"{name} soak seed {seed}: {done} kills over {chain} chains")
