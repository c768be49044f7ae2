"""S3Storage against a moto S3 server this module starts on 127.0.0.1: what only S3 has
or only S3 is checked for (locations outside its prefix, listings of many pages, renewal of
the lease while held, the commit protocol of CheckpointStore, the CLI over s3://, retries
that leave the random stream alone, ``read_into``). What every object store keeps (the
Storage contract, create-only races, lease takeover, bounded retries) is
test_object_store_contract.py, run against S3 and GCS alike."""

import logging
import os
import random
import time
import uuid

import pytest

from support.fault_proxy import FaultProxy

pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

from jaxckpt import RootLockedError  # noqa: E402
from jaxckpt.commit.store import CheckpointStore  # noqa: E402
from jaxckpt.storage.base import Storage  # noqa: E402
from jaxckpt.storage.s3 import storage as s3_storage  # noqa: E402
from jaxckpt.storage.s3.storage import S3Storage, s3_client  # noqa: E402

BUCKET = "jaxckpt-test"
PREFIX = "runs"
# Leases of a few seconds keep the tests short; the margin between a heartbeat (0.5 s) and
# the lease (3 s) absorbs a loaded machine's pauses.
SHORT_LEASE = {"lease_s": 3.0, "heartbeat_s": 0.5}


@pytest.fixture(scope="module")
def options():
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        opts = {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1",
                "aws_access_key_id": "testing", "aws_secret_access_key": "testing",
                "max_attempts": 2}
        s3_client(opts).create_bucket(Bucket=BUCKET)
        yield opts
    finally:
        server.stop()


@pytest.fixture
def storage(options):
    return S3Storage(BUCKET, PREFIX, storage_options=options, **SHORT_LEASE)


@pytest.fixture
def base():
    return f"s3://{BUCKET}/{PREFIX}/{uuid.uuid4().hex}"


def test_s3_storage_is_a_storage_and_refuses_locations_outside_its_prefix(storage):
    assert isinstance(storage, Storage)
    for outside in (f"s3://other-bucket/{PREFIX}/x", f"s3://{BUCKET}/elsewhere/x",
                    f"s3://{BUCKET}/{PREFIX}x/y", "/local/path"):
        with pytest.raises(ValueError):
            storage.read(outside)


def test_listing_pages_through_more_than_one_page(storage, base, options):
    # The server pages at 1000 keys; listing must ask for every page.
    client = storage.client
    for index in range(1005):
        client.put_object(Bucket=BUCKET, Key=storage.key(f"{base}/d/f{index:05d}"), Body=b"x")
    assert len(storage.list_files(f"{base}/d")) == 1005
    assert len(storage.list_names(f"{base}/d")) == 1005
    storage.delete_prefix(f"{base}/d")  # more than one delete batch
    assert storage.list_files(f"{base}/d") == {}


def test_a_lease_is_renewed_while_held(storage, base):
    lease = storage.lock_root(base)
    try:
        time.sleep(SHORT_LEASE["lease_s"] * 2)  # several heartbeats, past one lease length
        with pytest.raises(RootLockedError, match="another manager of this same process"):
            storage.lock_root(base)
        assert not lease.lost
    finally:
        lease.release()
    storage.lock_root(base).release()


def test_checkpoint_store_commits_verifies_and_deletes_on_s3(storage, base):
    store = CheckpointStore(base, storage=storage)
    store.ensure_dirs()
    lease = store.lock()
    try:
        for step in (1, 2, 3):
            path = store.step_path(step)
            store.write_file(path, "driver.json", b'{"step": %d}' % step)
            store.write_file(path, "state/arrays/leaf", bytes(range(256)) * (step * 100))
            if step < 3:  # step 3 stays partial (its writer "crashed" before the commit)
                manifest = store.commit(path, step)
                assert set(manifest.files) == {"driver.json", "state/arrays/leaf"}
        assert store.verify(store.step_path(2)) == []
        assert [e.status for e in store.entries()] == ["committed", "committed", "partial"]
        latest, skipped = store.latest_valid()
        assert latest.step == 2 and [e.step for e in skipped] == [3]
        with pytest.raises(FileExistsError):  # committing twice is refused by the server
            store.commit(store.step_path(2), 2)
        # A corrupted object is caught by its checksum; latest falls back to step 1.
        storage.write(f"{store.step_path(2)}/state/arrays/leaf", bytes(51200))
        assert any("contents altered" in p for p in store.verify(store.step_path(2)))
        assert store.latest_valid()[0].step == 1
        with store.reading(store.step_path(1)):
            assert store.delete(store.step_path(1)) is False
        assert store.delete(store.step_path(1)) is True
        assert storage.list_files(store.step_path(1)) == {}
        assert store.committed_steps() == [2]
        assert store.cleanup_partial() == [store.step_path(3)]
        # No rename on S3: quarantine copies on the server, then deletes (marker first).
        before = storage.list_files(store.step_path(2))
        moved = store.quarantine(store.step_path(2), "corrupt")
        assert "/recover/superseded/" in moved
        assert storage.list_files(moved) == before
        assert not storage.is_prefix(store.step_path(2))
        assert store.committed_steps() == []
    finally:
        lease.release()


