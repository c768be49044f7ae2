"""CheckpointManager on an s3:// root, against a moto server this module starts on 127.0.0.1
(tests/support/s3_server.py): round trips bit-exact, the same layout as on disk both ways,
nothing created locally, crash debris ignored and cleaned, one lease holder, quarantine
and exports without rename, what a save costs in requests, the CLI on such a root, and
saves through a fault-injecting proxy (tests/support/fault_proxy.py)."""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt.backends.orbax import files as array_files  # noqa: E402
from jaxckpt.errors import RootLockedError  # noqa: E402
from jaxckpt.storage.s3 import storage as s3_storage  # noqa: E402
from jaxckpt.storage.s3.storage import s3_client  # noqa: E402

from support.fault_proxy import FAULTS, FaultProxy  # noqa: E402
from support.s3_server import moto_s3  # noqa: E402

BUCKET = "jaxckpt-manager"
LEASE = {"lease_s": 3.0, "heartbeat_s": 0.5}


@pytest.fixture(scope="module")
def options():
    with moto_s3(BUCKET) as opts:
        yield {**opts, **LEASE}


@pytest.fixture
def root():
    return f"s3://{BUCKET}/runs/{uuid.uuid4().hex}"


@pytest.fixture
def client(options):
    return s3_client({k: v for k, v in options.items() if k not in LEASE})


def keys_under(client, url: str) -> dict[str, bytes]:
    prefix = url.split("/", 3)[3] + "/"
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for entry in page.get("Contents", ()):
            body = client.get_object(Bucket=BUCKET, Key=entry["Key"])["Body"].read()
            out[entry["Key"][len(prefix):]] = body
    return out


def every_dtype_state() -> dict:
    rng = np.random.default_rng(0)
    return {
        "f32": jnp.asarray(rng.standard_normal((40, 33)), jnp.float32),
        "big": jnp.asarray(rng.standard_normal(300_000), jnp.float32),  # > 1 MiB: unpacked
        "bf16": jnp.asarray(rng.standard_normal((7, 5)), jnp.bfloat16),
        "f16": jnp.asarray(rng.standard_normal(9), jnp.float16),
        "f64": np.asarray(rng.standard_normal(4), np.float64),
        "i8": jnp.arange(-5, 5, dtype=jnp.int8),
        "u32": jnp.arange(6, dtype=jnp.uint32) * 1000,
        "i64": np.arange(3, dtype=np.int64) - 2**40,
        "bool": jnp.asarray([True, False, True]),
        "c64": np.asarray([1 + 2j, -3j], np.complex64),
        "f8": np.asarray([0.5, -2.0, 448.0], ml_dtypes.float8_e4m3fn),
        "key": jax.random.key(7),
        "count": 3,
        "lr": 0.25,
    }


def like_of(state):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
                        if isinstance(a, jax.Array) else a, state)


def assert_bit_equal(got, want) -> None:
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        if isinstance(b, jax.Array) and jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if isinstance(b, (int, float)):
            assert type(a) is type(b) and a == b, path
            continue
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)


def manager(root, options, **kwargs):
    kwargs.setdefault("recover", jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1),
                                                       keep_last_n=2))
    return jaxckpt.CheckpointManager(root, storage_options=options, preemption_signals=(),
                                     **kwargs)


def step(n: int) -> jaxckpt.StepInfo:
    return jaxckpt.StepInfo(0, n, n, None)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_round_trip_of_every_dtype_is_bit_exact_and_creates_nothing_locally(
        root, options, tmp_path, monkeypatch, mode):
    monkeypatch.chdir(tmp_path)
    state = every_dtype_state()
    with manager(root, options, mode=mode) as mgr:
        mgr.maybe_save(step(1), state)
        mgr.wait()
        assert mgr.committed_steps() == [1]
    with manager(root, options) as mgr:
        recovered = mgr.recover(like_of(state))
    assert recovered is not None and recovered.step_info.global_step == 1
    assert_bit_equal(recovered.state, state)
    assert os.listdir(tmp_path) == []  # no "s3:" directory, no temporary file


