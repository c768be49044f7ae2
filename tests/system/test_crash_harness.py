"""Crash consistency: SIGKILL a training process at random moments, recover, check everything.

The worker (tests/support/crash_worker.py) trains a tiny pure-JAX model and announces on stdout each
seam of the save pipeline: ``STEP n`` (a step finished), ``SAVING n`` (a save was staged and
its background write started), ``WRITTEN n`` (the write finished: the commit starts),
``REPORTED n`` (the commit finished: retention deletion follows). Each trial starts (or
resumes) the worker on a root, picks one of those lines and a random delay after it (or a
random delay after start-up), and SIGKILLs the worker's process group there. Trials are
chained: the next trial resumes the same root and is itself killed at a new random moment,
until a segment runs to the end; then a new chain starts on a fresh root. One uninterrupted
reference run is shared by all chains.

Checked after every kill and resume:
- the committed step on disk is at least the last step whose save was reported complete,
  and every committed checkpoint verifies against its manifest (a kill mid-deletion never
  leaves a committed checkpoint with files missing);
- a manager opened and closed on the root leaves no debris (no uncommitted step directory,
  no ``*.orbax-checkpoint-tmp*``, no ``.tmp-*`` or ``*.tmp`` file) (every other trial; the
  others resume straight from the raw post-kill state);
- the resumed worker restores exactly the newest committed step (a partial checkpoint is
  never restored), and every loss any segment logged is bit-identical (``float.hex``) to
  the reference; at the end of a chain the final state (params, Adam moments, PRNG key
  data, ballast leaves) is byte-identical to the reference.

Incremental chains (``RecoverConfig(incremental=True)``; the state has ``SLOW`` leaves that
change every 12 steps, so later checkpoints refer to their files and retention retires,
tidies and purges the owners) are checked the same way, and also: every file a committed
manifest refers to is there with its size (``verify`` checks its checksum too), and after a
manager start every retired directory holds only files a committed manifest refers to, and
at least one (an unreferenced one is purged). A directory with both markers (killed
mid-retire) counts as retired, not committed. Their plans add two windows inside
retention, where the worker kills itself (``--kill-point retire|purge``): while a step
still referred to is retired, and while a retired step is tidied or purged; the CI run
(fixed seed) must land at least one kill inside retention (how many, and which, depends
on timing; printed).

Reproduce a failure with the printed seed: ``JAXCKPT_CRASH_SEED=<seed> pytest ...``. Soak:
``JAXCKPT_SOAK_TRIALS=500 pytest tests/system/test_crash_harness.py -k soak`` (or JAXCKPT_SOAK=1;
1000 incremental trials).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxckpt import CheckpointManager
from jaxckpt.backends.base import SingleProcess
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.core.layout import COMMIT_MARKER, RETIRED_MARKER, parse_ref_key

from support.harness import Worker, repo_env
from support.paths import CRASH_WORKER as WORKER

STEPS = 30
SAVE_EVERY = 3
SAVE_STEPS = [s for s in range(STEPS) if (s + 1) % SAVE_EVERY == 0]
BALLAST = 16  # extra leaves: each save writes ~40 more files, widening write/commit/delete
SLOW = 8  # leaves that change every 12 steps: incremental saves refer to them
# Plain trials are fewer than before incremental saves existed (20): the plain kill
# windows are also covered by the other kill tests and the soak runs hundreds; the issue
# asks for 30+ incremental trials in CI, and the suite must stay within its time.
TRIALS = 12
INCREMENTAL_TRIALS = 30
SEGMENT_TIMEOUT_S = 90.0

soak_trials = int(os.environ.get("JAXCKPT_SOAK_TRIALS") or 0)
soak_enabled = bool(soak_trials) or os.environ.get("JAXCKPT_SOAK") == "1"


#: The incremental CI trials' seed (fixed: its plans put kills inside retire and purge).
INCREMENTAL_SEED = 3205


def harness_seed(fixed: int | None = None) -> int:
    """``JAXCKPT_CRASH_SEED`` when set, else ``fixed``, else a random seed."""
    pinned = os.environ.get("JAXCKPT_CRASH_SEED")
    if pinned:
        return int(pinned)
    return fixed if fixed is not None else random.SystemRandom().randrange(2**31)


# ------------------------------------------------------------------------------ worker


@dataclasses.dataclass
class Plan:
    """When to SIGKILL: ``delay_s`` after the line ``after`` (None: after spawning)."""

    window: str
    after: str | None
    delay_s: float
    inside: float | None = None
    """Retention windows: the worker kills itself inside ``window`` (its ``--kill-point``)
    with this ``--kill-fraction``; where none came by, the harness kills it ``delay_s``
    after ``after`` (so the trial still ends in a kill, not a run to the end)."""

    def __str__(self) -> str:
        if self.inside is not None:
            return (f"{self.window}: from inside, fraction {self.inside:.2f} (else "
                    f"{self.delay_s * 1e3:.1f} ms after {self.after!r})")
        where = f"after {self.after!r}" if self.after else "after spawn"
        return f"{self.window}: {self.delay_s * 1e3:.1f} ms {where}"


@dataclasses.dataclass
class Segment:
    lines: list[str]
    killed: bool
    code: int
    stderr: str

    def tagged(self, tag: str) -> list[str]:
        return [line[len(tag) + 1:] for line in self.lines if line.split(" ", 1)[0] == tag]

    def steps(self, tag: str) -> list[int]:
        return [int(x) for x in self.tagged(tag)]


class Env:
    """Paths and settings shared by every worker of one test."""

    def __init__(self, tmp: Path, ballast: int, slow: int):
        self.tmp = tmp
        self.ballast = ballast
        self.slow = slow
        self.env = repo_env()  # this checkout's jaxckpt
        self.env.update({
            "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            "TF_CPP_MIN_LOG_LEVEL": "3",
            # The reference run fills the cache; every later worker skips compilation
            # (same program, same executable: numerics are unchanged).
            "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        })

    def run(self, root: Path, *, mode: str, keep_last_n: int, plan: Plan | None,
            log: Path, final: Path, incremental: bool = False) -> Segment:
        worker = Worker(
            [sys.executable, str(WORKER), "--root", str(root), "--log", str(log),
             "--final", str(final), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
             "--keep-last-n", str(keep_last_n), "--mode", mode,
             "--ballast", str(self.ballast), "--slow", str(self.slow),
             *(["--incremental"] if incremental else []),
             *(["--kill-point", plan.window, "--kill-fraction", str(plan.inside)]
               if plan is not None and plan.inside is not None else [])],
            env=self.env, timeout_s=SEGMENT_TIMEOUT_S)
        if plan is None:
            code = worker.run()
        elif plan.after is None:
            code = worker.run(kill_after_s=plan.delay_s)
        else:
            code = worker.run(kill_at=plan.after, delay_s=plan.delay_s)
        died = worker.killed or any(line.startswith("DYING ") for line in worker.lines)
        return Segment(lines=worker.lines, killed=died and code == -signal.SIGKILL,
                       code=code, stderr=worker.stderr())


# ----------------------------------------------------------------------- disk checks


def read_log(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                out[int(entry["step"])] = entry["loss"]
    return out


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def step_dirs(root: Path) -> dict[int, Path]:
    recover = root / "recover"
    if not recover.is_dir():
        return {}
    return {int(d.name[5:]): d for d in recover.iterdir()
            if d.name.startswith("step_") and d.is_dir()}


def committed(root: Path) -> list[int]:
    """Committed checkpoints (a retired directory is none, whatever markers it has)."""
    return sorted(s for s, d in step_dirs(root).items() if (d / COMMIT_MARKER).exists()
                  and not (d / RETIRED_MARKER).exists())


def retired(root: Path) -> dict[int, Path]:
    return {s: d for s, d in step_dirs(root).items() if (d / RETIRED_MARKER).exists()}


def debris(root: Path) -> list[str]:
    """Everything a crashed save may leave behind and a manager start must remove (retired
    directories are checked by ``check_references``)."""
    found = [str(d) for s, d in step_dirs(root).items()
             if not (d / COMMIT_MARKER).exists() and not (d / RETIRED_MARKER).exists()]
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            if (".orbax-checkpoint-tmp" in name or name.startswith(".tmp-")
                    or name.endswith(".tmp")):
                found.append(os.path.join(dirpath, name))
    return sorted(set(found))


def classify(root: Path) -> str:
    """Which window of the save pipeline the kill landed in, judged from the disk."""
    steps = step_dirs(root)
    done = committed(root)
    newest = done[-1] if done else -1
    if any((d / COMMIT_MARKER).exists() for d in retired(root).values()):
        return "retire"
    partial = {s: d for s, d in steps.items() if s not in done and s not in retired(root)}
    if any(s < newest for s in partial):
        return "retention-delete"
    for d in partial.values():
        names = [n for _, dn, fn in os.walk(d) for n in dn + fn]
        if any(".orbax-checkpoint-tmp" in n for n in names):
            return "background-write"
        if any(n.startswith(".tmp-" + COMMIT_MARKER) for n in names):
            return "marker-write"
        if (d / "state" / "arrays").is_dir() and (d / "driver.json").exists():
            return "commit"
        return "staging"
    return "between-saves"


class _StubBackend(SingleProcess):
    """Enough of a backend to open and close a manager (its start-up cleanup needs no I/O
    from the backend), so the harness process never loads orbax."""

    name = "orbax"
    supports_async = False


def open_and_close(root: Path) -> None:
    with CheckpointManager(root, backend=_StubBackend(), preemption_signals=()):
        pass


def check_references(root: Path, where: str, *, tidied: bool) -> int:
    """Every file a committed manifest refers to is there with its recorded size (a kill in
    retention never deletes one). ``tidied`` (after a manager start): every retired directory
    holds only files a committed manifest refers to, and at least one. Returns the number
    of refs."""
    store = CheckpointStore(root)
    used: dict[int, set[str]] = collections.defaultdict(set)
    count = 0
    for step in committed(root):
        for key, entry in store.read_manifest(str(store.step_path(step))).refs.items():
            path = root / "recover" / key
            assert path.is_file() and path.stat().st_size == entry["size"], \
                f"{where}: step {step} refers to {key}, which is gone or resized"
            owner, rel = parse_ref_key(key) or (-1, key)
            used[owner].add(rel)
            count += 1
    if tidied:
        for step, path in retired(root).items():
            present = {str(f.relative_to(path)) for f in path.rglob("*") if f.is_file()}
            present -= {RETIRED_MARKER}
            assert used[step] and present <= used[step], \
                f"{where}: retired step {step} keeps {sorted(present - used[step])[:5]} " \
                f"that nothing refers to (referred: {len(used[step])})"
    return count


# -------------------------------------------------------------------------- harness


#: Windows a kill is aimed at, by weight (listed again); incremental runs add the two
#: inside retention, where the worker kills itself (a timed kill from outside rarely lands
#: in a retire or purge).
WINDOWS = ["startup", "between-saves", "staging", "background-write", "background-write",
           "commit", "commit", "retention-delete"]
INSIDE_RETENTION = ["retire", "purge", "purge"]


def random_plan(rng: random.Random, resume_from: int, incremental: bool = False) -> Plan | None:
    ahead = [s for s in SAVE_STEPS if s > resume_from]
    if not ahead:
        return None
    target = rng.choice(ahead[:3])  # near saves: short segments, many trials
    window = rng.choice(WINDOWS + (INSIDE_RETENTION if incremental else []))
    if window in INSIDE_RETENTION:  # a retire or purge follows one of the next saves
        return Plan(window, f"REPORTED {ahead[min(2, len(ahead) - 1)]}", 0.05,
                    inside=rng.random())
    if window == "startup":
        return Plan(window, None, rng.uniform(0.2, 1.5))
    if window == "between-saves":
        step = rng.randrange(resume_from + 1, target + 1)
        return Plan(window, f"STEP {step}", rng.uniform(0.0, 0.01))
    if window == "staging":
        return Plan(window, f"STEP {target}", rng.uniform(0.0, 0.02))
    if window == "background-write":
        return Plan(window, f"SAVING {target}", rng.uniform(0.0, 0.06))
    if window == "commit":
        return Plan(window, f"WRITTEN {target}", rng.uniform(0.0, 0.03))
    return Plan(window, f"REPORTED {target}", rng.uniform(0.0, 0.03))


def check_resume_and_losses(seg: Segment, log: Path, ref_losses: dict[int, str],
                            resume_from: int, before: list[int], where: str) -> None:
    """A segment resumed from exactly the newest committed checkpoint (never a partial
    one), and every loss it logged is bit-identical to the reference; no step skipped."""
    started = seg.tagged("RESUMED") or (["FRESH"] if "FRESH" in seg.lines else [])
    if started:
        got = -1 if started[0] == "FRESH" else json.loads(started[0])["step"]
        assert got == resume_from, f"{where}: resumed from {got}, newest committed " \
                                   f"was {resume_from} (on disk: {before})"
    logged = read_log(log)
    if logged:
        assert min(logged) == resume_from + 1, f"{where}: first step {min(logged)}"
        assert sorted(logged) == list(range(min(logged), max(logged) + 1)), where
    differing = {s: (v, ref_losses[s]) for s, v in logged.items() if v != ref_losses[s]}
    assert not differing, f"{where}: losses differ from the reference: {differing}"


def check_clean_end(root: Path, final: Path, ref_state: dict[str, np.ndarray],
                    keep_last_n: int, where: str, incremental: bool) -> None:
    """A chain that ran to the end: final state equals the reference byte for byte, a
    manager start leaves no debris, retention kept what it should."""
    state = load_npz(final)
    bad = sorted(k for k in ref_state if k not in state
                 or state[k].dtype != ref_state[k].dtype
                 or state[k].tobytes() != ref_state[k].tobytes())
    assert not bad and sorted(state) == sorted(ref_state), \
        f"{where}: final state differs from the reference in {bad}"
    open_and_close(root)
    assert debris(root) == [], f"{where}: debris after a clean run: {debris(root)}"
    refs = check_references(root, where, tidied=True)
    assert (refs > 0) == incremental, f"{where}: {refs} refs (incremental={incremental})"
    # Retention may lag by one deletion when the last kill landed in it and the
    # final segment had nothing left to save.
    left = committed(root)
    assert left[-1] == SAVE_STEPS[-1] and set(left) <= set(SAVE_STEPS) \
        and len(left) <= keep_last_n + 1, (where, left)


@dataclasses.dataclass
class Reference:
    """The uninterrupted run every chain is compared with (plain saves: the numerics do not
    depend on the save mode or on incremental saves)."""

    losses: dict[int, str]
    state: dict[str, np.ndarray]

    @classmethod
    def run(cls, tmp: Path) -> Reference:
        env = Env(tmp, BALLAST, SLOW)
        reference = env.run(tmp / "ref-root", mode="async", keep_last_n=2, plan=None,
                            log=tmp / "ref.jsonl", final=tmp / "ref.npz")
        assert reference.code == 0 and "DONE" in reference.lines, reference.stderr
        losses = read_log(tmp / "ref.jsonl")
        assert sorted(losses) == list(range(STEPS))
        state = load_npz(tmp / "ref.npz")
        assert any(k.endswith("|key_data") for k in state) and len(state) > BALLAST + SLOW
        return cls(losses, state)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    return Reference.run(tmp_path_factory.mktemp("crash-reference"))


def run_harness(tmp: Path, trials: int, seed: int, ref: Reference, *,
                incremental: bool = False) -> dict[str, int]:
    rng = random.Random(seed)
    tag = f"[JAXCKPT_CRASH_SEED={seed}{' incremental' if incremental else ''}]"
    env = Env(tmp, BALLAST, SLOW)
    ref_losses, ref_state = ref.losses, ref.state

    hits: collections.Counter[str] = collections.Counter()
    done_trials = 0
    chain = 0
    while done_trials < trials:
        chain += 1
        root = tmp / f"chain-{chain}"
        keep_last_n = rng.choice([1, 2])
        reported_ever = -1
        history: list[str] = []
        index = 0
        while True:
            index += 1
            before = committed(root)
            resume_from = before[-1] if before else -1
            plan = random_plan(rng, resume_from, incremental) if done_trials < trials \
                else None
            mode = rng.choice(["sync", "async"])
            log = tmp / f"chain-{chain}-{index}.jsonl"
            final = tmp / f"chain-{chain}.npz"
            seg = env.run(root, mode=mode, keep_last_n=keep_last_n, plan=plan, log=log,
                          final=final, incremental=incremental)
            where = (f"{tag} chain {chain} segment {index} ({mode}, keep_last_n={keep_last_n},"
                     f" plan {plan}); history {history}; last lines {seg.lines[-8:]}")
            history.append(f"{index}:{plan or 'to the end'}")
            if not seg.killed:
                assert seg.code == 0 and "DONE" in seg.lines, (
                    f"{where}: exit {seg.code}\n{seg.stderr}")

            check_resume_and_losses(seg, log, ref_losses, resume_from, before, where)

            reported_ever = max([reported_ever, *seg.steps("REPORTED")])
            after = committed(root)
            assert (after[-1] if after else -1) >= reported_ever, \
                f"{where}: save of step {reported_ever} was reported complete but the newest " \
                f"committed checkpoint is {after}"
            store = CheckpointStore(root)
            for step in after:
                problems = store.verify(str(store.step_path(step)))
                assert not problems, f"{where}: committed step {step} is broken: {problems}"
            check_references(root, where, tidied=False)

            if not seg.killed:
                check_clean_end(root, final, ref_state, keep_last_n, where, incremental)
                break

            done_trials += 1
            dying = seg.tagged("DYING")
            window = f"{dying[0].split()[0]}-inside" if dying else classify(root)
            hits[window] += 1
            history[-1] += f"->{window}"
            if done_trials % 2 == 0:
                open_and_close(root)
                left = debris(root)
                assert not left, f"{where}: a manager start left debris: {left}"
                assert committed(root) == after, (
                    f"{where}: start-up cleanup removed a committed checkpoint: "
                    f"{after} -> {committed(root)}")
                check_references(root, where, tidied=True)
    print(f"crash harness {tag}: {done_trials} kills over {chain} chains; "
          f"windows hit: {dict(sorted(hits.items()))}")
    return dict(hits)


def check_windows(hits: dict[str, int], seed: int) -> None:
    """The save pipeline's inner windows are the point of the exercise: at least some kills
    must have landed with a save in flight (the rest are timing-dependent, printed)."""
    in_flight = sum(hits.get(w, 0) for w in ("background-write", "commit", "marker-write",
                                             "staging"))
    assert in_flight >= 1, f"no kill landed inside a save (seed {seed}): {hits}"


@pytest.mark.timeout(400)
def test_random_sigkills_resume_bit_identical_and_never_restore_partial(tmp_path, reference):
    seed = harness_seed()
    print(f"crash harness seed {seed} (pin with JAXCKPT_CRASH_SEED={seed})")
    started = time.monotonic()
    hits = run_harness(tmp_path, TRIALS, seed, reference)
    print(f"crash harness wall time {time.monotonic() - started:.1f} s")
    check_windows(hits, seed)
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.timeout(600)
def test_random_sigkills_with_incremental_saves(tmp_path, reference):
    """The same with ``incremental=True``: kills in save, commit, retire and purge."""
    seed = harness_seed(INCREMENTAL_SEED)
    print(f"incremental crash harness seed {seed} (pin with JAXCKPT_CRASH_SEED={seed})")
    started = time.monotonic()
    hits = run_harness(tmp_path, INCREMENTAL_TRIALS, seed, reference, incremental=True)
    print(f"incremental crash harness wall time {time.monotonic() - started:.1f} s")
    check_windows(hits, seed)
    inside = sum(hits.get(w, 0) for w in ("retire-inside", "purge-inside"))
    assert inside >= 1, f"no kill inside retire or purge (seed {seed}): {hits}"
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(0)
@pytest.mark.skipif(not soak_enabled, reason="soak: set JAXCKPT_SOAK=1 or JAXCKPT_SOAK_TRIALS=N")
def test_soak_random_sigkills(tmp_path, reference):
    seed = harness_seed()
    print(f"crash soak seed {seed} (pin with JAXCKPT_CRASH_SEED={seed})")
    run_harness(tmp_path, soak_trials or 300, seed, reference)


@pytest.mark.slow
@pytest.mark.timeout(0)
@pytest.mark.skipif(not soak_enabled, reason="soak: set JAXCKPT_SOAK=1 or JAXCKPT_SOAK_TRIALS=N")
def test_soak_random_sigkills_incremental(tmp_path, reference):
    seed = harness_seed()
    print(f"incremental crash soak seed {seed} (pin with JAXCKPT_CRASH_SEED={seed})")
    run_harness(tmp_path, soak_trials or 1000, seed, reference, incremental=True)
