"""Two JAX processes (jax.distributed on localhost, CPU devices) checkpointing one sharded
state to an s3:// root, against a moto server this module starts on 127.0.0.1: each process
uploads the chunk objects of its own shards, the primary commits with every process's
checksums, both processes restore what they wrote, and one process restores it on another
mesh, bit-exact."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxckpt import CheckpointManager, CheckpointWarning, RecoverConfig  # noqa: E402
from jaxckpt.storage.s3.storage import s3_client  # noqa: E402

from support.s3_server import moto_s3  # noqa: E402
from support.two_processes import jax_worker, run_two_workers  # noqa: E402

BUCKET = "jaxckpt-mp"

WORKER = jax_worker('''
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from jaxckpt import CheckpointManager, RecoverConfig, StepInfo

        setup = json.loads(os.environ["JAXCKPT_TEST_S3"])
        url, options = setup["root"], setup["options"]
        mesh = jax.make_mesh((4,), ("x",))
        sharding = NamedSharding(mesh, P("x"))

        def weights(step):
            base = np.arange(64, dtype=np.float32).reshape(16, 4) + 1000 * step
            return jax.make_array_from_callback((16, 4), sharding, lambda idx: base[idx])

        config = RecoverConfig(keep_last_n=None)
        with CheckpointManager(url, recover=config, mode="async", storage_options=options,
                               preemption_signals=()) as mgr:
            step = StepInfo(0, 0, 0)
            for _ in range(2):
                mgr.save(step, {"w": weights(step.global_step), "n": step.global_step})
                step = step.next()
            mgr.wait()
        like = {"w": jax.ShapeDtypeStruct((16, 4), np.float32, sharding=sharding), "n": 0}
        with CheckpointManager(url, recover=config, storage_options=options,
                               preemption_signals=()) as mgr:
            result = mgr.recover(like)
        assert result.step_info.global_step == 1 and result.state["n"] == 1
        assert result.state["w"].sharding == sharding
        for shard in result.state["w"].addressable_shards:
            expected = np.arange(64, dtype=np.float32).reshape(16, 4)[shard.index] + 1000
            np.testing.assert_array_equal(np.asarray(shard.data), expected)
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("jaxckpt-test-end")
''')


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    with moto_s3(BUCKET) as options:
        root = f"s3://{BUCKET}/runs/{uuid.uuid4().hex}"
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("JAXCKPT_TEST_S3", json.dumps({"root": root, "options": options}))
            run_two_workers(WORKER, tmp_path_factory.mktemp("mp_s3"), timeout=240)
        yield root, options


def test_two_processes_save_to_s3_and_restore_there(saved_by_two):
    """Both processes uploaded their own shards' chunk objects (no local fallback: Orbax
    cannot write s3://) and each restored its shards of step 1 (in the worker)."""
    root, options = saved_by_two
    client = s3_client(options)
    prefix = root.split("/", 3)[3] + "/recover/step_00000001/"
    keys = {entry["Key"][len(prefix):] for page in
            client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for entry in page.get("Contents", ())}
    assert {"COMMITTED", "done.p00001"} <= keys
    chunks = sorted(key for key in keys if "/c/" in key and "pack_" not in key)
    assert len(chunks) == 4 and all(key.endswith("/0") for key in chunks), keys
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key=prefix + "COMMITTED")
                          ["Body"].read())["files"]
    carried = json.loads(client.get_object(Bucket=BUCKET, Key=prefix + "done.p00001")
                         ["Body"].read())
    assert set(carried) & set(chunks) and all(manifest[k] == v for k, v in carried.items())


def test_one_process_restores_what_two_wrote_to_s3(saved_by_two):
    root, options = saved_by_two
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    sharding = NamedSharding(mesh, P("b", "a"))
    like = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=sharding), "n": 0}
    with CheckpointManager(root, recover=RecoverConfig(keep_last_n=None),
                           storage_options=options, preemption_signals=()) as mgr:
        with pytest.warns(CheckpointWarning, match="saved by 2 process"):
            result = mgr.recover(like)
    assert result.step_info.global_step == 1 and result.state["n"] == 1
    assert result.state["w"].sharding == sharding
    expected = np.arange(64, dtype=np.float32).reshape(16, 4) + 1000
    np.testing.assert_array_equal(np.asarray(result.state["w"]), expected)