def test_incremental_refs_retire_and_purge_on_s3(storage, base):
    """No rename on S3: a checkpoint whose file later ones refer to is retired in place
    (RETIRED, then COMMITTED deleted, then what nobody refers to), a kill mid-retire is
    finished by start-up cleanup, and the last referrer's deletion purges it."""
    from jaxckpt.core.layout import RETIRED_MARKER

    store = CheckpointStore(base, storage=storage)
    store.ensure_dirs()
    frozen = bytes(range(256)) * 40
    path0 = store.step_path(0)
    store.write_file(path0, "driver.json", b"{}")
    store.write_file(path0, "state/frozen", frozen)
    store.commit(path0, 0)
    for step in (1, 2):
        path = store.step_path(step)
        store.write_file(path, "driver.json", b"{}")
        offered = store.incremental_files(store.step_path(step - 1))
        refs = {key: info for key, info in offered.items() if key.endswith("state/frozen")}
        assert list(refs) == ["step_00000000/state/frozen"]
        store.commit(path, step, refs=refs)
    # A kill after the RETIRED marker was written: both markers, no checkpoint any more.
    store.storage.write(f"{path0}/{RETIRED_MARKER}", b"{}")
    restarted = CheckpointStore(base, storage=storage)
    assert restarted.committed_steps() == [1, 2]
    assert restarted.cleanup_partial() == []
    assert sorted(storage.list_files(path0)) == [RETIRED_MARKER, "state/frozen"]
    assert restarted.verify(store.step_path(2)) == []
    assert restarted.delete(store.step_path(1)) and restarted.delete(store.step_path(2))
    assert storage.list_files(f"{base}/recover") == {}


