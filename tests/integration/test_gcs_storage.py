"""GCSStorage against a GCS emulator this module starts on 127.0.0.1, reached through a
proxy that enforces generation preconditions as GCS does (the emulator ignores them:
tests/support/gcs_server.py): what only GCS has, the preconditions a client sends (a lost
answer to a create, the lease's conditional requests), retries, the commit protocol of
CheckpointStore, the CLI over gs:// and the manager round trip. What every object store
keeps (the Storage contract, create-only races, lease takeover, bounded retries) is
test_object_store_contract.py, run against S3 and GCS alike."""

import itertools
import os
import random
import subprocess
import sys
import time
import uuid

import pytest

pytest.importorskip("google.cloud.storage")
pytest.importorskip("gcp_storage_emulator")

from jaxckpt import RootLockedError  # noqa: E402
from jaxckpt.commit.store import CheckpointStore  # noqa: E402
from jaxckpt.core.layout import COMMIT_MARKER  # noqa: E402
from jaxckpt.storage.base import Storage  # noqa: E402
from jaxckpt.storage.gcs.storage import GCSStorage  # noqa: E402

from support.gcs_server import PreconditionProxy, emulator  # noqa: E402

BUCKET = "jaxckpt-test"
PREFIX = "runs"
# Leases of a few seconds keep the tests short; the heartbeat (0.5 s) leaves a margin for a
# loaded machine. Short backoff: the tests that fail requests on purpose wait less.
SHORT_LEASE = {"lease_s": 3.0, "heartbeat_s": 0.5}
FAST_RETRIES = {"max_attempts": 4, "backoff_s": 0.05, "max_backoff_s": 0.2}


@pytest.fixture(scope="module")
def server():
    with emulator(BUCKET) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def proxy(server):
    front = PreconditionProxy(server)
    try:
        yield front
    finally:
        front.close()


@pytest.fixture
def options(proxy):
    proxy.fail_before = proxy.fail_after = 0
    proxy.requests.clear()
    return {"endpoint_url": proxy.url, **FAST_RETRIES}


@pytest.fixture
def storage(options):
    return GCSStorage(BUCKET, PREFIX, storage_options=options, **SHORT_LEASE)


@pytest.fixture
def base():
    return f"gs://{BUCKET}/{PREFIX}/{uuid.uuid4().hex}"


def test_gcs_storage_is_a_storage_and_refuses_locations_outside_its_prefix(storage):
    assert isinstance(storage, Storage)
    for outside in (f"gs://other-bucket/{PREFIX}/x", f"gs://{BUCKET}/elsewhere/x",
                    f"gs://{BUCKET}/{PREFIX}x/y", f"s3://{BUCKET}/{PREFIX}/x", "/local/path"):
        with pytest.raises(ValueError):
            storage.read(outside)
    with pytest.raises(ValueError, match="unknown keys"):
        GCSStorage(BUCKET, PREFIX, storage_options={"endpont_url": "typo"})


def test_create_only_writes_carry_if_generation_match_zero(storage, base, proxy):
    store = CheckpointStore(base, storage=storage)
    path = store.step_path(1)
    store.write_file(path, "driver.json", b"{}")
    store.commit(path, 1)
    marker = storage.name(f"{path}/{COMMIT_MARKER}")
    assert [u.query.get("ifGenerationMatch") for u in proxy.uploads(marker)] == ["0"]
    data = storage.name(f"{path}/driver.json")
    assert [u.query.get("ifGenerationMatch") for u in proxy.uploads(data)] == [None]


def test_a_create_whose_answer_was_lost_is_retried_and_counts_as_created(storage, base, proxy):
    # The first try is stored but its answer is a 503; the retry then fails its condition
    # (412) on the object the first try wrote: that is a success, not "already exists".
    proxy.fail_after = 1
    storage.create(f"{base}/COMMITTED", b"ours")
    assert [u.answered for u in proxy.uploads(storage.name(f"{base}/COMMITTED"))] == [503, 412]
    assert storage.read(f"{base}/COMMITTED") == b"ours"
    # Someone else's object behind the 412 is still "already exists".
    storage.write(f"{base}/other", b"theirs")
    proxy.fail_before = 1
    with pytest.raises(FileExistsError):
        storage.create(f"{base}/other", b"ours")


def test_uploads_and_retries_leave_the_global_random_stream_alone(storage, base, proxy):
    # The client draws multipart boundaries and retry jitter from the random module; on the
    # background threads of a save that shifted the training loop's random stream (found by
    # the gs:// kill trial, tests/system/test_object_store_crash.py: a run that never
    # resumed already differed from the same run on a local root at its first step).
    random.seed(1234)
    before = random.getstate()
    storage.write(f"{base}/plain", b"x")
    storage.create(f"{base}/COMMITTED", b"y")
    proxy.fail_before = 2  # two retries, each after a jittered wait
    storage.write(f"{base}/retried", b"z")
    assert storage.read(f"{base}/retried") == b"z"
    assert random.getstate() == before


