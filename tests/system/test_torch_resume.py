"""Resume exactness of PyTorch runs under DcpCheckpointManager, in real processes.

A run SIGKILLed right after starting an async save resumes from the latest committed
checkpoint and then reproduces the uninterrupted run bit for bit: per-step losses, data order
(StatefulDataLoader with shuffling), and finally parameters, Adam state, LR scheduler, RNG and
a sharded DTensor. With 2 gloo ranks the same holds, and the 2-rank checkpoint restores in one
process (tensors reshard; the world-size change warns; the data position follows the rule in
docs/torch.md, so no sample of the epoch is seen twice or skipped).

Workers (tests/support/torch_worker.py) run in their own sessions with bounded waits; a hung or
failed worker has its whole process group killed.
"""

import json
import signal
import sys
from pathlib import Path

import pytest

from support.harness import Worker, repo_env, run_all
from support.paths import REPO, TORCH_WORKER as WORKER
from support.two_processes import free_port

TIMEOUT_S = 120
STEPS_1, STEPS_2 = 16, 14  # single process: 12 steps/epoch; 2 ranks: 6 steps/epoch
KILL_AT = 7  # right after the async save of step 7 started (saves every 4 steps: 3, 7, ...)


def launch(arg_lists: list[list[str]], *, timeout: float = TIMEOUT_S) -> list[int]:
    """Start one worker per argument list, wait for all, return their exit codes."""
    workers = [Worker([sys.executable, str(WORKER), *args], env=repo_env(), cwd=REPO,
                      timeout_s=timeout) for args in arg_lists]
    try:
        codes, outputs = run_all(workers)
    except TimeoutError:
        raise AssertionError(f"workers still running after {timeout} s: {arg_lists}") from None
    if any(code not in (0, -signal.SIGKILL) for code in codes):
        raise AssertionError(f"worker failed with exit codes {codes}:\n" + "\n---\n".join(
            out[-4000:] for out in outputs))
    return codes


def records(out: Path, label: str, rank: int = 0) -> list[dict]:
    with open(out / f"{label}.rank{rank}.jsonl") as stream:
        return [json.loads(line) for line in stream]


def steps(recs: list[dict]) -> dict[int, dict]:
    return {r["step"]: {"loss": r["loss"], "ids": r["ids"]} for r in recs if "step" in r}


def final(recs: list[dict]) -> dict:
    (last,) = [r for r in recs if "final" in r]
    return last


def check_resume_exact(out: Path, rank: int, total_steps: int) -> int:
    reference = records(out, "reference", rank)
    killed = records(out, "run", rank)
    resumed = records(out, "resume", rank)
    ref_steps = steps(reference)
    assert sorted(ref_steps) == list(range(total_steps))
    # Saving never perturbs training: the killed run matched the reference until it died.
    killed_steps = steps(killed)
    assert sorted(killed_steps) == list(range(KILL_AT + 1))
    assert all(killed_steps[s] == ref_steps[s] for s in killed_steps)
    assert not any("final" in r for r in killed)
    # The save of step 7 was in flight at the kill: resume from it if it committed, else 3.
    (start,) = [r["resumed_from"] for r in resumed if "resumed_from" in r]
    assert start in (3, KILL_AT)
    resumed_steps = steps(resumed)
    assert sorted(resumed_steps) == list(range(start + 1, total_steps))
    mismatched = [s for s in resumed_steps if resumed_steps[s] != ref_steps[s]]
    assert not mismatched, f"rank {rank}: steps {mismatched} differ after resuming at {start}"
    ref_final, res_final = final(reference), final(resumed)
    for key in ("final", "table", "rng"):
        assert res_final[key] == ref_final[key], f"rank {rank}: {key} differs"
    return start


def worker_args(phase: str, root: Path, out: Path, **options) -> list[str]:
    args = ["--phase", phase, "--root", str(root), "--out", str(out)]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def test_sigkilled_run_resumes_bit_exactly(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    root = tmp_path / "ckpt"
    codes = launch([worker_args("train", root, out, reference_root=tmp_path / "ref",
                                kill_at=KILL_AT, steps=STEPS_1)])
    assert codes == [-signal.SIGKILL]
    launch([worker_args("train", root, out, label="resume", steps=STEPS_1)])
    check_resume_exact(out, 0, STEPS_1)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """2 gloo ranks: reference run, a run SIGKILLed at step 7 (both ranks), the resume."""
    base = tmp_path_factory.mktemp("two_ranks")
    out, root = base / "out", base / "ckpt"
    out.mkdir()

    def ranks(**options):
        port = free_port()
        return [worker_args("train", root, out, world=2, rank=rank, port=port,
                            steps=STEPS_2, **options) for rank in range(2)]

    codes = launch(ranks(reference_root=base / "ref", kill_at=KILL_AT))
    assert codes == [-signal.SIGKILL, -signal.SIGKILL]
    launch(ranks(label="resume"))
    return base


def test_two_rank_run_sigkilled_resumes_bit_exactly(two_rank_run):
    out = two_rank_run / "out"
    starts = {check_resume_exact(out, rank, STEPS_2) for rank in range(2)}
    assert len(starts) == 1  # both ranks resumed from the same checkpoint
    # The ranks saw different data (DistributedSampler) and kept their own RNG streams.
    ref0, ref1 = steps(records(out, "reference", 0)), steps(records(out, "reference", 1))
    assert ref0[0]["ids"] != ref1[0]["ids"]
    assert final(records(out, "reference", 0))["rng"] != final(records(out, "reference", 1))["rng"]


def test_two_rank_checkpoint_restores_on_one_rank_without_repeating_data(two_rank_run):
    out, root = two_rank_run / "out", two_rank_run / "ckpt"
    launch([worker_args("reshard", root, out, world=2, steps=STEPS_2)])
    (restored, *continued) = records(out, "reshard")
    assert restored["restored"]["global_step"] == STEPS_2 - 1
    # Tensors resharded: the one-process state equals the 2-rank run's final state (rank 0
    # for per-rank views; the model, Adam state and scheduler are replicated).
    rank0_final = final(records(out, "resume", 0))
    for key in ("params", "optimizer", "scheduler"):
        assert restored["digests"][key] == rank0_final["final"][key], key
    assert restored["table"] == rank0_final["table"]  # the DTensor, gathered from 2 shards
    assert any("saved by 2 process(es) and is restored by 1" in w for w in restored["warnings"])
    # Data: the epoch in progress at the save (epoch 2: steps 12 and 13, both ranks) plus what
    # the single process reads after it is exactly one pass over the data set.
    seen = []
    for rank in range(2):
        resumed = steps(records(out, "resume", rank))
        seen += [i for s in (12, 13) for i in resumed[s]["ids"]]
    after = [i for record in continued for i in record["ids"]]
    assert len(after) == 48 - len(seen) == 32
    assert sorted(seen + after) == list(range(48))
