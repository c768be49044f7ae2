"""A PyTorch training worker (tests/support/torch_worker.py, DcpCheckpointManager) on an
object-store root (s3:// and gs://), SIGKILLed at each point of a checkpoint's commit in
turn: once the write of step 7 finished but before its marker (it resumes from step 3),
right after the marker of step 11 while retention runs (it resumes from 11), and right after
the async save of step 15 started, while its files upload (it resumes from 11 or 15). Every
run matches an uninterrupted run step for step (losses, data order) until it dies (an async
save lets it train on while the commit runs), the last one ends with the same parameters,
Adam state, scheduler and RNG, and no partial prefix is left behind. Two gloo ranks killed
mid-save on an object-store root resume bit-exact too (on gs:// in the soak only). The
servers are started by this module on 127.0.0.1 (tests/support/object_stores.py: moto for
s3://, the GCS emulator behind its precondition proxy for gs://)."""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchdata")

from support.harness import Worker, repo_env, run_all  # noqa: E402
from support.object_stores import KINDS, object_store  # noqa: E402
from support.paths import REPO, TORCH_WORKER  # noqa: E402
from support.two_processes import free_port  # noqa: E402

BUCKET = "jaxckpt-dcp-crash"
LEASE = {"lease_s": 2.0, "heartbeat_s": 0.5}
STEPS = 20  # saves at steps 3, 7, 11, 15, 19
# (kill point, step, the steps the next run may resume from)
KILLS = [("written", 7, {3}), ("committed", 11, {11}), ("saving", 15, {11, 15})]


SOAK = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("JAXCKPT_SOAK") != "1",
                                             reason="soak: set JAXCKPT_SOAK=1")]


@pytest.fixture(scope="module", params=KINDS)
def store(request):
    if request.param not in KINDS:
        pytest.skip(f"the {request.param} client or server is not installed")
    with object_store(request.param, BUCKET) as running:
        yield running


@pytest.fixture
def options(store):
    return {**store.storage_options, **LEASE}


def run(args: list[str]) -> int:
    worker = Worker([sys.executable, str(TORCH_WORKER), *args], env=repo_env(), cwd=REPO,
                    timeout_s=120.0)
    code = worker.run()
    assert code in (0, -signal.SIGKILL), worker.stderr()
    return code


def records(out: Path, label: str, rank: int = 0) -> list[dict]:
    with open(out / f"{label}.rank{rank}.jsonl") as stream:
        return [json.loads(line) for line in stream]


def steps(recs: list[dict]) -> dict[int, dict]:
    return {r["step"]: {"loss": r["loss"], "ids": r["ids"]} for r in recs if "step" in r}


# On gs:// the default run kills once, after the marker while retention runs (the JAX trial
# kills there during the upload and before the marker); the soak kills at all three.
@pytest.mark.parametrize("store, kills", [("s3", KILLS), ("gs", [KILLS[1]]),
                                          pytest.param("gs", KILLS, marks=SOAK)],
                         indirect=["store"], ids=["s3", "gs", "gs-every-point"])