def test_a_checkpoint_copied_from_s3_to_disk_restores_there_and_back(root, options, client,
                                                                   tmp_path):
    state = every_dtype_state()
    with manager(root, options) as mgr:
        mgr.save(step(4), state)
        mgr.wait()
    # A plain object-by-object copy (what `aws s3 cp --recursive` does) to a local root.
    local = tmp_path / "copied"
    for rel, body in keys_under(client, root).items():
        if rel != ".lock":
            target = local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
    with jaxckpt.CheckpointManager(local, preemption_signals=()) as mgr:
        assert mgr.store.verify(mgr.store.step_path(4)) == []
        assert_bit_equal(mgr.restore(like_of(state)).state, state)
    # The other way: saved on disk (where big arrays may start past offset 0 for O_DIRECT),
    # uploaded file by file, restored from S3.
    disk = tmp_path / "disk"
    with jaxckpt.CheckpointManager(disk, preemption_signals=()) as mgr:
        mgr.save(step(5), state, mode="sync")
    uploaded = f"{root}-uploaded"
    for dirpath, _, names in os.walk(disk):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), disk)
            if rel != ".lock":
                with open(os.path.join(dirpath, name), "rb") as stream:
                    client.put_object(Bucket=BUCKET, Body=stream.read(),
                                      Key=f"{uploaded.split('/', 3)[3]}/{rel}")
    with manager(uploaded, options) as mgr:
        assert mgr.store.verify(mgr.store.step_path(5)) == []
        assert_bit_equal(mgr.restore(like_of(state)).state, state)


def test_big_arrays_go_up_in_parts_and_come_back_in_ranges(root, options, client, monkeypatch):
    monkeypatch.setattr(s3_storage, "MULTIPART_OVER", 6 << 20)
    monkeypatch.setattr(s3_storage, "PART_BYTES", 5 << 20)  # S3's smallest part
    monkeypatch.setattr(array_files, "RANGED_READ_OVER", 3 << 20)  # 5 parts
    uploads: list[str] = []
    state = {"w": jnp.arange(3 << 20, dtype=jnp.float32)}  # 12 MiB: 3 parts, 5 ranges
    with manager(root, options) as mgr:
        mgr.store.storage.client.meta.events.register(
            "before-call.s3.CreateMultipartUpload", lambda **kw: uploads.append("multipart"))
        mgr.save(step(1), state, mode="sync")
        restored = mgr.restore(like_of(state)).state
    assert uploads == ["multipart"]
    assert_bit_equal(restored, state)


def test_a_partial_prefix_and_an_unfinished_upload_are_ignored_then_cleaned(root, options,
                                                                           client):
    state = {"w": jnp.ones(8)}
    with manager(root, options) as mgr:
        mgr.save(step(2), state)
    prefix = root.split("/", 3)[3]
    # A killed job's debris: a step with data but no marker, and a multipart upload of a
    # chunk that never completed.
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/recover/step_00000009/driver.json",
                      Body=b"{}")
    chunk = f"{prefix}/recover/step_00000009/state/arrays/leaf_000000/c/0"
    client.create_multipart_upload(Bucket=BUCKET, Key=chunk)
    with manager(root, options) as mgr:
        recovered = mgr.recover({"w": jax.ShapeDtypeStruct((8,), jnp.float32)})
        assert recovered.step_info.global_step == 2
        assert mgr.store.storage.list_names(mgr.store.recover_dir) == ["step_00000002/"]
    assert not client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")


def test_two_managers_racing_for_one_root_exactly_one_holds_it(root, options):
    outcomes: list[object] = []
    start = threading.Barrier(2)

    def open_one() -> None:
        start.wait()
        try:
            outcomes.append(manager(root, options))
        except RootLockedError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    held = [o for o in outcomes if isinstance(o, jaxckpt.CheckpointManager)]
    refused = [o for o in outcomes if isinstance(o, RootLockedError)]
    assert len(held) == 1 and len(refused) == 1, outcomes
    assert "another manager of this same process" in str(refused[0])
    held[0].close()
    manager(root, options).close()  # released: the root is free again


