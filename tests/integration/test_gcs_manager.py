"""CheckpointManager (JAX) on a gs:// root, against a GCS emulator behind the
precondition-enforcing proxy that this module starts on 127.0.0.1 (tests/support/
gcs_server.py): arrays big enough to be stored unpacked round-trip bit-exact, with nothing
created locally. The same Storage seam as s3://; GCS's client takes only bytes, which the
array writer's buffers are not. Saves through a fault-injecting proxy (tests/support/
fault_proxy.py, in front of the precondition proxy) leave every checkpoint restorable, and a
marker whose upload landed but whose answer was lost is recognised as ours by its bytes."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

pytest.importorskip("google.cloud.storage")
pytest.importorskip("gcp_storage_emulator")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt.core.layout import COMMIT_MARKER, step_dirname  # noqa: E402

from support.fault_proxy import FAULTS, FaultProxy  # noqa: E402
from support.gcs_server import PreconditionProxy, emulator  # noqa: E402

BUCKET = "jaxckpt-gcs-manager"
LEASE = {"lease_s": 3.0, "heartbeat_s": 0.5}


@pytest.fixture(scope="module")
def proxy():
    with emulator(BUCKET) as endpoint:
        front = PreconditionProxy(endpoint)
        try:
            yield front
        finally:
            front.close()


@pytest.fixture
def root():
    return f"gs://{BUCKET}/runs/{uuid.uuid4().hex}"


def manager(root, options, **kwargs):
    kwargs.setdefault("recover", jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1),
                                                       keep_last_n=None))
    return jaxckpt.CheckpointManager(root, storage_options=options, preemption_signals=(),
                                     **kwargs)


def step(n: int) -> jaxckpt.StepInfo:
    return jaxckpt.StepInfo(0, n, n, None)


def small_state(n: int) -> dict:
    return {"w": jnp.arange(2000.0) * n, "b": jnp.full(3, n, jnp.int32)}


LIKE = {"w": jax.ShapeDtypeStruct((2000,), jnp.float32),
        "b": jax.ShapeDtypeStruct((3,), jnp.int32)}


def assert_restores(mgr, n: int, state: dict) -> None:
    assert mgr.store.verify(mgr.store.step_path(n)) == []
    restored = mgr.restore(LIKE, step=n).state
    for name in state:
        assert np.asarray(restored[name]).tobytes() == np.asarray(state[name]).tobytes(), n


def test_checkpoint_manager_round_trip_on_gs_is_bit_exact(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    state = {"big": jnp.asarray(rng.standard_normal(300_000), jnp.float32),  # > 1 MiB
             "bf16": jnp.asarray(rng.standard_normal((7, 5)), jnp.bfloat16),
             "key": jax.random.key(3), "count": 4}
    like = {"big": jnp.zeros(300_000, jnp.float32), "bf16": jnp.zeros((7, 5), jnp.bfloat16),
            "key": jax.random.key(0), "count": 0}
    with emulator(BUCKET) as endpoint:
        proxy = PreconditionProxy(endpoint)
        try:
            options = {"endpoint_url": proxy.url, "lease_s": 3.0, "heartbeat_s": 0.5}
            root = f"gs://{BUCKET}/runs/{uuid.uuid4().hex}"
            with jaxckpt.CheckpointManager(root, storage_options=options, mode="async") as mgr:
                mgr.save(jaxckpt.StepInfo(0, 2, 2), state)
            with jaxckpt.CheckpointManager(root, storage_options=options) as mgr:
                recovered = mgr.recover(like)
        finally:
            proxy.close()
    assert recovered.step_info.global_step == 2
    for name in ("big", "bf16"):
        assert np.asarray(recovered.state[name]).tobytes() == np.asarray(state[name]).tobytes()
    assert np.array_equal(jax.random.key_data(recovered.state["key"]),
                          jax.random.key_data(state["key"]))
    assert recovered.state["count"] == 4
    assert os.listdir(tmp_path) == []


def test_saves_through_a_faulty_network_leave_every_checkpoint_restorable(proxy, root):
    """503s, connections dropped before and after the server acted, and slow answers on a
    quarter of the requests between the client and the emulator: every save commits
    (retries, and a create-only marker or lease that recognises its own landed first try), a
    save that cannot get through fails without harm, and every earlier checkpoint restores
    bit-exact."""
    faulty = FaultProxy(proxy.url, seed=3, rates={
        "unavailable": 0.08, "drop_before": 0.06, "drop_after": 0.06, "slow": 0.05},
        slow_s=0.1)
    states = {n: small_state(n) for n in (1, 2, 3, 4)}
    # Eight tries with short waits: a request fails 8 times in a row about once in 400,000.
    flaky = {"endpoint_url": faulty.url, "max_attempts": 8, "read_timeout": 10,
             "backoff_s": 0.05, "max_backoff_s": 0.2, **LEASE}
    try:
        with manager(root, flaky) as mgr:
            for n, state in states.items():
                mgr.maybe_save(step(n), state)
            mgr.wait()
            faulty.rates = {"unavailable": 1.0}  # the store stops answering for one save
            # It fails (on the training thread, or at the next call for the background part)
            # and leaves no marker.
            with pytest.raises(Exception, match="503|Service Unavailable"):
                mgr.maybe_save(step(5), small_state(5))
                mgr.wait()
            faulty.enabled = False
    finally:
        faulty.close()
    assert all(faulty.counts[name] for name in FAULTS), faulty.counts
    with manager(root, {"endpoint_url": proxy.url, **LEASE}) as mgr:  # no faults
        assert mgr.committed_steps() == [1, 2, 3, 4]
        for n, state in states.items():
            assert_restores(mgr, n, state)


def test_a_marker_whose_answer_was_lost_is_recognised_by_its_bytes(proxy, root):
    # The marker's upload reaches the server, which stores it, but the connection closes
    # before the answer: the retry (ifGenerationMatch=0) gets 412, the commit reads the
    # object back, finds the bytes it sent and goes on; the checkpoint is committed.
    options = {"endpoint_url": proxy.url, "backoff_s": 0.05, **LEASE}
    marker = f"{root[len(f'gs://{BUCKET}/'):]}/recover/{step_dirname(1)}/{COMMIT_MARKER}"
    proxy.drop_answer_to.add(marker)
    with manager(root, options, mode="sync") as mgr:
        mgr.maybe_save(step(1), small_state(1))
        reports = mgr.maybe_save(step(2), small_state(2))
        assert reports and reports[0].error is None
    assert [r.answered for r in proxy.uploads(marker)] == [0, 412]
    assert [r.query.get("ifGenerationMatch") for r in proxy.uploads(marker)] == ["0", "0"]
    with manager(root, options) as mgr:
        assert mgr.committed_steps() == [1, 2]
        assert_restores(mgr, 1, small_state(1))


def test_a_big_array_whose_upload_answer_was_lost_is_retried_and_committed(proxy, root):
    # An array object over 8 MiB goes up as a resumable upload; the chunk that finishes it is
    # stored but its answer never comes. The retried chunk finds the session finished (GCS
    # answers with the object), the save commits and restores bit-exact.
    options = {"endpoint_url": proxy.url, "backoff_s": 0.05, **LEASE}
    big = {"w": jnp.arange(2_400_000, dtype=jnp.float32)}  # 9.6 MB: one array object
    with manager(root, options) as mgr:
        storage = mgr.store.storage
        write = storage.write

        def drop_big(path: str, data) -> None:  # the one object over 8 MiB: the array's
            if memoryview(data).nbytes > 8 << 20:
                proxy.drop_answer_to.add(storage.name(path))
            write(path, data)

        storage.write = drop_big
        mgr.save(step(1), big, mode="sync")
    chunks = [r for r in proxy.requests if r.method == "PUT" and "upload_id" in r.query]
    assert [r.answered for r in chunks] == [0, 200], chunks
    assert len({r.name for r in chunks}) == 1 and not proxy.drop_answer_to
    with manager(root, options) as mgr:
        assert mgr.store.verify(mgr.store.step_path(1)) == []
        restored = mgr.restore({"w": jax.ShapeDtypeStruct((2_400_000,), jnp.float32)}).state
    assert np.asarray(restored["w"]).tobytes() == np.asarray(big["w"]).tobytes()