def _plant_expired_lease(storage, base) -> int:
    """A lease left by a holder that stopped renewing 1 s leases; its generation."""
    blob = storage.upload(storage.name(f"{base}/.lock"),
                          b'{"holder": "dead", "host": "gone", "pid": 1, "lease_s": 1}')
    time.sleep(2.5)
    return int(blob.generation)


def test_lease_requests_are_conditional_on_the_generation_they_read(storage, base, proxy):
    generation = _plant_expired_lease(storage, base)
    proxy.requests.clear()
    name = storage.name(f"{base}/.lock")
    lease = storage.lock_root(base)
    # Two renewals at least (the heartbeat's, every 0.5 s), however slowly they come.
    deadline = time.monotonic() + 60
    while sum(r.name == name and r.method == "POST" for r in list(proxy.requests)) < 4:
        assert time.monotonic() < deadline, "the lease was never renewed"
        time.sleep(0.05)
    lease.release()
    writes = [r for r in proxy.requests if r.name == name and r.method in ("POST", "DELETE")]
    conditions = [(r.method, r.query.get("ifGenerationMatch"), r.answered) for r in writes]
    assert conditions[:2] == [("POST", "0", 412), ("POST", str(generation), 200)]
    assert len(conditions) >= 4 and conditions[-1][0] == "DELETE"
    for previous, current in itertools.pairwise(writes[1:]):  # renewals, then the release
        assert current.query.get("ifGenerationMatch") not in (None, "0", str(generation))
        assert current.query["ifGenerationMatch"] != previous.query["ifGenerationMatch"]
        assert current.answered in (200, 204)
    assert not storage.exists(f"{base}/.lock")


def test_a_lease_is_renewed_while_held_and_a_lost_answer_does_not_lose_it(storage, base,
                                                                          proxy):
    proxy.fail_after = 1  # the create's answer is lost: the lease must still be ours
    lease = storage.lock_root(base)
    try:
        time.sleep(SHORT_LEASE["lease_s"] * 2)  # several heartbeats, past one lease length
        with pytest.raises(RootLockedError, match="another manager of this same process"):
            storage.lock_root(base)
        assert not lease.lost
    finally:
        lease.release()
    storage.lock_root(base).release()


def test_checkpoint_store_commits_verifies_and_deletes_on_gcs(storage, base):
    store = CheckpointStore(base, storage=storage)
    store.ensure_dirs()
    lease = store.lock()
    try:
        for step in (1, 2, 3):
            path = store.step_path(step)
            store.write_file(path, "driver.json", b'{"step": %d}' % step)
            store.write_file(path, "state/arrays/leaf", bytes(range(256)) * (step * 100))
            if step < 3:  # step 3 stays partial (its writer "crashed" before the commit)
                store.commit(path, step)
        assert store.verify(store.step_path(2)) == []
        assert [e.status for e in store.entries()] == ["committed", "committed", "partial"]
        with pytest.raises(FileExistsError):  # committing twice is refused by the server
            store.commit(store.step_path(2), 2)
        storage.write(f"{store.step_path(2)}/state/arrays/leaf", bytes(51200))
        assert any("contents altered" in p for p in store.verify(store.step_path(2)))
        assert store.latest_valid()[0].step == 1
        with store.reading(store.step_path(1)):
            assert store.delete(store.step_path(1)) is False
        assert store.delete(store.step_path(1)) is True
        assert store.committed_steps() == [2]
        assert store.cleanup_partial() == [store.step_path(3)]
        assert storage.list_files(store.step_path(3)) == {}
    finally:
        lease.release()


def test_cli_ls_verify_and_info_read_a_gs_root(storage, base, options, capsys, tmp_path,
                                          monkeypatch):
    from jaxckpt.tools.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", options["endpoint_url"])
    store = CheckpointStore(base, storage=storage)
    for step in (1, 2):
        store.write_file(store.step_path(step), "state/leaf", bytes(range(256)) * 4)
        store.commit(store.step_path(step), step)
    assert main(["ls", base]) == 0
    out = capsys.readouterr().out
    assert "step_00000001" in out and "step_00000002" in out and "committed" in out
    storage.write(f"{store.step_path(2)}/state/leaf", bytes(1024))  # same size, other bytes
    assert main(["verify", base]) == 1
    out = capsys.readouterr().out
    assert "OK      " + store.step_path(1) in out
    assert "CORRUPT " + store.step_path(2) in out and "contents altered" in out
    assert main(["ls", f"{base}/not-a-root"]) == 3
    assert "is not a jaxckpt checkpoint root" in capsys.readouterr().err
    assert main(["info", f"{base}/recover/step_00000001"]) == 0
    info = capsys.readouterr().out
    assert info.startswith(f"path           {base}/recover/step_00000001") and "committed" in info
    assert main(["info", base]) == 0  # a root too
    assert "2 committed" in capsys.readouterr().out
    # export-hf reads gs:// roots too: this one's checkpoints hold no driver.json.
    assert main(["export-hf", base, "out", "--arch", "gpt2", "--config", str(tmp_path)]) == 1
    assert "driver.json is missing" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # nothing local was created