def test_a_committed_step_written_again_is_quarantined_by_copy(root, options, client):
    state = {"w": jnp.arange(4.0)}
    with manager(root, options) as mgr:
        mgr.save(step(1), state)
        mgr.save(step(2), state)
    with manager(root, options) as mgr:
        mgr.restore({"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, step=1)
        mgr.maybe_save(step(1), state)  # resumed at 1: the next step is 2 again
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.maybe_save(step(2), {"w": jnp.arange(4.0) + 1})
            mgr.wait()
        assert any("moved to" in str(w.message) for w in caught)
        superseded = mgr.store.storage.list_names(f"{mgr.store.recover_dir}/superseded")
        assert len(superseded) == 1 and superseded[0].startswith("step_00000002")
        kept = f"{mgr.store.recover_dir}/superseded/{superseded[0].rstrip('/')}"
        assert mgr.store.storage.exists(f"{kept}/COMMITTED")  # readable for inspection
        restored = mgr.restore({"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, step=2)
    assert np.asarray(restored.state["w"]).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_exports_are_uploaded_and_committed_then_retained(root, options, tmp_path):
    def exporter(state, out_dir):
        with open(os.path.join(out_dir, "model.bin"), "wb") as stream:
            stream.write(np.asarray(state["w"]).tobytes())

    export = jaxckpt.ExportConfig(every=jaxckpt.Every(steps=1), exporter=exporter,
                                  keep_last_n=1)
    with manager(root, options, export=export) as mgr:
        for n in (1, 2):
            mgr.maybe_save(step(n), {"w": jnp.full(3, float(n))})
        mgr.wait()
        entries = mgr.store.export_entries()
        assert [s for s, _ in entries] == [2]
        path = entries[0][1]
        assert mgr.store.verify(path) == []
        data = mgr.store.storage.read(f"{path}/model.bin")
    assert np.frombuffer(data, np.float32).tolist() == [2.0, 2.0, 2.0]


def test_a_save_reads_no_array_back_and_its_requests_are_counted(root, options):
    """The commit takes the writer's checksums: no chunk object is read back. The counts
    per save of a small state are the figures docs/cloud.md gives."""
    calls: list[str] = []
    state = {"a": jnp.ones((256, 256)), "b": jnp.zeros(10), "c": jnp.arange(5)}
    with manager(root, options, mode="sync") as mgr:
        mgr.save(step(1), state)  # first save: plans, directories
        events = mgr.store.storage.client.meta.events

        def record(event_name: str, params: dict, **kwargs) -> None:
            if not params.get("Key", "").endswith("/.lock"):  # the lease's heartbeat
                calls.append(f"{event_name.rsplit('.', 1)[-1]} {params.get('Key', '')}")

        events.register("before-parameter-build.s3", record)
        mgr.save(step(2), state)
        events.unregister("before-parameter-build.s3", record)
    reads_back = [c for c in calls if c.startswith("GetObject") and "/c/" in c]
    assert reads_back == []
    arrays = sum(c.startswith("PutObject") and c.endswith("/zarr.json") for c in calls)
    # A zarr.json and a chunk per stored array, 3 Orbax metadata files, tree.json,
    # driver.json, the marker; then listing, free room, retention: at most 2A + 15 here
    # (the exact counts: test_requests_of_a_save_and_a_restore_are_pinned_per_array).
    assert sum(c.startswith("PutObject") for c in calls) == 2 * arrays + 6, calls
    assert len(calls) <= 2 * arrays + 15, calls
    # Nothing the commit checksums is read back: what this storage wrote, it knows.
    assert not [c for c in calls if c.startswith("GetObject") and "/step_" in c], calls


def test_a_partial_restore_on_s3_fetches_only_the_subtree(root, options):
    """``restore(like, partial=True)`` on an object store: the arrays outside ``like`` are
    never fetched (counted per GET), and the result has exactly ``like``'s keys."""
    rng = np.random.default_rng(1)
    state = {"params": {"w": jnp.asarray(rng.standard_normal(400_000), jnp.float32)},
             "opt": {"mu": jnp.asarray(rng.standard_normal(400_000), jnp.float32),
                     "nu": jnp.asarray(rng.standard_normal(400_000), jnp.float32)}}
    with manager(root, options, mode="sync") as mgr:
        mgr.save(step(1), state)
    gets: list[str] = []
    with manager(root, options) as mgr:
        def record(params: dict, **kwargs) -> None:
            gets.append(params.get("Key", ""))

        mgr.store.storage.client.meta.events.register(
            "before-parameter-build.s3.GetObject", record)
        restored = mgr.restore({"params": like_of(state["params"])}, partial=True)
    assert list(restored.state) == ["params"] and list(restored.state["params"]) == ["w"]
    assert_bit_equal(restored.state["params"], state["params"])
    # Three arrays of 1.6 MB each, stored one per array directory (leaf_NNNNNN): the data of
    # exactly one of them is fetched (its values are checked above; every zarr.json is read).
    arrays = [key.split("/state/arrays/")[1] for key in gets if "/state/arrays/" in key]
    data = {name.split("/")[0] for name in arrays
            if name.startswith("leaf_") and not name.endswith("zarr.json")}
    assert len(data) == 1, arrays


def test_a_local_tier_over_an_s3_root_resumes_from_the_newest_of_both(root, options,
                                                                       tmp_path, client):
    """LocalTier on the machine's disk over a durable s3:// root: the frequent saves stay
    local, the durable cadence goes to the bucket, and a new machine (no local tier)
    resumes from the bucket."""
    config = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=4), keep_last_n=2)
    local = jaxckpt.LocalTier(tmp_path / "local", every=jaxckpt.Every(steps=1))
    states = {n: {"w": jnp.full((64,), float(n))} for n in range(1, 7)}
    with manager(root, options, recover=config, local=local, mode="sync") as mgr:
        for n in range(1, 7):
            mgr.maybe_save(step(n), states[n])
    durable = sorted({key.split("/")[1] for key in keys_under(client, root)
                      if key.startswith("recover/step_")})
    assert len(durable) == 1  # one durable save in six steps; the rest went to the local tier
    durable_step = int(durable[0].split("_")[1])
    like = {"w": jax.ShapeDtypeStruct((64,), jnp.float32)}
    with manager(root, options, recover=config, local=local) as mgr:
        recovered = mgr.recover(like)
    assert (recovered.tier, recovered.step_info.global_step) == ("local", 6)
    assert_bit_equal(recovered.state, states[6])
    fresh = jaxckpt.LocalTier(tmp_path / "new-machine", every=jaxckpt.Every(steps=1))
    with pytest.warns(jaxckpt.CheckpointWarning), \
            manager(root, options, recover=config, local=fresh) as mgr:
        recovered = mgr.recover(like)
    assert (recovered.tier, recovered.step_info.global_step) == ("durable", durable_step)
    assert_bit_equal(recovered.state, states[durable_step])


def test_verification_reads_the_server_not_what_this_process_wrote(root, options, client):
    state = {"w": jnp.arange(4.0)}
    with manager(root, options) as mgr:
        mgr.save(step(1), state, mode="sync")
        path = mgr.store.step_path(1)
        key = f"{path.split('/', 3)[3]}/driver.json"
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        client.put_object(Bucket=BUCKET, Key=key, Body=body.replace(b'"', b"'", 1))
        problems = mgr.store.verify(path)
    assert problems and "driver.json" in problems[0], problems


def test_cli_ls_verify_and_info_read_a_root_the_manager_wrote(root, options, capsys,
                                                              monkeypatch, tmp_path):
    from jaxckpt.tools.cli import main

    state = {"w": jnp.arange(6.0), "key": jax.random.key(1)}
    with manager(root, options) as mgr:
        mgr.save(step(3), state, metrics={"loss": 0.5})
        mgr.wait()
        checkpoint = mgr.store.step_path(3)
    monkeypatch.chdir(tmp_path)
    for name, value in {"AWS_ENDPOINT_URL": options["endpoint_url"],
                        "AWS_REGION": options["region_name"],
                        "AWS_ACCESS_KEY_ID": options["aws_access_key_id"],
                        "AWS_SECRET_ACCESS_KEY": options["aws_secret_access_key"]}.items():
        monkeypatch.setenv(name, value)
    assert main(["ls", root]) == 0
    assert "step_00000003" in capsys.readouterr().out
    assert main(["verify", root, ]) == 0
    assert "OK      " + checkpoint in capsys.readouterr().out
    assert main(["info", root]) == 0
    assert f"step 3 ({checkpoint})" in capsys.readouterr().out
    assert main(["info", checkpoint, "--tree"]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and "['w']" in out and "loss" in out
    assert os.listdir(tmp_path) == []


def test_saves_through_a_faulty_network_leave_every_checkpoint_restorable(root, options):
    """503s, connections dropped before and after the server acted, and slow answers on a
    quarter of the requests: every save commits (retries, and create-only writes that
    recognise their own landed first try), a save that cannot get through fails without
    harm, and every earlier checkpoint restores bit-exact."""
    proxy = FaultProxy(options["endpoint_url"], seed=3, rates={
        "unavailable": 0.08, "drop_before": 0.06, "drop_after": 0.06, "slow": 0.05})
    states = {n: {"w": jnp.arange(2000.0) * n, "b": jnp.full(3, n, jnp.int32)}
              for n in (1, 2, 3, 4)}
    flaky = {**options, "endpoint_url": proxy.url, "max_attempts": 10, "read_timeout": 10}
    try:
        keep_all = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=None)
        with manager(root, flaky, recover=keep_all) as mgr:
            for n, state in states.items():
                mgr.maybe_save(step(n), state)
            mgr.wait()
            proxy.rates = {"unavailable": 1.0}  # the store stops answering for one save
            # It fails (on the training thread, or at the next call for the background part;
            # which depends on where the first request is refused) and leaves no marker.
            with pytest.raises(Exception, match="503|Service Unavailable"):
                mgr.maybe_save(step(5), {"w": jnp.zeros(2000), "b": jnp.zeros(3, jnp.int32)})
                mgr.wait()
            proxy.enabled = False
    finally:
        proxy.close()
    assert all(proxy.counts[name] for name in FAULTS), proxy.counts
    like = {"w": jax.ShapeDtypeStruct((2000,), jnp.float32),
            "b": jax.ShapeDtypeStruct((3,), jnp.int32)}
    with manager(root, options) as mgr:  # straight to the server
        assert mgr.committed_steps() == [1, 2, 3, 4]
        for n, state in states.items():
            assert mgr.store.verify(mgr.store.step_path(n)) == []
            assert_bit_equal(mgr.restore(like, step=n).state, state)


SHARDED_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
import jaxckpt
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

options = json.loads(sys.argv[2])
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
shardings = {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P("model"))}
state = {"w": jax.device_put(jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32),
                             shardings["w"]),
         "b": jax.device_put(jnp.arange(32, dtype=jnp.bfloat16), shardings["b"])}
