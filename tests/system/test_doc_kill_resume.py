"""The training programs of README.md and docs/ resume bit-exact after a SIGKILL.

Each program is taken from its page as written (``support.doc_blocks``), so the test follows
the docs, and run by ``support/doc_program.py`` as a real process in a temporary directory:
the program runs unchanged; the wrapper announces kill points on stdout (``STEP n``, ``SAVING
n``, ``COMMITTED n``, ``FINAL SAVE``, ``FINAL SAVED``) and, when the program ends, dumps its
live state (arrays and tensors by dtype, shape and a digest of their bytes; loaders,
generators, counters, global RNGs). One uninterrupted run per program is the reference; each
case SIGKILLs a run's process group at a line, reruns the program in the same directory to
the end, and compares the dumps: equal means bit for bit, types included.

Kill points, a handful per program (CI has 2 cores): mid-epoch after a checkpoint committed
(the resumed loader continues inside an epoch), right after the checkpoint of an epoch's last
step committed (the next epoch's shuffle comes from the restored generator), while an async
save is in flight (it may or may not have committed: either way the resume is exact), and
right after the final save returned (the rerun trains no step: restore alone must give back
every value, a Linen ``TrainState.step`` as the saved array). None of them depends on whether
the final ``save(mode="sync")`` waits for an async save of the same step: when it does not,
a kill after it resumes from the checkpoint before, which must be exact too.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from support.doc_blocks import program
from support.harness import Worker, repo_env
from support.paths import REPO, SUPPORT

TIMEOUT_S = 300  # a guard against hangs; a run takes seconds

#: page, section, the program's globals that hold its state, and the kill points (a line of
#: the wrapper, and the step whose save waits for its commit, or None).
PROGRAMS = {
    # The README loops run jaxckpt.batches: `step` is unset when a rerun has no step left.
    "readme-flax": (REPO / "README.md", "Use it in a Flax loop", ("live", "loader")),
    "readme-torch": (REPO / "README.md", "Use it in a PyTorch loop", ("state", "loader")),
    "torch-md": (REPO / "docs" / "torch.md", "A training loop",
                 ("state", "loader", "sampler.generator", "info")),
    "recipes-linen": (REPO / "docs" / "recipes.md", "Flax Linen `TrainState`",
                      ("state", "step")),
}

KILLS = [
    # README Flax: saves at 24, 49, 74, 99; 8 steps per epoch.
    pytest.param("readme-flax", "STEP 30", 24, id="readme-flax-mid-epoch"),
    pytest.param("readme-flax", "SAVING 74", None, id="readme-flax-save-in-flight"),
    pytest.param("readme-flax", "FINAL SAVED", 99, id="readme-flax-after-final-save"),
    # README PyTorch: saves at 19, 39, 59, final 63; 8 steps per epoch (39 ends epoch 4).
    pytest.param("readme-torch", "STEP 21", 19, id="readme-torch-mid-epoch"),
    pytest.param("readme-torch", "COMMITTED 39", 39, id="readme-torch-epoch-end"),
    pytest.param("readme-torch", "FINAL SAVED", 59, id="readme-torch-after-final-save"),
    # docs/torch.md: saves at 19, 39, 59; 8 steps per epoch.
    pytest.param("torch-md", "STEP 45", 39, id="torch-md-next-epoch"),
    # docs/recipes.md, Linen TrainState: saves at 19, 39, 59.
    pytest.param("recipes-linen", "FINAL SAVED", 59, id="recipes-linen-after-final-save"),
]


def start(name: str, work: Path, dump: Path, *, commit_at: int | None = None) -> Worker:
    page, heading, names = PROGRAMS[name]
    script = work.parent / f"{name}.py"
    if not script.exists():
        script.write_text(program(page, heading))
    env = repo_env(JAXCKPT_DOC_COMMIT_AT=str(-1 if commit_at is None else commit_at))
    return Worker([sys.executable, str(SUPPORT / "doc_program.py"), str(script), str(dump),
                   *names], env=env, cwd=work, timeout_s=TIMEOUT_S)


def finish(worker: Worker, dump: Path) -> dict[str, list]:
    code = worker.run()
    assert code == 0, f"exit {code}; last lines {worker.lines[-5:]}\n{worker.stderr()}"
    assert worker.lines[-1] == "DONE", worker.lines[-5:]
    return json.loads(dump.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of each program, run once on first use."""
    dumps: dict[str, dict[str, list]] = {}

    def get(name: str) -> dict[str, list]:
        if name not in dumps:
            tmp = tmp_path_factory.mktemp(f"reference-{name}")
            (tmp / "work").mkdir()
            dumps[name] = finish(start(name, tmp / "work", tmp / "dump.json"), tmp / "dump.json")
        return dumps[name]

    return get


@pytest.mark.parametrize(("name", "kill_at", "commit_at"), KILLS)
def test_doc_program_killed_and_rerun_ends_bit_exact(name, kill_at, commit_at, reference,
                                                     tmp_path):
    expected = reference(name)
    work = tmp_path / "work"
    work.mkdir()
    killed = start(name, work, tmp_path / "unused.json", commit_at=commit_at)
    code = killed.run(kill_at=kill_at, drain=False)
    assert killed.lines[-1] == kill_at, (killed.lines[-5:], killed.stderr())
    assert code == -signal.SIGKILL, f"not SIGKILLed (exit {code}): {killed.stderr()}"

    dump = tmp_path / "dump.json"
    rerun = start(name, work, dump)
    got = finish(rerun, dump)
    if commit_at is not None or kill_at == "FINAL SAVED":
        assert "STEP 0" not in rerun.lines, "the rerun started from scratch"
    assert sorted(got) == sorted(expected)
    differing = sorted(path for path in expected if got[path] != expected[path])
    assert not differing, (
        f"{len(differing)} of {len(expected)} values differ from the uninterrupted run after "
        f"a kill at {kill_at!r}: {differing[:12]}; the first: {got[differing[0]]} != "
        f"{expected[differing[0]]}")
