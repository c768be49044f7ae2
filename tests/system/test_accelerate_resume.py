"""The Accelerate recipe of docs/integrations.md, SIGKILLed at three points and rerun: the
final weights, optimizer state and the loss of every step are bitwise those of a run never
interrupted (mid-epoch through ``skip_first_batches``, at an epoch end, and with a save in
flight)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from support.harness import Worker, repo_env
from support.paths import SUPPORT

WORKER = SUPPORT / "accelerate_worker.py"
pytest.importorskip("accelerate")


def _run(root: Path, out: Path, *args: str, kill_at=None) -> Worker:
    worker = Worker([sys.executable, str(WORKER), str(root), str(out), *args], env=repo_env(),
                    timeout_s=180)
    status = worker.run(kill_at)
    expected = 0 if kill_at is None else -signal.SIGKILL
    assert status == expected, (worker.lines[-10:], worker.stderr())
    return worker


def _after(*needed: str):
    seen: set[str] = set()

    def at(line: str) -> bool:
        seen.add(line)
        return seen.issuperset(needed)
    return at


def _losses(workers: list[Worker]) -> dict[str, str]:
    out: dict[str, str] = {}
    for worker in workers:
        for text in worker.tagged("LOSS"):
            step, value = text.split()
            out[step] = value  # a step run again after a kill: the last one counts
    return out


def test_sigkilled_accelerate_loop_resumes_bit_exactly(tmp_path):
    reference = _run(tmp_path / "reference", tmp_path / "reference.safetensors")
    root, out = tmp_path / "run", tmp_path / "run.safetensors"
    chain = [  # mid-epoch; at the epoch end; with save 8 in flight
        _run(root, out, "--await-commit", "2:4", kill_at=_after("COMMITTED 2", "STEP 4")),
        _run(root, out, "--await-commit", "5:5", kill_at=_after("COMMITTED 5", "STEP 5")),
        _run(root, out, "--hold-s", "5", kill_at="SAVED 8"),
    ]
    chain.append(_run(root, out))
    assert [worker.tagged("START") for worker in chain] == [["0"], ["3"], ["6"], ["6"]]
    assert _losses(chain) == _losses([reference])
    assert len(_losses([reference])) == 12
    got, want = load_file(out), load_file(tmp_path / "reference.safetensors")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].tobytes() == value.tobytes(), name


def test_the_accelerate_bench_row_runs_both_ways(tmp_path):
    from jaxckpt.tools.bench.rows_accelerate import accelerate_rows

    row = accelerate_rows(str(tmp_path), hidden=8, layers=1, steps=6, save_every=2, rounds=1)
    assert row["saves"] == 3
    assert set(row["lost_s"]) == {"accelerate", "jaxckpt", "jaxckpt-blocking"}
    assert len(row["lost_rounds_s"]["jaxckpt"]) == 1
    assert row["lost_s"]["accelerate"] > 0 and row["loop_s"]["jaxckpt"] > 0
    assert list(tmp_path.iterdir()) == []  # its checkpoints are removed after