def test_copy_happens_on_the_server_and_a_missing_source_is_file_not_found(storage, base,
                                                                          proxy):
    storage.write(f"{base}/a", b"payload" * 100)
    proxy.requests.clear()
    storage.copy(f"{base}/a", f"{base}/sub/b")
    sent = [r for r in proxy.requests if r.name]  # the client's look at the bucket aside
    # One request naming both objects; no download of the bytes, no upload of them.
    assert [r.method for r in sent] == ["POST"], sent
    assert "/copyTo/" in sent[0].name or "/rewriteTo/" in sent[0].name, sent
    assert storage.read(f"{base}/sub/b") == b"payload" * 100
    with pytest.raises(FileNotFoundError):
        storage.copy(f"{base}/nothing", f"{base}/c")


def test_checkpoint_manager_round_trips_on_gs_with_lease_settings_in_storage_options(
        base, options, tmp_path, monkeypatch):
    """CheckpointManager("gs://...") through the same native seam as s3://: saves, keeps one,
    quarantines a step written again by server-side copy, restores bit-exact; the lease
    settings travel in storage_options as on s3://. Nothing local is created."""
    jax = pytest.importorskip("jax")
    import warnings

    import numpy as np

    import jaxckpt

    monkeypatch.chdir(tmp_path)
    like = {"w": jax.ShapeDtypeStruct((300_000,), np.float32)}

    def manager():
        return jaxckpt.CheckpointManager(
            base, storage_options={**options, **SHORT_LEASE}, preemption_signals=(),
            recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=2))

    def step(n):
        return jaxckpt.StepInfo(0, n, n, None)

    with manager() as mgr:
        for n in (1, 2, 3):
            mgr.save(step(n), {"w": jax.numpy.full(300_000, float(n))})
        mgr.wait()
        assert mgr.store.committed_steps() == [2, 3]
    with manager() as mgr:
        restored = mgr.restore(like, step=2)
        assert np.asarray(restored.state["w"])[[0, -1]].tolist() == [2.0, 2.0]
        mgr.maybe_save(step(2), {"w": jax.numpy.full(300_000, 2.0)})  # resumed at 2
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.maybe_save(step(3), {"w": jax.numpy.full(300_000, 7.0)})
            mgr.wait()
        assert any("moved to" in str(w.message) for w in caught)
        superseded = mgr.store.storage.list_names(f"{mgr.store.recover_dir}/superseded")
        assert len(superseded) == 1 and superseded[0].startswith("step_00000003")
    with manager() as mgr:
        recovered = mgr.recover(like)
    assert recovered.step_info.global_step == 3
    assert np.asarray(recovered.state["w"]).tobytes() == np.full(300_000, 7.0,
                                                                np.float32).tobytes()
    assert os.listdir(tmp_path) == []


def test_which_failures_are_transient():
    import requests
    from google.api_core import exceptions as api

    from jaxckpt.storage.gcs.storage import is_transient

    retried = [api.ServiceUnavailable("x"), api.TooManyRequests("x"), api.InternalServerError("x"),
               api.GatewayTimeout("x"), requests.ConnectionError("reset"), requests.ReadTimeout(),
               ConnectionResetError(), TimeoutError()]
    final = [api.PreconditionFailed("x"), api.NotFound("x"), api.Forbidden("x"),
             api.BadRequest("x"), ValueError("x")]
    assert [is_transient(e) for e in retried] == [True] * len(retried)
    assert [is_transient(e) for e in final] == [False] * len(final)


def test_cli_says_which_environment_to_check_when_no_credentials_are_found(
        capsys, tmp_path, monkeypatch):
    from jaxckpt.tools.cli import main

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    monkeypatch.chdir(tmp_path)
    assert main(["ls", f"gs://{BUCKET}/{PREFIX}/run"]) == 2
    assert "GOOGLE_APPLICATION_CREDENTIALS" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_a_missing_gcs_extra_names_the_extra(tmp_path):
    # A fresh interpreter in which the google namespace cannot be imported, as where
    # google-cloud-storage was never installed.
    from support.paths import REPO, TESTS

    program = (
        "import sys\n"
        "class Blocker:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'google':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Blocker())\n"
        "from jaxckpt.storage.url import parse_root\n"
        "try:\n"
        "    parse_root('gs://bucket/run')\n"
        "except ImportError as exc:\n"
        "    print('EXTRA', getattr(exc, 'extra', None), exc)\n"
        "from jaxckpt.tools.cli import main\n"
        "print('EXIT', main(['ls', 'gs://bucket/run']))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]))
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120, check=False)
    assert "EXTRA gcs" in done.stdout and "pip install 'jaxckpt[gcs]'" in done.stdout
    assert "EXIT 2" in done.stdout and "jaxckpt[gcs]" in done.stderr
    assert os.listdir(tmp_path) == []
