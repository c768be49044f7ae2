"""A training worker on an object-store root (s3:// and gs://), SIGKILLed at each point of a
checkpoint's commit, resumes from the newest committed checkpoint and ends bit-identical to
an uninterrupted run; every committed checkpoint verifies after every kill, and the partial
prefix a kill leaves is ignored by the next job and deleted by its primary.

The kill points, in the order a save passes them (``KILLS``):

- ``uploading``: the first array object of the step is stored, the others are still being
  written (the worker kills itself inside the storage's write);
- ``before-manifest``: the backend's write finished (the worker's ``WRITTEN`` line); the
  commit has not yet listed and checksummed the files;
- ``before-marker``: the manifest is built from every file, the create-only marker is about
  to be sent (the worker kills itself inside the storage's create). On an object store the
  manifest is the marker (one ``COMMITTED`` object), so the store sees what it saw before
  the manifest: a prefix without a marker;
- ``after-marker``: the save is reported committed; retention is deleting the step before;
- ``random``: (soak) a random moment after the save started, anywhere from staging to
  retention or past it into the next steps.

The servers are the module's own on 127.0.0.1 (``support.object_stores``: moto for s3://,
the GCS emulator behind its precondition proxy for gs://); the worker
(tests/support/crash_worker.py), killed as a process group by tests/support/harness.py,
finds them through the standard environment (``AWS_*``, ``STORAGE_EMULATOR_HOST``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from jaxckpt.commit.store import CheckpointStore

from support.harness import Worker, repo_env
from support.object_stores import KINDS, ObjectStore, object_store
from support.paths import CRASH_WORKER, REPO

BUCKET = "jaxckpt-crash"
STEPS, SAVE_EVERY, KEEP, BALLAST = 12, 3, 1, 4  # saves at steps 2, 5, 8, 11
# A lease far longer than a run: each run starts at once after the kill of the one before,
# as a restarting scheduler does; the killed job's lease is taken over at once (its process
# on this host is gone), never waited out.
LEASE = {"lease_s": 60.0, "heartbeat_s": 0.5}


@dataclasses.dataclass(frozen=True)
class Kill:
    """Where one run dies: ``point`` (module docstring) of the save of ``step``."""

    point: str
    step: int
    delay_s: float = 0.0  # after the line (line-timed points only)

    def args(self) -> list[str]:
        """The worker's own kill (exact points), or none (the harness kills at a line)."""
        inside = {"uploading": "uploading", "before-marker": "marker"}.get(self.point)
        return [] if inside is None else ["--kill-point", inside, "--kill-step", str(self.step)]

    def line(self) -> str | None:
        """The stdout line at which the harness SIGKILLs the worker, if it does."""
        tag = {"before-manifest": "WRITTEN", "after-marker": "REPORTED",
               "random": "SAVING"}.get(self.point)
        return None if tag is None else f"{tag} {self.step}"


KILLS = [Kill("uploading", 5), Kill("before-manifest", 5), Kill("before-marker", 5),
         Kill("after-marker", 5)]
# The default run kills at step 5 (it resumes from 2), then on s3:// at step 8 as before;
# on gs://, kept short, once: as the marker is about to be created (the DCP trial's default
# kills there after the marker: tests/system/test_dcp_object_store_crash.py). Every point on
# both stores, and random moments, are the soak's.
CHAINS = {"s3": [Kill("before-manifest", 5), Kill("after-marker", 8)],
          "gs": [Kill("before-marker", 5)]}


@pytest.fixture(scope="module", params=KINDS)
def store(request):
    with object_store(request.param, BUCKET) as running:
        yield running


def start(root: str, tmp: Path, name: str, env: dict[str, str], *extra: str) -> Worker:
    return Worker([sys.executable, str(CRASH_WORKER), "--root", root, "--log",
                   str(tmp / f"{name}.jsonl"), "--final", str(tmp / f"{name}.npz"),
                   "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--keep-last-n",
                   str(KEEP), "--ballast", str(BALLAST), "--mode", "async",
                   *(["--storage-options", json.dumps(LEASE)] if "://" in root else []),
                   *extra], env=env, cwd=REPO, timeout_s=120.0)


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    worker = start(str(tmp / "root"), tmp, "reference", repo_env())
    assert worker.run() == 0, worker.stderr()
    return load(tmp / "reference.npz")


def assert_committed_verify(store: ObjectStore, root: str, committed: list[int]) -> None:
    checkpoints = CheckpointStore(root, storage=store.storage(root))
    problems = {step: checkpoints.verify(checkpoints.step_path(step)) for step in committed}
    assert not any(problems.values()), f"a committed checkpoint does not verify: {problems}"


