"""Kill trials with many processes: one process of a 2-process JAX job (``jax.distributed``
on 127.0.0.1, CPU devices) or of a 2-rank torch job (gloo) SIGKILLs itself at a point of a
save; the scheduler (``support.pair_trials``) kills the survivor after a grace period; the job
is started again, both processes, on the same root, and must resume bit-exactly.

A chain of trials (``support.kill_chain``) runs on one root: each segment resumes what the
last one left and is itself killed at its plan's point, until a segment runs to the end.
Checked after every segment (``run_chain``):
- every committed checkpoint verifies against its manifest (none is ever partial), and at
  the end of a chain ``jaxckpt verify ROOT`` passes;
- every process resumed from the newest committed step (a partial one is never restored);
- every loss any process logged equals the uninterrupted reference run's (``float.hex``),
  step by step with none skipped, and at the end the final state (params, optimizer,
  PRNG key data; torch: digests of the model, Adam, scheduler, RNG and the sharded table)
  is byte-identical to the reference;
- a save the primary reported complete is committed; the other process reports a save only
  once its marker exists (it agrees through the done-file handshake, it never decides).
The multi-process rules (docs/design.md, "Multi-process rules") each get a trial that fails
when the rule is broken: a process that dies before the handshake leaves that step
uncommitted however long the primary lives on; a primary that dies before its commit leaves
it uncommitted though every other process finished; the other process never commits nor
deletes anything (an audit of its storage calls).

The root is a parameter of the chain: here a local directory; the same trials on ``s3://``
and ``gs://`` roots are in test_multiprocess_kill_remote.py. Soak: ``JAXCKPT_SOAK=1`` (or
``JAXCKPT_SOAK_TRIALS=N``) runs at least 50 random trials per framework; a failure prints
the seed, pinned with ``JAXCKPT_CRASH_SEED``.
"""

from __future__ import annotations

import json
import os

import pytest

from support.kill_chain import (
    SOAK_ENABLED,
    SOAK_TRIALS,
    ChainRoot,
    JaxJob,
    Plan,
    TorchJob,
    fixed,
    run_chain,
    run_soak,
)

# ------------------------------------------------------------------------------- JAX

# The fixed plans of the default run, one per rule (see the module docstring):
JAX_PLANS = [
    # Process 1 dies with its writes of step 3 done but before its done.p00001: the primary
    # lives on 2.5 s (a commit takes milliseconds) and must not commit step 3.
    Plan(1, "done", 3, grace_s=2.5),
    # The primary dies just before committing step 5, every done marker present.
    Plan(0, "commit", 5, grace_s=1.0),
    # The primary dies in retention right after step 7 committed (deleting step 5).
    Plan(0, "retention", 7, grace_s=1.0),
]


@pytest.fixture(scope="module")
def jax_chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mp_kill_jax")
    job = JaxJob(tmp)
    env = {"JAXCKPT_AUDIT": str(tmp / "audit"), "JAXCKPT_HOLD_COMMIT_S": "0.3"}
    job.env.update(env)
    trials = run_chain(job, ChainRoot(str(tmp / "root")), fixed(JAX_PLANS), prefix="jax-")
    return tmp, trials, job.last_outcomes


def test_jax_pair_killed_at_fixed_points_resumes_bit_exact(jax_chain):
    _, trials, _ = jax_chain
    assert [t.plan for t in trials] == JAX_PLANS  # every plan's process died at its point


def test_process_dying_before_the_handshake_leaves_nothing_committed(jax_chain):
    _, trials, _ = jax_chain
    trial = trials[0]
    assert trial.committed_after == [1], trial.committed_after
    # The primary went on alone: it wrote its share and its marker, and waited.
    assert "done.p00001" not in trial.step_dir_names, trial.step_dir_names
    assert "COMMITTED" not in trial.step_dir_names


def test_primary_dying_before_its_commit_leaves_nothing_committed(jax_chain):
    _, trials, _ = jax_chain
    trial = trials[1]
    assert trial.committed_after == [3], trial.committed_after
    # Every other process had finished (its done marker is there): only the primary commits.
    assert "done.p00001" in trial.step_dir_names and "COMMITTED" not in trial.step_dir_names


def test_other_process_reports_a_save_only_once_the_primary_committed_it(jax_chain):
    # Every process checks the marker when it hears a save finished (REPORTED n COMMITTED);
    # the primary holds each commit 0.3 s (JAXCKPT_HOLD_COMMIT_S), so a process that did not
    # wait for the handshake would report MISSING. run_chain checks every segment; here the
    # last one, on both processes alike.
    _, _, last = jax_chain
    primary, other = (out.tagged("REPORTED") for out in last)
    assert other and other == primary, (primary, other)
    assert all(line.endswith(" COMMITTED") for line in other), other


def test_other_process_never_commits_nor_deletes(jax_chain):
    tmp, _, _ = jax_chain

    def ops(process: int) -> list[dict[str, str]]:
        path = tmp / f"audit.p{process}"
        return [json.loads(line) for line in path.read_text().splitlines()]

    primary, other = ops(0), ops(1)
    assert any(r["op"] == "create" and r["path"].endswith("COMMITTED") for r in primary)
    assert any(r["op"].startswith("delete") for r in primary)  # retention ran (keep_last_n=1)
    made = {(r["op"], os.path.basename(r["path"])) for r in other if r["op"] != "make_prefix"}
    assert made == {("write", "driver.p00001.json"), ("write", "done.p00001")}, made


@pytest.mark.slow
@pytest.mark.timeout(0)
@pytest.mark.skipif(not SOAK_ENABLED, reason="soak: set JAXCKPT_SOAK=1 or JAXCKPT_SOAK_TRIALS=N")
def test_soak_jax_pair_random_kills(tmp_path):
    run_soak(JaxJob(tmp_path), ChainRoot(str(tmp_path)), SOAK_TRIALS, "jax")


# ----------------------------------------------------------------------------- torch

TORCH_PLANS = [
    # Rank 1 dies with its DCP write of step 7 finished but before its done.p00001: nothing
    # of step 7 may be committed, the job resumes from step 3 (the final segment then saves
    # 11 and 13 and retention deletes: the soak kills inside every other point).
    Plan(1, "done", 7, grace_s=2.0),
]


@pytest.fixture(scope="module")
def torch_chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mp_kill_torch")
    return run_chain(TorchJob(tmp), ChainRoot(str(tmp / "root")), fixed(TORCH_PLANS),
                     prefix="torch-")


def test_torch_two_ranks_killed_at_fixed_points_resume_bit_exact(torch_chain):
    assert [t.plan for t in torch_chain] == TORCH_PLANS
    assert torch_chain[0].committed_after == [3], torch_chain[0].committed_after
    assert "done.p00001" not in torch_chain[0].step_dir_names


@pytest.mark.slow
@pytest.mark.timeout(0)
@pytest.mark.skipif(not SOAK_ENABLED, reason="soak: set JAXCKPT_SOAK=1 or JAXCKPT_SOAK_TRIALS=N")
def test_soak_torch_two_ranks_random_kills(tmp_path):
    run_soak(TorchJob(tmp_path), ChainRoot(str(tmp_path)), SOAK_TRIALS, "torch")