def test_sigkill_before_after_and_during_a_commit_resumes_bit_exact(store, kills, options,
                                                                    tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    root = store.url(f"runs/{uuid.uuid4().hex}")
    common = ["--phase", "train", "--root", root, "--out", str(out), "--steps", str(STEPS),
              "--storage-options", json.dumps(options)]
    reference: dict[int, dict] = {}
    start = -1
    for number, (point, step, resume_from) in enumerate(kills):
        extra = ["--reference-root", str(tmp_path / "ref")] if number == 0 else []
        label = f"killed{number}"
        assert run([*common, *extra, "--label", label, "--kill-point", point,
                    "--kill-at", str(step)]) == -signal.SIGKILL
        if number == 0:
            reference = steps(records(out, "reference"))
            assert sorted(reference) == list(range(STEPS))
        recs = records(out, label)
        if number > 0:
            (resumed_from,) = [r["resumed_from"] for r in recs if "resumed_from" in r]
            assert resumed_from == start
        done = steps(recs)
        # Training goes on while an async save commits: a run may get past ``step``.
        assert sorted(done) == list(range(start + 1, max(done) + 1)), (point, sorted(done))
        assert max(done) >= step
        assert all(done[s] == reference[s] for s in done), f"run {label} left the reference"
        committed, _ = store.steps(root)
        start = committed[-1]
        assert start in resume_from, (point, committed)
        # Restarted at once: the killed job's lease is taken over (its process is gone).
    assert run([*common, "--label", "resume"]) == 0
    recs = records(out, "resume")
    assert [r["resumed_from"] for r in recs if "resumed_from" in r] == [start]
    done = steps(recs)
    assert sorted(done) == list(range(start + 1, STEPS))
    assert all(done[s] == reference[s] for s in done)
    (ref_final,) = [r for r in records(out, "reference") if "final" in r]
    (res_final,) = [r for r in recs if "final" in r]
    for key in ("final", "table", "rng"):
        assert res_final[key] == ref_final[key], f"{key} differs from the uninterrupted run"
    assert store.steps(root)[1] == [], "partial checkpoints left behind"


def launch_ranks(args_of_rank) -> list[int]:
    workers = [Worker([sys.executable, str(TORCH_WORKER), *args_of_rank(rank)], env=repo_env(),
                      cwd=REPO, timeout_s=150.0) for rank in range(2)]
    codes, outputs = run_all(workers)
    assert all(code in (0, -signal.SIGKILL) for code in codes), "\n---\n".join(
        output[-4000:] for output in outputs)
    return codes


@pytest.mark.parametrize("store", [pytest.param("s3"), pytest.param("gs", marks=SOAK)],
                         indirect=True)
def test_two_gloo_ranks_sigkilled_mid_save_resume_bit_exact(store, options, tmp_path):
    # Both ranks write their DCP files to the store, the primary the marker; killed right
    # after the async save of step 7 started, they resume from one committed checkpoint (3 or
    # 7) and end as the uninterrupted 2-rank run did, rank by rank.
    out = tmp_path / "out"
    out.mkdir()
    root = store.url(f"ranks/{uuid.uuid4().hex}")
    steps_2 = 14  # 6 steps per epoch with 2 ranks

    def ranks(port: int, *extra: str):
        return lambda rank: ["--phase", "train", "--root", root, "--out", str(out), "--steps",
                             str(steps_2), "--world", "2", "--rank", str(rank), "--port",
                             str(port), "--storage-options", json.dumps(options), *extra]

    assert launch_ranks(ranks(free_port(), "--reference-root", str(tmp_path / "ref"),
                              "--kill-at", "7")) == [-signal.SIGKILL] * 2
    assert launch_ranks(ranks(free_port(), "--label", "resume")) == [0, 0]
    starts = set()
    for rank in range(2):
        reference = steps(records(out, "reference", rank))
        killed = steps(records(out, "run", rank))
        assert sorted(killed) == list(range(8)) and all(killed[s] == reference[s]
                                                         for s in killed)
        recs = records(out, "resume", rank)
        (start,) = [r["resumed_from"] for r in recs if "resumed_from" in r]
        starts.add(start)
        done = steps(recs)
        assert sorted(done) == list(range(start + 1, steps_2))
        assert all(done[s] == reference[s] for s in done), f"rank {rank} left the reference"
        (ref_final,) = [r for r in records(out, "reference", rank) if "final" in r]
        (res_final,) = [r for r in recs if "final" in r]
        for key in ("final", "table", "rng"):
            assert res_final[key] == ref_final[key], f"rank {rank}: {key} differs"
    assert len(starts) == 1 and starts <= {3, 7}, starts
    assert store.steps(root)[1] == [], "partial checkpoints left behind"
