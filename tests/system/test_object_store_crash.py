"""A training worker on an s3:// root, SIGKILLed around the commit of a checkpoint (between
the finished upload and the marker, and right after the marker while retention deletes; the
soak variant also while its arrays upload), resumes from the newest committed checkpoint
and ends bit-identical to an uninterrupted run; no partial prefix is left behind.

The object store is a moto server this module starts on 127.0.0.1 (tests/support/
s3_server.py); the worker is tests/support/crash_worker.py, killed as a process group by
tests/support/harness.py, and finds the server through the standard AWS_* environment.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from jaxckpt.layout import COMMIT_MARKER, parse_step_dirname
from jaxckpt.root_url import parse_root

from support.harness import Worker, repo_env
from support.paths import REPO
from support.s3_server import moto_s3, server_env

BUCKET = "jaxckpt-crash"
STEPS, SAVE_EVERY, KEEP, BALLAST = 12, 3, 1, 4
LEASE = {"lease_s": 2.0, "heartbeat_s": 0.5}
WORKER = str(REPO / "tests" / "support" / "crash_worker.py")


@pytest.fixture(scope="module")
def options():
    with moto_s3(BUCKET) as opts:
        yield opts


def start(root: str, tmp: Path, name: str, env: dict[str, str]) -> Worker:
    return Worker([sys.executable, WORKER, "--root", root, "--log", str(tmp / f"{name}.jsonl"),
                   "--final", str(tmp / f"{name}.npz"), "--steps", str(STEPS),
                   "--save-every", str(SAVE_EVERY), "--keep-last-n", str(KEEP),
                   "--ballast", str(BALLAST), "--mode", "async",
                   *(["--storage-options", json.dumps(LEASE)] if "://" in root else [])],
                  env=env, cwd=REPO, timeout_s=120.0)


def load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    worker = start(str(tmp / "root"), tmp, "reference", repo_env())
    assert worker.run() == 0, worker.stderr()
    return load(tmp / "reference.npz")


def steps_on_s3(root: str, options: dict) -> tuple[list[int], list[int]]:
    """(committed steps, steps with objects but no marker) under ``root``."""
    _, storage = parse_root(root, {k: v for k, v in options.items()})
    committed, partial = [], []
    for name in storage.list_names(f"{root}/recover"):
        step = parse_step_dirname(name.rstrip("/"))
        if step is not None:
            marked = storage.exists(f"{root}/recover/{name.rstrip('/')}/{COMMIT_MARKER}")
            (committed if marked else partial).append(step)
    return committed, partial


def kill_and_resume(root: str, tmp: Path, env: dict[str, str], options: dict,
                    kills: list[str]) -> None:
    """Run the worker on ``root``, SIGKILLing it at each of ``kills`` in turn (each run
    resuming what the previous left), then to the end; check every resume point and that
    no partial prefix is left."""
    for number, kill_at in enumerate(kills):
        killed = start(root, tmp, f"killed{number}", env)
        assert killed.run(kill_at=kill_at, drain=False) == -signal.SIGKILL, killed.stderr()
        committed, _ = steps_on_s3(root, options)
        assert committed, "no checkpoint committed before the kill"  # step 2 at least
        time.sleep(LEASE["lease_s"] + 1.0)  # the killed job's lease expires
        expected_from = committed[-1]
    resumed = start(root, tmp, "resumed", env)
    assert resumed.run() == 0, resumed.stderr()
    resumed_from = json.loads(resumed.tagged("RESUMED")[0])["step"]
    assert resumed_from == expected_from, (expected_from, resumed.lines[:2])
    assert steps_on_s3(root, options)[1] == [], "partial checkpoints left behind"


def assert_matches(state: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> None:
    assert sorted(state) == sorted(reference)
    bad = [name for name in reference if state[name].tobytes() != reference[name].tobytes()
           or state[name].dtype != reference[name].dtype]
    assert not bad, f"final state differs from the uninterrupted run in {bad}"


def test_sigkill_before_and_after_the_marker_on_s3_resumes_bit_exact(options, reference,
                                                                    tmp_path):
    # Killed once between the finished upload and the marker of step 5 (it must resume from
    # step 2), and once right after the marker of step 8, while retention deletes step 5.
    root = f"s3://{BUCKET}/crash/{uuid.uuid4().hex}"
    env = server_env(options, repo_env())
    kill_and_resume(root, tmp_path, env, options, ["WRITTEN 5", "REPORTED 8"])
    assert_matches(load(tmp_path / "resumed.npz"), reference)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JAXCKPT_SOAK") != "1", reason="soak: set JAXCKPT_SOAK=1")
@pytest.mark.parametrize("kill_at", ["SAVING 5", "WRITTEN 5", "REPORTED 5"],
                         ids=["uploading", "before-marker", "after-marker"])
def test_sigkill_at_each_point_of_a_commit_on_s3_resumes_bit_exact(options, reference,
                                                                   tmp_path, kill_at):
    root = f"s3://{BUCKET}/crash/{uuid.uuid4().hex}"
    env = server_env(options, repo_env())
    kill_and_resume(root, tmp_path, env, options, [kill_at])
    assert_matches(load(tmp_path / "resumed.npz"), reference)
