"""The data position across world sizes, with real processes: a data-parallel loop of 4 (or 2)
processes, each reading its slice of every global batch from a jaxckpt.IndexSampler and
checkpointing through a real CheckpointManager, is SIGKILLed mid-epoch and resumed by 2 (or
4) processes. What was trained before the kill (up to the checkpoint resumed from) and after
it is exactly what one uninterrupted run reads: each kept sample of an epoch once, in the
same order.

The processes meet through support.file_group (files for barriers and broadcasts) rather than
jax.distributed or a gloo group, which would cost seconds of imports per process here; the
manager, driver state, commit and recovery are the library's own. The slow variant
(JAXCKPT_SOAK=1) runs the same with DcpCheckpointManager in a gloo group. Processes added by the
resume (2 -> 4) have no saved local state of their own: they get the position from the
primary's copy, which is what the sampler's global state scope is for.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxckpt import IndexSampler

from support.harness import Worker, repo_env, run_all
from support.paths import REPO, SAMPLER_WORKER
from support.two_processes import free_port

SAMPLES, GLOBAL_BATCH, SEED = 52, 8, 11  # as in support/sampler_worker.py
EPOCH = SAMPLES // GLOBAL_BATCH
TOTAL = 2 * EPOCH


def launch(root: Path, sync: Path, count: int, kill_at: int | None = None, *,
           dcp: bool = False) -> list[list[str]]:
    """Run ``count`` workers to TOTAL steps (or to their SIGKILL at ``kill_at``); each one's
    stdout lines. ``dcp``: DcpCheckpointManager in a gloo group instead of the file group."""
    extra = [] if kill_at is None else ["--kill-at", str(kill_at)]
    if dcp:
        extra += ["--dcp", str(free_port())]
    workers = [Worker([sys.executable, str(SAMPLER_WORKER), str(root), str(sync), str(index),
                       str(count), str(TOTAL), *extra], env=repo_env(), cwd=REPO,
                      timeout_s=300 if dcp else 120)
               for index in range(count)]
    codes, outputs = run_all(workers)
    expected = 0 if kill_at is None else -9
    assert codes == [expected] * count, "\n".join(output[-3000:] for output in outputs)
    return [worker.lines for worker in workers]


def global_batches(lines_per_process: list[list[str]]) -> dict[int, list[int]]:
    """Global step -> the global batch, assembled from every process's slice in order."""
    slices: dict[int, list[list[int]]] = {}
    for index, lines in enumerate(lines_per_process):
        for line in lines:
            if line.startswith("BATCH "):
                record = json.loads(line[len("BATCH "):])
                parts = slices.setdefault(record["step"], [])
                assert len(parts) == index, f"step {record['step']} twice on process {index}"
                assert len(record["indices"]) == GLOBAL_BATCH // len(lines_per_process)
                parts.append(record["indices"])
    assert all(len(parts) == len(lines_per_process) for parts in slices.values())
    return {step: [index for part in parts for index in part]
            for step, parts in sorted(slices.items())}


def uninterrupted() -> list[list[int]]:
    sampler = IndexSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)
    return [next(sampler).tolist() for _ in range(TOTAL)]


RESHARDS = [(4, 2, 4), (2, 4, 8)]
RESHARD_IDS = ["4to2_epoch0", "2to4_epoch1"]


@pytest.mark.parametrize("before,after,kill_at", RESHARDS, ids=RESHARD_IDS)
def test_a_killed_run_resumed_on_another_process_count_reads_each_sample_once_in_order(
        tmp_path, before, after, kill_at):
    check_kill_and_reshard(tmp_path, before, after, kill_at, dcp=False)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JAXCKPT_SOAK") != "1",
                    reason="slow (6 torch processes a launch): set JAXCKPT_SOAK=1")
@pytest.mark.parametrize("before,after,kill_at", RESHARDS, ids=RESHARD_IDS)
def test_the_same_with_the_torch_manager_in_a_gloo_group(tmp_path, before, after, kill_at):
    check_kill_and_reshard(tmp_path, before, after, kill_at, dcp=True)


def check_kill_and_reshard(tmp_path: Path, before: int, after: int, kill_at: int, *,
                           dcp: bool) -> None:
    root = tmp_path / "root"
    first = global_batches(launch(root, tmp_path / "sync1", before, kill_at=kill_at, dcp=dcp))
    assert sorted(first) == list(range(kill_at + 1))  # killed mid-epoch, after step kill_at
    second_lines = launch(root, tmp_path / "sync2", after, dcp=dcp)
    resumed = {line for lines in second_lines for line in lines if line.startswith("RESUMED")}
    assert resumed == {f"RESUMED {kill_at - 1}"}, second_lines  # the last save before the kill
    second = global_batches(second_lines)
    assert sorted(second) == list(range(kill_at, TOTAL))
    # The step trained twice (after the checkpoint, before the kill) read the same samples.
    assert second[kill_at] == first[kill_at]
    trained = [first[step] for step in range(kill_at)] + [second[step] for step in second]
    assert trained == uninterrupted()
    for epoch in (trained[:EPOCH], trained[EPOCH:]):
        flat = np.concatenate(epoch)
        assert len(set(flat.tolist())) == EPOCH * GLOBAL_BATCH and flat.max() < SAMPLES
