"""The store's file-level calls that the manager's save and restore paths use: the commit
marker test, driver files, the done markers of a multi-process commit, the root lock, and
publishing an export under its final name."""

import os

import pytest

from jaxckpt import RootLockedError
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.core.layout import COMMIT_MARKER, DRIVER_FILE, done_marker_name


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(str(tmp_path / "root"))
    s.ensure_dirs()
    return s


def test_driver_file_round_trip_and_commit_marker(store):
    path = store.step_path(3)
    os.makedirs(path)
    store.write_file(path, DRIVER_FILE, b'{"a": 1}')
    assert store.read_file(path, DRIVER_FILE) == b'{"a": 1}'
    with pytest.raises(FileNotFoundError):
        store.read_file(path, "driver.p00001.json")
    assert not store.is_committed(path)
    store.commit(path, 3)
    assert store.is_committed(path)
    assert set(store.read_manifest(path).files) == {DRIVER_FILE}


def test_all_done_waits_for_every_other_process(store):
    path = store.step_path(1)
    os.makedirs(path)
    assert store.all_done(path, 1)  # one process: nobody to wait for
    assert not store.all_done(path, 3)
    store.mark_done(path, 1)
    assert not store.all_done(path, 3)
    store.mark_done(path, 2)
    assert store.all_done(path, 3)
    assert sorted(os.listdir(path)) == [done_marker_name(1), done_marker_name(2)]


def test_done_markers_carry_each_processs_checksums_into_the_commit(store):
    """A process's writer checksummed its files; the primary commits those entries without
    reading the files back (a wrong entry would show as the manifest's, not the file's)."""
    from jaxckpt.core.checksum import default_algorithm

    path = store.step_path(2)
    os.makedirs(os.path.join(path, "state"))
    with open(os.path.join(path, "state", "shard"), "wb") as stream:
        stream.write(b"12345")
    entry = {"size": 5, default_algorithm(): "0badc0de"}  # not the file's real checksum
    store.mark_done(path, 1, {"state/shard": entry})
    store.mark_done(path, 2)
    carried = store.done_checksums(path, 3)
    assert carried == {"state/shard": entry}
    manifest = store.commit(path, 2, known=carried)
    assert manifest.files["state/shard"] == entry
    hashed = {**entry, "xxh128": "0" * 32}  # an incremental writer's content hash is kept
    os.unlink(os.path.join(path, "COMMITTED"))
    assert store.commit(path, 2, known={"state/shard": hashed}).files["state/shard"] == hashed
    os.unlink(os.path.join(path, "COMMITTED"))
    with pytest.raises(ValueError, match="state/shard"):
        store.commit(path, 2, known={"state/shard": {**entry, "xxh128": "zz"}})


def test_lock_excludes_a_second_store_on_the_root(store):
    lease = store.lock()
    try:
        with pytest.raises(RootLockedError, match="in use by another running job"):
            CheckpointStore(store.root).lock()
    finally:
        lease.release()
    CheckpointStore(store.root).lock().release()


def test_publish_export_replaces_an_earlier_attempt(store):
    final = os.path.join(store.export_dir, "epoch0epochstep4globalstep4")
    for content in (b"first", b"second"):
        tmp = store.export_tmp_path(os.path.basename(final))
        os.makedirs(tmp)
        with open(os.path.join(tmp, "model.safetensors"), "wb") as handle:
            handle.write(content)
        store.publish_export(tmp, final)
    assert open(os.path.join(final, "model.safetensors"), "rb").read() == b"second"
    assert os.listdir(store.export_dir) == [os.path.basename(final)]
    assert store.size_of(final) == len(b"second")
    assert store.export_entries() == [(4, final)]
    assert not os.path.exists(os.path.join(final, COMMIT_MARKER))
