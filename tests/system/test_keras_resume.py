"""Keras 3 (JAX backend) ``model.fit`` under jaxckpt's BackupAndRestore, in real processes.

One chain of runs of the same ``fit`` on one root, SIGKILLed at an epoch boundary (after the
epoch-end checkpoint committed), mid-epoch (a mid-epoch checkpoint committed, later batches
trained) and while an asynchronous save is in flight, then run to the end, reproduces an
uninterrupted run bit for bit: every logged per-batch loss (a running mean over the epoch, so
the metrics state too), and the final weights, Dropout seed state, optimizer and metric
variables. Each resumed run starts at the batch after its checkpoint (Keras's own
BackupAndRestore restarts the epoch at batch 0). Workers: tests/support/keras_worker.py.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from support import kill_points
from support.harness import Worker, repo_env
from support.paths import KERAS_WORKER, REPO

pytestmark = pytest.mark.skipif(importlib.util.find_spec("keras") is None,
                                reason="needs the keras extra")
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    # The runs share JAX's compilation cache: only the first ones compile the train step.
    cache = tmp_path_factory.mktemp("jax_cache")
    return repo_env(JAX_COMPILATION_CACHE_DIR=str(cache),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


@pytest.fixture(scope="module")
def reference(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """The uninterrupted run, started at once so that it runs beside the kill chain."""
    out = tmp_path_factory.mktemp("keras_reference") / "final.npz"
    with Worker([sys.executable, str(KERAS_WORKER), "--out", str(out)], env=env, cwd=REPO,
                timeout_s=TIMEOUT_S) as worker:
        worker.out = out  # type: ignore[attr-defined]
        yield worker


def losses(lines: list[str]) -> list[tuple[tuple[int, int], str]]:
    found = []
    for line in lines:
        if line.startswith("LOSS "):
            _, epoch, batch, value = line.split()
            found.append(((int(epoch), int(batch)), value))
    return found


def test_killed_fit_resumes_bit_exact(reference: Worker, env: dict[str, str],
                                      tmp_path: Path) -> None:
    root, out = tmp_path / "root", tmp_path / "final.npz"
    base = [sys.executable, str(KERAS_WORKER), "--root", str(root), "--out", str(out)]
    in_flight = dict(env, JAXCKPT_KILL_POINT=kill_points.spec(0, "writing", 14))
    # 6 batches an epoch, a checkpoint every 3 steps (global steps 2, 5, 8, 11, 14, 17).
    runs = [
        (["--kill-at", "epoch_end:0"], env, "KILL_HERE"),  # newest: step 5, an epoch end
        (["--kill-at", "batch:10"], env, "KILL_HERE"),     # newest: step 8, mid-epoch
        ([], in_flight, None),                             # dies writing step 14
        ([], env, None),                                   # to the end
    ]
    chain = []
    for extra, run_env, marker in runs:
        worker = Worker([*base, *extra], env=run_env, cwd=REPO, timeout_s=TIMEOUT_S)
        code = worker.run(kill_at=marker)
        chain.append(worker)
        expected = 0 if extra == [] and run_env is env else -signal.SIGKILL
        assert code == expected, (code, worker.lines[-5:], worker.stderr())
    assert reference.finish() == 0, reference.stderr()

    refused = {line.split()[1]: line for line in reference.lines if line.startswith("REFUSED")}
    assert set(refused) == {"both", "every", "internals"}, reference.lines[:5]
    assert "recover=RecoverConfig(every=" in refused["both"]
    assert "jaxckpt.Every" in refused["every"]
    assert "_initial_epoch" in refused["internals"] and "Keras 3.15" in refused["internals"]

    wanted = dict(losses(reference.lines))
    assert len(wanted) == 18
    for worker in chain:
        for key, value in losses(worker.lines):
            assert value == wanted[key], (key, worker.lines)
    # Each rerun starts right after the newest committed checkpoint, not at batch 0.
    firsts = [losses(worker.lines)[0][0] for worker in chain]
    assert firsts[:3] == [(0, 0), (1, 0), (1, 3)], firsts
    assert firsts[3] in ((1, 3), (2, 0)), firsts  # step 14 never committed: 11 or 8
    assert {key for worker in chain for key, _ in losses(worker.lines)} == set(wanted)

    with np.load(reference.out) as ref, np.load(out) as got:  # type: ignore[attr-defined]
        assert sorted(ref.files) == sorted(got.files)
        for name in ref.files:
            assert ref[name].dtype == got[name].dtype
            assert ref[name].tobytes() == got[name].tobytes(), name


def test_another_keras_backend_is_refused_naming_the_setting() -> None:
    import subprocess

    program = ("import jaxckpt.integrations.keras\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=REPO, env=repo_env(KERAS_BACKEND="torch"), timeout=120)
    assert done.returncode == 1
    assert "jaxckpt.errors.ConfigError" in done.stderr
    assert "KERAS_BACKEND=jax" in done.stderr and "'torch'" in done.stderr
