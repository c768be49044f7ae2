"""The user story: a training run SIGKILLed at any moment and resumed ends bit-identical to a
run that was never interrupted.

Each case runs the real training worker (``python -m jaxckpt.tools.demo worker``) in its own
process session, SIGKILLs its process group at a chosen line of its stdout, then starts a
fresh worker on the same root. Losses are compared as ``float.hex`` strings and the final
params, optimizer state and dropout PRNG key data byte for byte against one uninterrupted
reference run (async saves) per module.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

from support.harness import Worker, repo_env
from support.paths import REPO

STEPS = 40
SAVE_EVERY = 10
STEPS_PER_EPOCH = 16  # epochs roll over at steps 16 and 32: the loader reshuffles mid-run
WORKER_TIMEOUT_S = 120.0


def start_worker(log: Path, root: Path, *, mode: str = "async",
                 hold_save_at: int | None = None) -> Worker:
    """One demo worker on ``root`` in its own session (support.harness)."""
    return Worker(
        [sys.executable, "-m", "jaxckpt.tools.demo", "worker", "--root", str(root),
         "--log", str(log), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
         "--steps-per-epoch", str(STEPS_PER_EPOCH), "--mode", mode,
         *([] if hold_save_at is None else ["--hold-save-at", str(hold_save_at)])],
        env=repo_env(), cwd=REPO, timeout_s=WORKER_TIMEOUT_S)


def read_log(path: Path) -> dict[int, str]:
    steps: dict[int, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            steps[entry["step"]] = entry["loss"]
    return steps


def step_dirs(root: Path, *, committed: bool) -> list[int]:
    """Steps whose directory has (committed=True) or lacks (False) the commit marker."""
    recover = root / "recover"
    if not recover.is_dir():
        return []
    return sorted(int(d.name[5:]) for d in recover.iterdir()
                  if d.name.startswith("step_") and (d / "COMMITTED").exists() == committed)


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


@pytest.fixture(scope="module")
def reference(
        tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], dict[str, np.ndarray]]:
    tmp = tmp_path_factory.mktemp("reference")
    worker = start_worker(tmp / "ref.jsonl", tmp / "root")
    code = worker.run()
    assert code == 0, worker.stderr()
    losses = read_log(tmp / "ref.jsonl")
    assert sorted(losses) == list(range(STEPS))
    assert "FRESH" in worker.lines
    return losses, load_npz(tmp / "ref.final.npz")


def check_exact_resume(tmp: Path, reference: tuple[dict[int, str], dict[str, np.ndarray]], *,
                       kill_at: str, mode: str = "async",
                       hold_save_at: int | None = None) -> tuple[int | None, list[int]]:
    """Kill at ``kill_at``, resume, compare with the reference. Returns the step resumed
    from (None: from scratch) and the steps whose directory was partial after the kill."""
    ref_losses, ref_state = reference
    root = tmp / "root"
    killed = start_worker(tmp / "killed.jsonl", root, mode=mode, hold_save_at=hold_save_at)
    code = killed.run(kill_at=kill_at, drain=False)
    assert killed.lines and killed.lines[-1] == kill_at, (killed.lines[-5:], killed.stderr())
    assert code == -signal.SIGKILL, f"worker was not SIGKILLed (exit {code}): {killed.stderr()}"
    on_disk = step_dirs(root, committed=True)
    partial = step_dirs(root, committed=False)

    resumed = start_worker(tmp / "resumed.jsonl", root, mode=mode)
    assert resumed.run() == 0, resumed.stderr()
    resumed_from = (json.loads(resumed.tagged("RESUMED")[0])["step"]
                    if resumed.tagged("RESUMED") else None)
    # It must resume from the newest checkpoint that had committed when the process died.
    assert resumed_from == (on_disk[-1] if on_disk else None), (on_disk, resumed.lines[:2])

    killed_log, resumed_log = read_log(tmp / "killed.jsonl"), read_log(tmp / "resumed.jsonl")
    first = 0 if resumed_from is None else resumed_from + 1
    assert sorted(resumed_log) == list(range(first, STEPS))
    assert set(killed_log) | set(resumed_log) == set(range(STEPS))
    differing = {step: (loss, ref_losses[step]) for log in (killed_log, resumed_log)
                 for step, loss in log.items() if loss != ref_losses[step]}
    assert not differing, f"losses differ from the uninterrupted run at steps {differing}"

    state = load_npz(tmp / "resumed.final.npz")
    assert sorted(state) == sorted(ref_state)
    assert any(name.endswith("|key_data") for name in state), "no PRNG key in the state"
    bad = [name for name in ref_state
           if state[name].dtype != ref_state[name].dtype
           or state[name].shape != ref_state[name].shape
           or state[name].tobytes() != ref_state[name].tobytes()]
    assert not bad, f"final state differs from the uninterrupted run in {bad}"
    assert step_dirs(root, committed=False) == [], "partial checkpoints left behind"
    return resumed_from, partial


def test_kill_before_first_save_restarts_from_scratch_exactly(tmp_path, reference):
    assert check_exact_resume(tmp_path, reference, kill_at="STEP 3") == (None, [])


def test_kill_while_async_save_in_flight_resumes_from_previous_checkpoint(tmp_path, reference):
    # The worker's test hook holds the commit of step 19 back (60 s), so that save is
    # certainly uncommitted (its directory partial) when the process dies.
    resumed_from, partial = check_exact_resume(tmp_path, reference, kill_at="SAVING 19",
                                               hold_save_at=19)
    assert (resumed_from, partial) == (9, [19])


def test_kill_right_after_saving_line_resumes_exactly(tmp_path, reference):
    # No hold: the async write of step 29 races the kill, as in a real crash.
    resumed_from, partial = check_exact_resume(tmp_path, reference, kill_at="SAVING 29")
    assert resumed_from in (19, 29)
    # 29 was partial exactly when it did not commit (step 9 may also be mid-deletion).
    assert (29 in partial) == (resumed_from == 19)


def test_kill_after_epoch_rollover_resumes_exactly(tmp_path, reference):
    resumed_from, _ = check_exact_resume(tmp_path, reference, kill_at="STEP 34")
    assert resumed_from in (19, 29)


def test_sync_mode_kill_after_save_resumes_from_it_and_matches_async_run(tmp_path, reference):
    # A sync save has committed before maybe_save returns, so SAVING 19 means step 19 is safe;
    # the checkpoint mode must not change the numerics either.
    assert check_exact_resume(tmp_path, reference, kill_at="SAVING 19", mode="sync") == (19, [])
