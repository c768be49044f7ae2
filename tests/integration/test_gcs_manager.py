"""CheckpointManager (JAX) on a gs:// root, against a GCS emulator behind the
precondition-enforcing proxy that this module starts on 127.0.0.1 (tests/support/
gcs_server.py): arrays big enough to be stored unpacked round-trip bit-exact, with nothing
created locally. The same Storage seam as s3://; GCS's client takes only bytes, which the
array writer's buffers are not."""

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

from support.gcs_server import PreconditionProxy, emulator  # noqa: E402

BUCKET = "jaxckpt-gcs-manager"


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
