"""The multi-process kill trials of test_multiprocess_kill.py on object storage: a 2-process
JAX job and a 2-rank torch job checkpoint to an ``s3://`` root (a moto server this module
starts on 127.0.0.1) or a ``gs://`` root (the GCS emulator behind the proxy that enforces
``ifGenerationMatch``, also started here); one process SIGKILLs itself at a point of a save,
the survivor is killed after a grace period, both are started again at once (as a scheduler
restarting the job does: the killed primary's root lease is taken over, its process being
gone), and the job must
resume bit-exactly against an uninterrupted run (on a local root), with every committed
checkpoint verifying against its manifest after every segment and ``jaxckpt verify ROOT``
passing at the end (``support.kill_chain.run_chain`` lists the checks).

By default a few fixed points per storage kind, on shorter runs than the local trials:

- s3://, JAX: a process killed while its chunk objects upload, then the primary killed
  while retention deletes the previous checkpoint (marker first);
- gs://, JAX: a process killed before its done marker (the primary lives on and must not
  commit), then the primary killed just before its commit (every done marker present);
- gs://, torch: the primary killed just before its commit.

Behind the slow marker: torch on s3:// killed before its commit, every kill point
(staging, writing, done, commit, retention) in one chain per framework on s3://, and the
soak (``JAXCKPT_SOAK=1``: at least 50 random trials,
``JAXCKPT_SOAK_TRIALS=N``; a failure prints the seed, pinned with ``JAXCKPT_CRASH_SEED``).
test_dcp_object_store_crash.py kills a one-rank torch run at its own points on s3:// (after
the write, after the marker, while uploading) and two gloo ranks right after an async save
started.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
pytest.importorskip("jax")

from support.kill_chain import (  # noqa: E402
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
from support.s3_server import moto_s3  # noqa: E402

BUCKET = "jaxckpt-mp-kill"
#: A short lease: a restarted job takes a killed one's over at once (its process is gone),
#: and were that not seen, the lease would run out in seconds (a late renewal on a loaded
#: machine is harmless: nobody else takes the lease while the job lives).
LEASE = {"lease_s": 2.0, "heartbeat_s": 0.5}

NewRoot = Callable[[], ChainRoot]

soak = pytest.mark.skipif(not SOAK_ENABLED,
                          reason="soak: set JAXCKPT_SOAK=1 or JAXCKPT_SOAK_TRIALS=N")


@pytest.fixture(scope="module")
def s3_root() -> Iterator[NewRoot]:
    """A fresh ``s3://`` root (and its options) per call, on one moto server."""
    with moto_s3(BUCKET) as options:
        yield lambda: ChainRoot(f"s3://{BUCKET}/runs/{uuid.uuid4().hex}", {**options, **LEASE})


@pytest.fixture(scope="module")
def gs_root() -> Iterator[NewRoot]:
    """A fresh ``gs://`` root per call, on one emulator behind the precondition proxy."""
    pytest.importorskip("google.cloud.storage")
    pytest.importorskip("gcp_storage_emulator")
    from support.gcs_server import PreconditionProxy, emulator

    with emulator(BUCKET) as endpoint:
        proxy = PreconditionProxy(endpoint)
        try:
            yield lambda: ChainRoot(f"gs://{BUCKET}/runs/{uuid.uuid4().hex}",
                                    {"endpoint_url": proxy.url, "max_attempts": 3, **LEASE})
        finally:
            proxy.close()


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One JAX compilation cache for the module's jobs: the step compiles once."""
    return tmp_path_factory.mktemp("jax-cache")


def torch_job(tmp, steps: int = 14) -> TorchJob:
    pytest.importorskip("torch")
    pytest.importorskip("torchdata")
    return TorchJob(tmp, steps)


# ------------------------------------------------------------------------------ s3://

S3_JAX_PLANS = [
    # Process 1 dies as soon as its write of step 3 is under way (staging returned, the
    # chunk objects upload in the background): step 3 is never committed, the job resumes
    # from step 1.
    Plan(1, "writing", 3, grace_s=1.0),
    # The primary dies in retention right after step 5 committed: deleting step 3 had at
    # most removed its marker; the job resumes from step 5.
    Plan(0, "retention", 5, grace_s=1.0),
]


def test_jax_pair_killed_mid_upload_and_in_retention_on_s3_resumes_bit_exact(
        s3_root, tmp_path, compile_cache):
    job = JaxJob(tmp_path, steps=8, compile_cache=compile_cache)
    trials = run_chain(job, s3_root(), fixed(S3_JAX_PLANS), prefix="s3-jax-")
    assert [t.plan for t in trials] == S3_JAX_PLANS
    assert trials[0].committed_after == [1], trials[0].committed_after
    assert "COMMITTED" not in trials[0].step_dir_names
    assert trials[1].committed_after[-1] == 5, trials[1].committed_after