def resumed_from(worker: Worker) -> int | None:
    tagged = worker.tagged("RESUMED")
    return json.loads(tagged[0])["step"] if tagged else None


def assert_took_over_at_once(worker: Worker, after_a_kill: bool) -> None:
    """A run started right after a SIGKILL took the killed run's lease over without waiting
    for it (the lease lasts a minute; the killed process is gone from this host)."""
    if after_a_kill:
        said = worker.stderr(limit=1 << 20)
        assert "its process on this host is gone" in said and "waiting up to" not in said, said


def kill_and_resume(store: ObjectStore, root: str, tmp: Path, kills: list[Kill]) -> None:
    """Run the worker on ``root``, SIGKILLed at each of ``kills`` in turn (each run resuming
    what the previous left), then to the end. After each kill: the committed checkpoints all
    verify, the killed step is partial (or committed, after the marker) and the next run
    resumes from the newest committed one; at the end no partial prefix is left."""
    env = repo_env(**store.env)
    expected_from = None
    was_killed = False
    for number, kill in enumerate(kills):
        killed = start(root, tmp, f"killed{number}", env, *kill.args())
        line = kill.line()
        code = killed.run(kill_at=line, delay_s=kill.delay_s, drain=line is None)
        assert code == -signal.SIGKILL or (kill.point == "random" and code == 0), \
            (kill, killed.lines[-5:], killed.stderr())
        assert resumed_from(killed) == expected_from, (kill, killed.lines[:2])
        assert_took_over_at_once(killed, was_killed)
        was_killed = code == -signal.SIGKILL
        committed, partial = store.steps(root)
        assert committed, "no checkpoint committed before the kill"  # step 2 at least
        assert_committed_verify(store, root, committed)
        if kill.point in ("uploading", "before-marker"):
            assert kill.step in partial and kill.step not in committed, (kill, store.steps(root))
        elif kill.point == "after-marker":
            assert kill.step in committed, (kill, committed)
        # (before-manifest, random: the commit may or may not have got through.)
        expected_from = committed[-1]
    resumed = start(root, tmp, "resumed", env)
    assert resumed.run() == 0, resumed.stderr()
    assert resumed_from(resumed) == expected_from, resumed.lines[:2]
    assert_took_over_at_once(resumed, was_killed)
    committed, partial = store.steps(root)
    assert partial == [], "partial checkpoints left behind"
    assert committed[-1] == STEPS - 1, committed
    assert_committed_verify(store, root, committed)


def assert_matches(state: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert sorted(state) == sorted(reference)
    bad = [name for name in reference if state[name].tobytes() != reference[name].tobytes()
           or state[name].dtype != reference[name].dtype]
    assert not bad, f"final state differs from the uninterrupted run in {bad}"


def test_sigkill_around_a_commit_resumes_bit_exact(store, reference, tmp_path):
    root = store.url(f"crash/{uuid.uuid4().hex}")
    kill_and_resume(store, root, tmp_path, CHAINS[store.kind])
    assert_matches(load(tmp_path / "resumed.npz"), reference)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JAXCKPT_SOAK") != "1", reason="soak: set JAXCKPT_SOAK=1")
@pytest.mark.parametrize("kill", KILLS, ids=lambda kill: kill.point)
def test_sigkill_at_each_point_of_a_commit_resumes_bit_exact(store, reference, tmp_path, kill):
    root = store.url(f"crash/{uuid.uuid4().hex}")
    kill_and_resume(store, root, tmp_path, [kill])
    assert_matches(load(tmp_path / "resumed.npz"), reference)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JAXCKPT_SOAK") != "1", reason="soak: set JAXCKPT_SOAK=1")
def test_sigkill_at_random_moments_resumes_bit_exact(store, reference, tmp_path):
    # Each trial: a fresh root, a kill at a random moment of the save of step 5 or 8 (or
    # after it), then a run to the end. A failing trial names its seed.
    trials = int(os.environ.get("JAXCKPT_SOAK_TRIALS") or 6)
    seed = int(os.environ.get("JAXCKPT_CRASH_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    for trial in range(trials):
        kill = Kill("random", rng.choice([5, 8]), rng.uniform(0.0, 1.5))
        tmp = tmp_path / str(trial)
        tmp.mkdir()
        root = store.url(f"crash/{uuid.uuid4().hex}")
        try:
            kill_and_resume(store, root, tmp, [kill])
            assert_matches(load(tmp / "resumed.npz"), reference)
        except AssertionError as exc:
            raise AssertionError(f"trial {trial} ({kill}) of JAXCKPT_CRASH_SEED={seed}: "
                                 f"{exc}") from exc