@pytest.fixture
def s3_environment(options, monkeypatch):
    """The standard environment variables the CLI reads (it takes no storage_options)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_REGION", options["region_name"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["aws_secret_access_key"])


def _committed_root(storage, base) -> CheckpointStore:
    store = CheckpointStore(base, storage=storage)
    for step in (1, 2):
        path = store.step_path(step)
        store.write_file(path, "driver.json", b"{}")
        store.write_file(path, "state/leaf", bytes(range(256)) * 4)
        store.commit(path, step)
    return store


def test_cli_ls_and_verify_read_an_s3_root(storage, base, s3_environment, capsys, tmp_path,
                                           monkeypatch):
    from jaxckpt.tools.cli import main

    monkeypatch.chdir(tmp_path)
    store = _committed_root(storage, base)
    assert main(["ls", base]) == 0
    out = capsys.readouterr().out
    assert "step_00000001" in out and "step_00000002" in out and "committed" in out
    assert main(["verify", base]) == 0
    assert capsys.readouterr().out.count("OK ") == 2
    storage.write(f"{store.step_path(2)}/state/leaf", bytes(1024))  # same size, other bytes
    storage.write(f"{store.step_path(3)}/driver.json", b"{}")  # a partial checkpoint
    assert main(["verify", base]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT " + store.step_path(2) in out and "contents altered" in out
    assert "PARTIAL " + store.step_path(3) in out
    assert main(["verify", store.step_path(1)]) == 0  # one checkpoint
    assert capsys.readouterr().out.startswith("OK      " + store.step_path(1))
    assert main(["ls", f"{base}/recover", "--checksums"]) == 1
    assert "partial" in capsys.readouterr().out
    assert main(["ls", f"{base}/not-a-root"]) == 3
    assert "is not a jaxckpt checkpoint root" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # nothing local was created


def test_cli_refuses_what_it_cannot_read_on_object_storage(base, s3_environment, capsys,
                                                           tmp_path, monkeypatch):
    from jaxckpt.tools.cli import main

    monkeypatch.chdir(tmp_path)
    # A Hugging Face directory is read with local file I/O: a URL there is refused.
    assert main(["import-hf", base, str(tmp_path / "root"), "--arch", "llama"]) == 2
    assert "HF_DIR" in capsys.readouterr().err
    assert main(["ls", "az://bucket/run"]) == 2
    assert "the az:// scheme is not supported" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_retries_leave_the_global_random_stream_alone(options, base):
    # botocore draws each retry's jitter from the random module; on a save's background
    # threads that shifted the training loop's random stream (found while tracing the same
    # bug on gs://, tests/system/test_object_store_crash.py).
    proxy = FaultProxy(options["endpoint_url"])
    try:
        flaky = S3Storage(BUCKET, PREFIX, storage_options={
            **options, "endpoint_url": proxy.url, "max_attempts": 4})
        random.seed(1234)
        before = random.getstate()
        proxy.fail_next = 2  # two retries, each after a jittered wait
        flaky.write(f"{base}/retried", b"z")
        assert flaky.read(f"{base}/retried") == b"z"
        assert random.getstate() == before
    finally:
        proxy.close()


def test_read_into_reports_each_piece_as_it_lands_and_a_raising_progress_stops_it(
        storage, base, monkeypatch):
    """``progress`` hears of the body every ``_PROGRESS_PIECE`` bytes, in order, on the
    reading thread (the DCP restore's read-ahead checksums each piece while the rest comes
    down); what it raises ends the read there."""
    monkeypatch.setattr(s3_storage, "_PROGRESS_PIECE", 1 << 20)
    data = os.urandom((3 << 20) + 123)
    storage.write(f"{base}/blob", data)
    counts: list[int] = []
    out = bytearray(len(data) + 1)
    assert storage.read_into(f"{base}/blob", memoryview(out), progress=counts.append) == len(data)
    assert bytes(out[:len(data)]) == data
    assert counts == sorted(counts) and counts[-1] == len(data) and len(counts) >= 4
    assert all(b - a <= 1 << 20 for a, b in zip([0, *counts[:-1]], counts, strict=True))

    class Stop(Exception):
        pass

    def stop(count):
        raise Stop

    with pytest.raises(Stop):
        storage.read_into(f"{base}/blob", memoryview(bytearray(len(data))), progress=stop)
    assert storage.read(f"{base}/blob") == data  # the client goes on working


def test_read_into_fills_the_buffer_from_the_socket_and_keeps_the_connection(
        storage, base, monkeypatch):
    """``read_into`` moves a GET's body straight into the caller's buffer: urllib3's own
    read (a new buffer per call, then a copy) is never used for it, and the connection goes
    back to the pool once the body is read (moto answers ``Connection: close``, so the
    pool's reuse itself cannot be seen here)."""
    import urllib3

    data = os.urandom(3 << 20)
    storage.write(f"{base}/blob", data)
    storage.read_into(f"{base}/blob", memoryview(bytearray(8)))  # warms one connection
    counts = {"read": 0, "release": 0}
    real_read = urllib3.response.HTTPResponse.read
    real_release = urllib3.response.HTTPResponse.release_conn

    def counting_read(self, *args, **kwargs):
        counts["read"] += 1
        return real_read(self, *args, **kwargs)

    def counting_release(self, *args, **kwargs):
        counts["release"] += 1
        return real_release(self, *args, **kwargs)

    monkeypatch.setattr(urllib3.response.HTTPResponse, "read", counting_read)
    monkeypatch.setattr(urllib3.response.HTTPResponse, "release_conn", counting_release)
    for _ in range(3):
        out = bytearray(len(data) + 1)
        assert storage.read_into(f"{base}/blob", memoryview(out)) == len(data)
        assert bytes(out[:len(data)]) == data
        part = bytearray(1000)
        assert storage.read_into(f"{base}/blob", memoryview(part), offset=5000) == 1000
        assert bytes(part) == data[5000:6000]
    assert counts == {"read": 0, "release": 6}