TORCH_COMMIT_PLAN = [
    # The primary dies just before committing step 7, rank 1's done marker present: the job
    # resumes from step 3, rank 1's finished share never counts (10 steps: saves 3, 7 and
    # the final 9, across an epoch end at 6).
    Plan(0, "commit", 7, grace_s=1.0),
]


@pytest.mark.slow
@soak
def test_torch_two_ranks_killed_before_the_commit_on_s3_resume_bit_exact(s3_root, tmp_path):
    trials = run_chain(torch_job(tmp_path, steps=10), s3_root(), fixed(TORCH_COMMIT_PLAN),
                       prefix="s3-torch-")
    assert [t.plan for t in trials] == TORCH_COMMIT_PLAN
    assert trials[0].committed_after == [3], trials[0].committed_after
    assert "done.p00001" in trials[0].step_dir_names
    assert "COMMITTED" not in trials[0].step_dir_names


# Every kill point in one chain: each segment is killed at the next point, on a save after
# the step the last one resumed from.
JAX_EVERY_POINT = [
    Plan(0, "staging", 3), Plan(1, "writing", 5, delay_s=0.05), Plan(1, "done", 7, grace_s=2.5),
    Plan(0, "commit", 9), Plan(0, "retention", 9),
]
TORCH_EVERY_POINT = [
    Plan(1, "staging", 3), Plan(0, "writing", 7, delay_s=0.05), Plan(1, "done", 7, grace_s=2.0),
    Plan(0, "commit", 11), Plan(0, "retention", 11),
]


@pytest.mark.slow
@pytest.mark.timeout(0)
@soak
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_every_kill_point_on_s3_resumes_bit_exact(framework, s3_root, tmp_path, compile_cache):
    if framework == "jax":
        job, plans = JaxJob(tmp_path, compile_cache=compile_cache), JAX_EVERY_POINT
    else:
        job, plans = torch_job(tmp_path), TORCH_EVERY_POINT
    trials = run_chain(job, s3_root(), fixed(plans), prefix=f"s3-{framework}-every-")
    assert [t.plan for t in trials] == plans


@pytest.mark.slow
@pytest.mark.timeout(0)
@soak
def test_soak_jax_pair_random_kills_on_s3(s3_root, tmp_path, compile_cache):
    run_soak(JaxJob(tmp_path, compile_cache=compile_cache), s3_root(), SOAK_TRIALS, "jax s3")


@pytest.mark.slow
@pytest.mark.timeout(0)
@soak
def test_soak_torch_two_ranks_random_kills_on_s3(s3_root, tmp_path):
    run_soak(torch_job(tmp_path), s3_root(), SOAK_TRIALS, "torch s3")


# ------------------------------------------------------------------------------ gs://

GS_JAX_PLANS = [
    # Process 1 dies with its writes of step 3 done but before its done marker: the primary
    # lives on 2.5 s and must not commit step 3.
    Plan(1, "done", 3, grace_s=2.5),
    # The primary dies just before committing step 5, every done marker present.
    Plan(0, "commit", 5, grace_s=1.0),
]


def test_jax_pair_killed_before_the_handshake_and_the_commit_on_gs_resumes_bit_exact(
        gs_root, tmp_path, compile_cache):
    job = JaxJob(tmp_path, steps=6, compile_cache=compile_cache)
    trials = run_chain(job, gs_root(), fixed(GS_JAX_PLANS), prefix="gs-jax-")
    assert [t.plan for t in trials] == GS_JAX_PLANS
    first, second = trials
    assert first.committed_after == [1], first.committed_after
    assert "done.p00001" not in first.step_dir_names, first.step_dir_names
    assert "COMMITTED" not in first.step_dir_names
    assert second.committed_after == [3], second.committed_after
    assert "done.p00001" in second.step_dir_names
    assert "COMMITTED" not in second.step_dir_names


def test_torch_two_ranks_killed_before_the_commit_on_gs_resume_bit_exact(gs_root, tmp_path):
    trials = run_chain(torch_job(tmp_path, steps=10), gs_root(), fixed(TORCH_COMMIT_PLAN),
                       prefix="gs-torch-")
    assert [t.plan for t in trials] == TORCH_COMMIT_PLAN
    assert trials[0].committed_after == [3], trials[0].committed_after
    assert "done.p00001" in trials[0].step_dir_names
    assert "COMMITTED" not in trials[0].step_dir_names
