"""The fast local tier under SIGKILL: a real training worker (tests/support/crash_worker.py
with ``--local``) saves every LOCAL_EVERY steps to a local tier and every DURABLE_EVERY steps
to the durable root; it is SIGKILLed at random moments (a step, a local save, a durable save,
the end of a write, each plus a random delay), and between runs the local tier is left as
it is, deleted (a new machine) or its newest checkpoint damaged.

Checked after every kill:
- the next run resumes from the newest checkpoint that verifies in either tier (the local
  copy first at an equal step), and from the tier it names; FRESH only when none verifies;
- every loss any run logged is bit-identical (``float.hex``) to an uninterrupted run's, and
  a chain that runs to its end has the same final state (params, Adam moments, PRNG key
  data, ballast) byte for byte;
- the durable cadence is the durable trigger's alone: durable saves only at its steps, local
  saves only at the local steps the durable root does not take; every committed checkpoint
  of either tier verifies; each tier's retention holds (at most keep_last_n + 1 while a
  deletion may lag a kill).

Reproduce a failure with the printed seed: ``JAXCKPT_CRASH_SEED=<seed> pytest ...``. Soak
(many more kills): ``JAXCKPT_SOAK=1 pytest tests/system/test_local_tier_kills.py -k soak``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxckpt.commit.store import CheckpointStore

from support.harness import Worker, repo_env
from support.paths import CRASH_WORKER as WORKER

STEPS = 24
DURABLE_EVERY = 8
LOCAL_EVERY = 2
KEEP_DURABLE = 2
KEEP_LOCAL = 1
BALLAST = 8  # more files per save: kills land inside writes and commits more often
DURABLE_STEPS = [s for s in range(STEPS) if (s + 1) % DURABLE_EVERY == 0]
LOCAL_STEPS = [s for s in range(STEPS) if (s + 1) % LOCAL_EVERY == 0 and s not in DURABLE_STEPS]
KILLS = 4
SEGMENT_TIMEOUT_S = 90.0

soak_enabled = os.environ.get("JAXCKPT_SOAK") == "1"


def seed_of_run() -> int:
    pinned = os.environ.get("JAXCKPT_CRASH_SEED")
    return int(pinned) if pinned else random.SystemRandom().randrange(2**31)


def worker_env(tmp: Path) -> dict[str, str]:
    return repo_env(
        JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
        TF_CPP_MIN_LOG_LEVEL="3",
        # The reference run fills the cache; later workers skip compilation (same program).
        JAX_COMPILATION_CACHE_DIR=str(tmp / "jax-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def run_worker(tmp: Path, run: Path, *, log: Path, final: Path, mode: str,
               kill: tuple[str, float] | None) -> tuple[Worker, int]:
    """One run of the worker on ``run`` (its durable root and local tier), SIGKILLed
    ``kill[1]`` s after the line ``kill[0]``; returns it and its exit status."""
    worker = Worker(
        [sys.executable, str(WORKER), "--root", str(run / "durable"), "--log", str(log),
         "--final", str(final), "--steps", str(STEPS), "--save-every", str(DURABLE_EVERY),
         "--keep-last-n", str(KEEP_DURABLE), "--mode", mode, "--ballast", str(BALLAST),
         "--local", str(run / "local"), "--local-every", str(LOCAL_EVERY),
         "--local-keep-last-n", str(KEEP_LOCAL)],
        env=worker_env(tmp), timeout_s=SEGMENT_TIMEOUT_S)
    code = worker.run() if kill is None else worker.run(kill_at=kill[0], delay_s=kill[1])
    return worker, code


def logged_losses(path: Path) -> list[tuple[int, str]]:
    if not path.exists():
        return []
    return [(int(e["step"]), e["loss"]) for e in map(json.loads, path.read_text().splitlines())]


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def valid_steps(root: Path) -> list[int]:
    """Committed steps of one tier whose files verify against their manifests."""
    store = CheckpointStore(root)
    return [s for s in store.committed_steps() if not store.verify(store.step_path(s))]


def expected_resume(run: Path) -> tuple[int, str] | None:
    """(step, tier) the next run must resume from: the newest valid, local first on ties."""
    found = ([(s, 1, "local") for s in valid_steps(run / "local")]
             + [(s, 0, "durable") for s in valid_steps(run / "durable")])
    if not found:
        return None
    step, _, tier = max(found)
    return step, tier


def tamper(run: Path, rng: random.Random, how: str) -> str:
    """Between runs: leave the local tier, delete it (a new machine), or damage its newest
    checkpoint (flip a byte of its biggest file). Returns what was done."""
    local = run / "local"
    if how == "delete":
        shutil.rmtree(local, ignore_errors=True)
        return "deleted the local tier"
    steps = CheckpointStore(local).committed_steps() if local.exists() else []
    if how == "corrupt" and steps:
        step_dir = Path(CheckpointStore(local).step_path(steps[-1]))
        files = [p for p in (step_dir / "state").rglob("*") if p.is_file()]
        target = max(files, key=lambda p: p.stat().st_size)
        data = bytearray(target.read_bytes())
        data[rng.randrange(len(data))] ^= 0xFF
        target.write_bytes(bytes(data))
        return f"damaged {target.relative_to(run)}"
    return "left the local tier"


def random_kill(rng: random.Random, after: int) -> tuple[str, float] | None:
    """A line of the coming run (which resumes after step ``after``) to SIGKILL at, plus a
    random delay: a step, the start of one of the next saves, or the end of its write."""
    if after + 1 >= STEPS:
        return None  # nothing left to run but the final save
    delay = rng.uniform(0.0, 0.05)
    saves = sorted([(s, "SAVING") for s in DURABLE_STEPS if s > after]
                   + [(s, "SAVING_LOCAL") for s in LOCAL_STEPS if s > after])[:3]
    kind = rng.choice(["STEP", "save", "WRITTEN"])
    if kind == "STEP" or not saves:
        return f"STEP {rng.randrange(after + 1, min(STEPS, after + 10))}", delay
    step, tag = rng.choice(saves)
    return (f"{tag} {step}" if kind == "save" else f"WRITTEN {step}"), delay


def check_run(worker: Worker, *, expected: tuple[int, str] | None, log: Path,
              reference: dict[int, str], where: str) -> None:
    start = worker.tagged("RESUMED") or (["FRESH"] if "FRESH" in worker.lines else [])
    if start:  # a kill may land before the first line
        if expected is None:
            assert start[0] == "FRESH", f"{where}: {start[0]}, expected a fresh start"
        else:
            got = json.loads(start[0])
            assert (got["step"], got["tier"]) == expected, \
                f"{where}: resumed from {got}, expected {expected}"
    for step, loss in logged_losses(log):
        assert loss == reference[step], f"{where}: loss of step {step} differs"
    durable = [int(s) for s in worker.tagged("SAVING")]
    local = [int(s) for s in worker.tagged("SAVING_LOCAL")]
    assert set(durable) <= set(DURABLE_STEPS), f"{where}: durable saves at {durable}"
    assert set(local) <= set(LOCAL_STEPS), f"{where}: local saves at {local}"


def check_disk(run: Path, where: str) -> None:
    for tier, keep, allowed in (("durable", KEEP_DURABLE, DURABLE_STEPS),
                                ("local", KEEP_LOCAL, LOCAL_STEPS)):
        store = CheckpointStore(run / tier)
        steps = store.committed_steps() if (run / tier).exists() else []
        assert set(steps) <= set(allowed), f"{where}: {tier} tier holds {steps}"
        assert len(steps) <= keep + 1, f"{where}: {tier} retention: {steps}"


def run_kills(tmp: Path, kills: int, seed: int, reference: dict[int, str],
              ref_state: dict[str, np.ndarray]) -> None:
    rng = random.Random(seed)
    tag = f"[JAXCKPT_CRASH_SEED={seed}]"
    # Every chain sees a lost and a damaged local tier at least once.
    tampers = ["delete", "corrupt"] + [rng.choice(["none", "delete", "corrupt"])
                                       for _ in range(max(0, kills - 2))]
    rng.shuffle(tampers)
    run = tmp / "run"
    history: list[str] = []
    for index in range(kills + 1):
        expected = expected_resume(run) if run.exists() else None
        resume_step = expected[0] if expected else -1
        kill = random_kill(rng, resume_step) if index < kills else None
        mode = rng.choice(["sync", "async"])
        log = tmp / f"run-{index}.jsonl"
        worker, code = run_worker(tmp, run, log=log, final=tmp / "final.npz", mode=mode,
                                  kill=kill)
        where = f"{tag} run {index} ({mode}, kill at {kill}); history {history}; " \
                f"last lines {worker.lines[-6:]}\n{worker.stderr(1500)}"
        check_run(worker, expected=expected, log=log, reference=reference, where=where)
        check_disk(run, where)
        if kill is None or not worker.killed:
            assert code == 0 and "DONE" in worker.lines, where
            break
        history.append(f"{kill}: " + tamper(run, rng, tampers[index]))
    state = load_npz(tmp / "final.npz")
    assert sorted(state) == sorted(ref_state)
    bad = [k for k in ref_state if state[k].tobytes() != ref_state[k].tobytes()]
    assert not bad, f"{tag}: final state differs from the uninterrupted run in {bad}"
    print(f"local tier kills {tag}: {history}")


def reference_run(tmp: Path) -> tuple[dict[int, str], dict[str, np.ndarray]]:
    ref = tmp / "reference"
    worker, code = run_worker(tmp, ref, log=tmp / "ref.jsonl", final=tmp / "ref.npz",
                              mode="async", kill=None)
    assert code == 0 and "DONE" in worker.lines, worker.stderr()
    # The durable root saves on its own cadence; the local tier takes the rest.
    assert [int(s) for s in worker.tagged("SAVING")] == DURABLE_STEPS
    assert [int(s) for s in worker.tagged("SAVING_LOCAL")] == LOCAL_STEPS
    assert CheckpointStore(ref / "durable").committed_steps() == DURABLE_STEPS[-KEEP_DURABLE:]
    assert CheckpointStore(ref / "local").committed_steps() == LOCAL_STEPS[-KEEP_LOCAL:]
    losses = dict(logged_losses(tmp / "ref.jsonl"))
    assert sorted(losses) == list(range(STEPS))
    return losses, load_npz(tmp / "ref.npz")


@pytest.mark.timeout(400)
def test_sigkills_with_a_lost_or_damaged_local_tier_resume_bit_exact(tmp_path):
    seed = seed_of_run()
    print(f"local tier kill seed {seed} (pin with JAXCKPT_CRASH_SEED={seed})")
    reference, ref_state = reference_run(tmp_path)
    run_kills(tmp_path, KILLS, seed, reference, ref_state)
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(0)
@pytest.mark.skipif(not soak_enabled, reason="soak: set JAXCKPT_SOAK=1")
def test_soak_sigkills_with_the_local_tier(tmp_path):
    seed = seed_of_run()
    print(f"local tier soak seed {seed} (pin with JAXCKPT_CRASH_SEED={seed})")
    reference, ref_state = reference_run(tmp_path)
    rng = random.Random(seed)
    for chain in range(10):
        chain_dir = tmp_path / f"chain-{chain}"
        chain_dir.mkdir()
        if (tmp_path / "jax-cache").exists() and not (chain_dir / "jax-cache").exists():
            shutil.copytree(tmp_path / "jax-cache", chain_dir / "jax-cache")
        run_kills(chain_dir, 8, rng.randrange(2**31), reference, ref_state)