with jaxckpt.CheckpointManager(sys.argv[1], storage_options=options,
                               preemption_signals=()) as mgr:
    mgr.save(jaxckpt.StepInfo(0, 1, 1, None), state, mode="sync")
like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in state.items()}
with jaxckpt.CheckpointManager(sys.argv[1], storage_options=options,
                               preemption_signals=()) as mgr:
    restored = mgr.recover(like).state
for name, value in restored.items():
    assert value.sharding == shardings[name], (name, value.sharding)
    assert np.asarray(value).tobytes() == np.asarray(state[name]).tobytes(), name
print("OK", len(jax.devices()))
"""


def test_arrays_sharded_over_eight_devices_round_trip_onto_their_shardings(root, options):
    import json
    import subprocess
    import sys

    from support.harness import repo_env

    env = repo_env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT, root, json.dumps(options)],
                          env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "OK 8"


def test_items_and_stateful_objects_round_trip_on_s3_as_on_disk(root, options, tmp_path):
    class Loader:
        def __init__(self):
            self.position = 0

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            self.position = state["position"]

    def run(where, storage_options):
        def open_manager():
            return jaxckpt.CheckpointManager(
                where, storage_options=storage_options, preemption_signals=(),
                recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=2),
                items={"ref": jaxckpt.Every(steps=2)})

        loader = Loader()
        with open_manager() as mgr:
            for n in (1, 2, 3):
                loader.position = 10 * n
                mgr.maybe_save(step(n), {"w": jnp.full(3, float(n))},
                               stateful={"loader": loader},
                               items={"ref": {"p": jnp.full(2, float(n))}})
            mgr.wait()
            versions = mgr.store.item_versions("ref")
        fresh = Loader()
        with open_manager() as mgr:
            recovered = mgr.recover({"w": jax.ShapeDtypeStruct((3,), jnp.float32)},
                                    stateful={"loader": fresh},
                                    items={"ref": {"p": jax.ShapeDtypeStruct((2,), jnp.float32)}})
        return (recovered.step_info.global_step, fresh.position, versions,
                np.asarray(recovered.state["w"]).tolist(),
                np.asarray(recovered.items["ref"]["p"]).tolist())

    on_s3 = run(root, options)
    assert on_s3[:2] == (3, 30) and on_s3[3] == [3.0] * 3
    assert on_s3 == run(tmp_path / "local", None)


@pytest.mark.parametrize("change", ["longer", "shorter"])
def test_a_chunk_object_of_the_wrong_size_is_refused_as_corrupt(root, options, change):
    from jaxckpt.errors import CheckpointCorruptError
    from jaxckpt.storage.url import parse_root

    _, storage = parse_root(root, options)
    files = array_files.StorageArrayFiles(storage)
    array = np.arange(1000, dtype=np.float32)
    chunk = f"{root}/state/arrays/leaf_000000/c/0"
    files.write_chunk(chunk, array, algorithm="crc32c", offset=0)
    content, _ = files.read_chunk(chunk, array.nbytes, algorithm=None, offset=0)
    assert content[:array.nbytes].view(np.float32).tolist() == array.tolist()
    body = storage.read(chunk)
    storage.write(chunk, body + b"x" if change == "longer" else body[:-1])
    with pytest.raises(CheckpointCorruptError, match="is stored in"):
        files.read_chunk(chunk, array.nbytes, algorithm=None, offset=0)


def _recording(storage, calls: list[tuple[str, str, str]]):
    """Record (operation, key, thread name) of every request ``storage`` makes, the lease's
    heartbeat aside; returns the function to unregister."""
    def record(event_name: str, params: dict, **kwargs) -> None:
        key = params.get("Key", params.get("Prefix", ""))
        if not key.endswith("/.lock"):
            calls.append((event_name.rsplit(".", 1)[-1], key,
                          threading.current_thread().name))

    events = storage.client.meta.events
    events.register("before-parameter-build.s3", record)
    return lambda: events.unregister("before-parameter-build.s3", record)


@pytest.mark.parametrize("arrays", [1, 3])
def test_requests_of_a_save_and_a_restore_are_pinned_per_array(root, options, arrays):
    """Every request of a second save (housekeeping included) and of a restore by a new
    manager, for A arrays stored one per object: the counts docs/cloud.md gives, so that
    none can grow unnoticed. A restore asks for no object's size (the listing gives them)
    and reads the marker once (the choice hands its manifest to the deferred checks); a
    save asks nothing it already knows (the checkpoint directory's emptiness: one
    listing)."""
    rng = np.random.default_rng(3)
    state = {f"w{i}": jnp.asarray(rng.standard_normal(300_000), jnp.float32)  # > 1 MiB
             for i in range(arrays)}
    calls: list[tuple[str, str, str]] = []
    with manager(root, options, mode="sync",
                 recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1),
                                               keep_last_n=None)) as mgr:
        mgr.save(step(1), state)
        mgr.wait()  # the first save's retention (background) is not the second save's
        stop = _recording(mgr.store.storage, calls)
        mgr.save(step(2), state)
        mgr.wait()
        stop()
    save = [(op, key) for op, key, _ in calls]
    chunks = sum(op == "PutObject" and "/c/" in key for op, key in save)
    assert chunks == arrays, save
    # A zarr.json and a chunk per array, 3 Orbax metadata files, tree.json, driver.json,
    # the marker; 5 listings (room: the step, its state/; the commit's; retention: the
    # root, items) and pins.json. No HEAD: retention knows the markers this process wrote.
    # (Counted from the end of the first save's retention: before, whether its two
    # listings fell inside the count depended on the threads' timing, 2A + 12 or 14.)
    assert sum(op == "PutObject" for op, _ in save) == 2 * arrays + 6, save
    assert not [c for c in save if c[0] == "HeadObject"], save
    assert len(save) == 2 * arrays + 12, "\n".join(map(str, save))
    calls.clear()
    with manager(root, options) as mgr:
        stop = _recording(mgr.store.storage, calls)
        restored = mgr.restore(like_of(state))
        stop()
    assert_bit_equal(restored.state, state)
    read = [(op, key) for op, key, _ in calls]
    assert not [c for c in read if c[0] == "HeadObject"], read
    assert sum(op == "GetObject" and key.endswith("/COMMITTED") for op, key in read) == 1
    # The root's listing, the marker, the step's listing; every small file once (a
    # zarr.json per array, 3 Orbax files, tree.json, driver.json), a chunk per array. The
    # reader lists nothing: the files it was given to check tell it its directories exist.
    assert not [c for c in read if c[0] == "ListObjectsV2" and "/state/" in c[1]], read
    assert len(read) == 2 * arrays + 8, "\n".join(map(str, read))


#: A request to hold in flight (its name passes the first test) until the names of every
#: request started so far pass the second.
Hold = tuple[Callable[[str], bool], Callable[[list[str]], bool]]
HOLD_DEADLINE_S = 30.0  # reached only when what a hold waits for never comes: a failure


class _InFlight:
    """Which S3 requests of a step were in flight together, seen through a proxy that
    delays every answer (so that requests sent one after the other never overlap):
    ``overlapped[name]`` holds the requests in flight at some moment while ``name`` was.
    A request is named by its operation and its key after ``split``.

    ``holds`` keep a request in flight until other requests have started (or
    ``HOLD_DEADLINE_S`` passed): two requests sent independently then overlap however the
    threads are scheduled (with the delay alone, a thread that a loaded machine started
    0.1 s late missed its partner), and a request sent only after another one finished
    still never overlaps it (it cannot start while that one waits for it)."""

    def __init__(self, options: dict, split: str, holds: Sequence[Hold] = ()):
        self.proxy = FaultProxy(options["endpoint_url"], rates={"slow": 1.0}, slow_s=0.1)
        self.options = {**options, "endpoint_url": self.proxy.url}
        self.overlapped: dict[str, set[str]] = {}
        self._split = split
        self._holds = list(holds)
        self._lock = threading.Condition()
        self._flying: set[str] = set()
        self._started: list[str] = []

    def _start(self, event_name: str, params: dict, **kwargs) -> None:
        key = params.get("Key", params.get("Prefix", ""))
        if "/step_" in key:
            name = f"{event_name.rsplit('.', 1)[-1]} {key.split(self._split, 1)[1]}"
            threading.current_thread().jaxckpt_request = name  # type: ignore[attr-defined]
            with self._lock:
                for other in self._flying:
                    self.overlapped.setdefault(other, set()).add(name)
                self.overlapped.setdefault(name, set()).update(self._flying)
                self._flying.add(name)
                self._started.append(name)
                self._lock.notify_all()
                for matches, until in self._holds:
                    if matches(name):
                        self._lock.wait_for(lambda until=until: until(self._started),
                                            timeout=HOLD_DEADLINE_S)

    def _end(self, **kwargs) -> None:
        with self._lock:
            self._flying.discard(getattr(threading.current_thread(), "jaxckpt_request", ""))

    @contextlib.contextmanager
    def watching(self, mgr):
        events = mgr.store.storage.client.meta.events
        events.register("before-parameter-build.s3", self._start)
        events.register("after-call.s3", self._end)
        try:
            yield
        finally:
            events.unregister("before-parameter-build.s3", self._start)
            events.unregister("after-call.s3", self._end)

    def close(self) -> None:
        self.proxy.close()


def test_the_prelude_of_a_restore_overlaps_its_round_trips(root, options):
    """Before its first chunk GET a restore waits on small requests only where one needs
    another's answer: the step's listing is in flight while its marker is fetched (both
    need only the step's name), and the small objects the manifest lists are fetched all at
    once. Through a proxy that delays every answer, so that two requests sent one after the
    other are never in flight together; the assertions count requests in flight, not time."""
    rng = np.random.default_rng(5)
    state = {f"w{i}": jnp.asarray(rng.standard_normal(300_000), jnp.float32)
             for i in range(3)}
    with manager(root, options, mode="sync") as mgr:
        mgr.save(step(1), state)
    def small(name: str) -> bool:
        return name.startswith("GetObject") and "/c/" not in name \
            and not name.endswith("/COMMITTED")

    marker, listing = "GetObject 00000001/COMMITTED", "ListObjectsV2 00000001/"
    flight = _InFlight(options, "/step_", holds=[
        (lambda name: name == marker, lambda started: listing in started),
        (lambda name: name == listing, lambda started: marker in started),
        (small, lambda started: sum(map(small, started)) >= 3 + 3 + 2)])
    try:
        with manager(root, flight.options) as mgr, flight.watching(mgr):
            restored = mgr.restore(like_of(state))
    finally:
        flight.close()
    overlapped = flight.overlapped
    assert_bit_equal(restored.state, state)
    assert "ListObjectsV2 00000001/" in overlapped["GetObject 00000001/COMMITTED"], overlapped
    small = [name for name in overlapped if name.startswith("GetObject")
             and "/c/" not in name and not name.endswith("/COMMITTED")]
    assert len(small) == 3 + 3 + 2, small  # zarr.json each, Orbax's 3, tree and driver
    # Each small GET overlapped every other one: none waited for another's answer.
    assert all(set(small) - {name} <= overlapped[name] for name in small), overlapped


def test_small_objects_of_a_save_do_not_wait_on_the_chunk_threads(root, options):
    """zarr.json and Orbax's metadata files go up on threads of their own, all in flight
    at once, never on the threads that upload chunks (whose next upload would wait for
    each small round trip); the save returns only once they are stored."""
    rng = np.random.default_rng(4)
    state = {f"w{i}": jnp.asarray(rng.standard_normal(300_000), jnp.float32)
             for i in range(3)}
    calls: list[tuple[str, str, str]] = []
    with manager(root, options, mode="sync") as mgr:
        stop = _recording(mgr.store.storage, calls)
        report = mgr.save(step(1), state)
        stop()
        small = [(key, thread) for op, key, thread in calls if op == "PutObject"
                 and "/state/arrays/" in key and "/c/" not in key]
        assert len(small) == 3 + 3, calls
        assert all(thread.startswith("jaxckpt-put") for _, thread in small), small
        assert mgr.store.verify(report.path) == []


def test_a_sync_save_sends_its_small_objects_while_the_chunks_go_up(root, options):
    """Of what a sync save writes, only the commit (its listing and the marker) waits for
    the last chunk: Orbax's three metadata files and tree.json are each in flight while a
    chunk PUT is, and driver.json while the write's requests are (they went up one round
    trip each in line, before the first chunk or after the last). Through a proxy that
    delays every answer, so that requests sent one after the other are never in flight
    together; the assertions count requests in flight, not time."""
    rng = np.random.default_rng(6)
    state = {f"w{i}": jnp.asarray(rng.standard_normal(300_000), jnp.float32)
             for i in range(2)}
    metadata = ["PutObject /state/arrays/_METADATA", "PutObject /state/arrays/_CHECKPOINT_METADATA",
                "PutObject /state/arrays/commit_success.txt"]

    def chunk(name: str) -> bool:
        return name.startswith("PutObject") and "/c/" in name

    flight = _InFlight(options, "/step_00000001", holds=[
        (lambda name: name == "PutObject /state/tree.json",
         lambda started: any(map(chunk, started))),
        (chunk, lambda started: set(metadata) <= set(started)),
        (lambda name: name == "PutObject /driver.json",
         lambda started: len(started) > started.index("PutObject /driver.json") + 1)])
    try:
        with manager(root, flight.options, mode="sync") as mgr:
            with flight.watching(mgr):
                report = mgr.save(step(1), state)
            assert mgr.store.verify(report.path) == []
    finally:
        flight.close()
    overlapped = flight.overlapped
    chunks = {name for name in overlapped if "/c/" in name}
    assert len(chunks) == 2, overlapped
    for name in ("arrays/_METADATA", "arrays/_CHECKPOINT_METADATA",
                 "arrays/commit_success.txt", "tree.json"):
        assert overlapped[f"PutObject /state/{name}"] & chunks, (name, overlapped)
    assert overlapped["PutObject /driver.json"], overlapped
    assert not overlapped["PutObject /COMMITTED"], overlapped


def test_a_chunk_goes_up_from_the_arrays_memory_without_a_copy(root, options):
    """A chunk object's PUT reads its body from the staged array and the shard index in
    turn (a stream over both), instead of from a buffer the writer filled with a copy of
    them first: for a 32 MiB array that copy into fresh memory cost about as much CPU as
    the PUT itself did here. The object stored is the same, bytes and checksum."""
    bodies: dict[str, object] = {}

    def record(params: dict, **kwargs) -> None:
        if "/c/" in params.get("Key", ""):
            bodies[params["Key"]] = params["Body"]

    state = {"w": jnp.arange(600_000, dtype=jnp.float32)}  # > 1 MiB: not a kept object
    with manager(root, options, mode="sync") as mgr:
        mgr.store.storage.client.meta.events.register(
            "before-parameter-build.s3.PutObject", record)
        report = mgr.save(step(1), state)
        assert mgr.store.verify(report.path) == []
        restored = mgr.restore(like_of(state))
    assert len(bodies) == 1, bodies
    (body,) = bodies.values()
    assert not isinstance(body, (bytes, bytearray, memoryview)), type(body)
    assert_bit_equal(restored.state, state)


def test_a_chunk_put_carries_the_checksum_the_manifest_records(root, options):
    """Each chunk object goes up with the crc32c the writer computed of the bytes it sent
    (``x-amz-checksum-crc32c``: S3 refuses a body that does not match, and botocore
    computes no checksum of its own), the same value the commit records."""
    import base64

    sent: dict[str, str] = {}

    def record(params: dict, **kwargs) -> None:
        if "/c/" in params.get("Key", ""):
            sent[params["Key"]] = params.get("ChecksumCRC32C", "")

    state = {"w": jnp.arange(300_000, dtype=jnp.float32)}
    with manager(root, options, mode="sync") as mgr:
        mgr.store.storage.client.meta.events.register(
            "before-parameter-build.s3.PutObject", record)
        report = mgr.save(step(1), state)
        manifest = mgr.store.read_manifest(report.path)
    assert manifest is not None and len(sent) == 1, sent
    ((key, digest),) = sent.items()
    relative = key.split("/step_00000001/", 1)[1]
    assert digest, "no checksum sent with the chunk"
    assert base64.b64decode(digest).hex() == manifest.files[relative]["crc32c"]
