"""The store: commit protocol, listing, verification, retention deletion races, cleanup, lock."""

import json
import os
import subprocess
import sys
import threading

import pytest

from jaxckpt import CheckpointCorruptError, CheckpointNotFoundError, RootLockedError
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.core.layout import COMMIT_MARKER
from jaxckpt.core.manifest import DEFER_CHECKSUMS_OVER
from jaxckpt.storage.posix import FlockLock


def make_step(store, step, *, commit=True, payload=b"x" * 1000):
    path = store.step_path(step)
    os.makedirs(os.path.join(path, "state", "arrays"), exist_ok=True)
    with open(os.path.join(path, "state", "arrays", "leaf_0"), "wb") as f:
        f.write(payload)
    with open(os.path.join(path, "driver.json"), "w") as f:
        f.write("{}")
    if commit:
        store.commit(path, step)
    return path


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(str(tmp_path / "root"))
    s.ensure_dirs()
    return s


def test_commit_writes_manifest_with_sizes_and_checksums(store):
    path = make_step(store, 3)
    manifest = store.read_manifest(path)
    assert manifest.step == 3
    assert manifest.files["state/arrays/leaf_0"]["size"] == 1000
    assert set(manifest.files) == {"state/arrays/leaf_0", "driver.json"}
    assert manifest.total_bytes == 1002
    assert store.verify(path) == []


def test_step_without_marker_is_partial_and_never_latest(store):
    make_step(store, 1)
    make_step(store, 2, commit=False)
    entry, skipped = store.latest_valid()
    assert entry.step == 1
    assert [(e.step, e.status) for e in skipped] == [(2, "partial")]
    assert [(e.step, e.status) for e in store.entries()] == [(1, "committed"), (2, "partial")]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_newest_falls_back_to_previous_and_names_the_file(store, damage):
    make_step(store, 1)
    path = make_step(store, 2)
    leaf = os.path.join(path, "state", "arrays", "leaf_0")
    if damage == "truncate":
        os.truncate(leaf, 10)
    elif damage == "flip":
        with open(leaf, "r+b") as f:
            f.seek(500)
            f.write(b"y")
    else:
        os.unlink(leaf)
    problems = store.verify(path)
    assert len(problems) == 1 and problems[0].startswith("state/arrays/leaf_0")
    entry, skipped = store.latest_valid()
    assert entry.step == 1 and skipped[0].step == 2 and skipped[0].status == "corrupt"


def test_bit_flip_passes_size_check_but_not_checksum(store):
    path = make_step(store, 1)
    with open(os.path.join(path, "driver.json"), "r+b") as f:
        f.write(b"[]")
    assert store.verify(path, checksums=False) == []
    assert "crc32" in store.verify(path, checksums=True)[0]


def test_commit_makes_the_names_durable_while_it_checksums_the_files(store, monkeypatch):
    """The directories' fsyncs and the files' checksum-and-fsync pass are in flight
    together (each fsync waits for a flush of the device's cache, and flushes issued
    together are shared), and the marker comes after both: here every file's checksum
    waits until a directory fsync has begun. Done one after the other, the checksums
    would wait in vain (the timeout says so)."""
    from jaxckpt.storage import posix as storage_module

    path = make_step(store, 1, commit=False)
    naming = threading.Event()
    fsync_dir, checksum = storage_module.fsync_dir, storage_module.PosixStorage.checksum
    synced: list[str] = []

    def naming_fsync(directory):
        naming.set()
        fsync_dir(directory)
        synced.append(directory)

    def waiting_checksum(self, file, algorithm, *, sync=False):
        assert naming.wait(timeout=10), "the files were checksummed before any name synced"
        return checksum(self, file, algorithm, sync=sync)

    monkeypatch.setattr(storage_module, "fsync_dir", naming_fsync)
    monkeypatch.setattr(storage_module.PosixStorage, "checksum", waiting_checksum)
    store.commit(path, 1)
    assert store.verify(path) == []
    assert {os.path.join(path, "state", "arrays"), path} <= set(synced)


def test_commit_syncs_every_directory_but_those_its_writer_made_durable(store, monkeypatch):
    from jaxckpt.storage import posix as storage_module

    path = make_step(store, 1, commit=False)
    fsync_dir = storage_module.fsync_dir
    synced: list[str] = []
    monkeypatch.setattr(storage_module, "fsync_dir",
                        lambda directory: (synced.append(directory), fsync_dir(directory)))
    store.commit(path, 1, durable_dirs=("state/arrays",))
    assert store.verify(path) == []
    assert os.path.join(path, "state", "arrays") not in synced
    assert {path, os.path.join(path, "state"), store.recover_dir} <= set(synced)


@pytest.mark.parametrize("rel", ["../step_00000002", "/tmp", "state/../..", "state//arrays", ""])
def test_commit_refuses_a_durable_directory_outside_the_checkpoint(store, rel):
    path = make_step(store, 1, commit=False)
    with pytest.raises(ValueError, match="durable directory"):
        store.commit(path, 1, durable_dirs=(rel,))
    assert not store.is_committed(path)


def test_new_commits_record_crc32c_of_each_file(store):
    import google_crc32c

    path = make_step(store, 1, payload=os.urandom(3000))
    body = json.loads(open(os.path.join(path, COMMIT_MARKER)).read())
    assert body["format"] == "jaxckpt.commit/2"
    data = open(os.path.join(path, "state", "arrays", "leaf_0"), "rb").read()
    assert body["files"]["state/arrays/leaf_0"] == {
        "size": 3000, "crc32c": f"{google_crc32c.value(data):08x}"}


def test_crc32c_of_arrays_runs_without_the_gil_and_matches_the_extension():
    """Arrays go to the C library through ctypes (GIL released, so writer and reader
    threads checksum in parallel); the result is the extension's, for every length and
    starting value, and non-contiguous input still takes the extension's path."""
    import sys
    import threading
    import time

    import google_crc32c
    import numpy as np

    from jaxckpt.core import checksum

    assert checksum._crc32c_unlocked is not None, "the ctypes path was not found"
    rng = np.random.default_rng(0)
    for size in (0, 1, 7, 4096, (1 << 20) + 3):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        for start in (0, 0xDEADBEEF):
            assert checksum.extend("crc32c", start, data) == google_crc32c.extend(
                start, data.tobytes()), (size, start)
    floats = rng.standard_normal(1000).astype(np.float32)
    assert checksum.extend("crc32c", 0, floats) == google_crc32c.value(floats.tobytes())
    assert checksum.extend("crc32c", 0, memoryview(floats.tobytes())) == google_crc32c.value(
        floats.tobytes())
    # The main thread keeps running while another thread is inside one long checksum
    # call. With the GIL held through the call it would run only in the switch interval
    # after the call returns (made short here): a few hundred loops, against tens of
    # thousands when the call released the GIL.
    big = rng.integers(0, 256, 256 << 20, dtype=np.uint8)

    def loops_during_one_call() -> int:
        window: list[float] = []
        stamps: list[float] = []
        started = threading.Event()

        def one_call() -> None:
            started.set()
            begin = time.perf_counter()
            checksum.extend("crc32c", 0, big)
            window.extend([begin, time.perf_counter()])

        worker = threading.Thread(target=one_call)
        worker.start()
        started.wait()
        while worker.is_alive():
            stamps.append(time.perf_counter())
        worker.join()
        return sum(window[0] < stamp < window[1] for stamp in stamps)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        assert max(loops_during_one_call() for _ in range(3)) > 5000
    finally:
        sys.setswitchinterval(interval)


def _as_format_1(path):
    """Rewrite a commit's manifest as the previous release wrote it: zlib crc32, format 1."""
    import zlib

    marker = os.path.join(path, COMMIT_MARKER)
    body = json.loads(open(marker).read())
    body["format"] = "jaxckpt.commit/1"
    for rel in body["files"]:
        data = open(os.path.join(path, rel), "rb").read()
        body["files"][rel] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    open(marker, "w").write(json.dumps(body))


def test_format_1_manifests_with_crc32_still_verify(store):
    make_step(store, 1)
    path = make_step(store, 2)
    _as_format_1(path)
    assert store.verify(path) == []
    assert store.latest_valid()[0].step == 2
    with open(os.path.join(path, "state", "arrays", "leaf_0"), "r+b") as f:
        f.seek(10)
        f.write(b"y")
    problems = store.verify(path)
    assert len(problems) == 1 and problems[0].startswith("state/arrays/leaf_0: crc32 "), problems
    assert store.latest_valid()[0].step == 1


@pytest.mark.parametrize("fmt,entry", [
    ("jaxckpt.commit/1", {"size": 2, "crc32c": "00000000"}),  # format 1 knew no crc32c
    ("jaxckpt.commit/2", {"size": 2, "crc32c": "00000000", "crc32": "00000000"}),  # which?
    ("jaxckpt.commit/2", {"size": 2, "md5": "00000000"}),  # no known checksum
])
def test_manifest_entries_must_carry_exactly_one_known_checksum(store, fmt, entry):
    path = make_step(store, 1)
    marker = os.path.join(path, COMMIT_MARKER)
    body = json.loads(open(marker).read())
    body["format"] = fmt
    body["files"]["driver.json"] = entry
    open(marker, "w").write(json.dumps(body))
    with pytest.raises(CheckpointCorruptError, match="malformed manifest entry for 'driver.json'"):
        store.read_manifest(path)


# Every kind of file a split verification must tell apart: bulk data over the threshold
# (deferrable) and, over the threshold too, files named like metadata (never deferred).
SPLIT_FILES = {
    "state/arrays/leaf_0/c/0": DEFER_CHECKSUMS_OVER + 1,  # zarr chunk: bulk
    "state/__0_0.distcp": DEFER_CHECKSUMS_OVER + 1,  # DCP data: bulk
    "state/arrays/leaf_1/c/0": DEFER_CHECKSUMS_OVER,  # bulk, but not over the threshold
    "state/tree.json": DEFER_CHECKSUMS_OVER + 1,  # metadata whatever its size
    "state/arrays/_METADATA": DEFER_CHECKSUMS_OVER + 1,
    "state/.metadata": DEFER_CHECKSUMS_OVER + 1,
    "driver.json": 100,
}
DEFERRED = {"state/arrays/leaf_0/c/0", "state/__0_0.distcp"}


def make_split_step(store, step):
    path = store.step_path(step)
    for rel, size in SPLIT_FILES.items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
        with open(os.path.join(path, rel), "wb") as f:
            f.write(bytes(range(256)) * (size // 256) + b"z" * (size % 256))
    store.commit(path, step)
    return path


def named(problems):
    return {p.split(": ")[0] for p in problems}


def test_split_verification_defers_only_the_checksums_of_large_bulk_files(store):
    path = make_split_step(store, 1)
    assert store.verify(path, defer_over=DEFER_CHECKSUMS_OVER) == []
    assert store.verify_deferred(path) == []
    for rel, size in SPLIT_FILES.items():
        with open(os.path.join(path, rel), "r+b") as f:
            f.seek(size // 2)
            f.write(b"\xff")
    assert named(store.verify(path)) == set(SPLIT_FILES)  # no argument: everything, as before
    up_front = store.verify(path, defer_over=DEFER_CHECKSUMS_OVER)
    assert named(up_front) == set(SPLIT_FILES) - DEFERRED and all("crc32" in p for p in up_front)
    later = store.verify_deferred(path, over=DEFER_CHECKSUMS_OVER)
    assert named(later) == DEFERRED and all("crc32" in p for p in later)


def test_split_verification_still_checks_every_size_and_unlisted_file_up_front(store):
    path = make_split_step(store, 1)
    with open(os.path.join(path, "state/arrays/leaf_0/c/0"), "ab") as f:
        f.write(b"more")
    with open(os.path.join(path, "extra.bin"), "wb") as f:
        f.write(b"x" * (2 * DEFER_CHECKSUMS_OVER))
    os.unlink(os.path.join(path, "state/__0_0.distcp"))
    problems = store.verify(path, checksums=True, defer_over=DEFER_CHECKSUMS_OVER)
    assert any(p.startswith("state/arrays/leaf_0/c/0: size") for p in problems), problems
    assert "state/__0_0.distcp: missing" in problems
    assert "extra.bin: not in the manifest (added after the commit)" in problems
    entry, skipped = store.latest_valid(defer_over=DEFER_CHECKSUMS_OVER)
    assert entry is None and skipped[0].status == "corrupt"


def test_latest_valid_with_deferred_checksums_leaves_bulk_crc32_to_the_caller(store):
    make_split_step(store, 1)
    path = make_split_step(store, 2)
    with open(os.path.join(path, "state/arrays/leaf_0/c/0"), "r+b") as f:
        f.write(b"\xff")
    entry, skipped = store.latest_valid(defer_over=DEFER_CHECKSUMS_OVER)
    assert entry.step == 2 and skipped == []
    assert named(store.verify_deferred(entry.path)) == {"state/arrays/leaf_0/c/0"}
    entry, skipped = store.latest_valid()  # no defer_over: the full pass, as before
    assert entry.step == 1 and skipped[0].step == 2


@pytest.mark.parametrize("bad", ["../escape", "/etc/passwd", "a/../../b", "", "a//b"])
def test_manifest_naming_a_path_outside_the_checkpoint_is_rejected(store, bad):
    path = make_step(store, 1)
    with open(os.path.join(path, COMMIT_MARKER)) as f:
        body = json.load(f)
    body["files"][bad] = {"size": 1, "crc32": "00000000"}
    with open(os.path.join(path, COMMIT_MARKER), "w") as f:
        json.dump(body, f)
    with pytest.raises(CheckpointCorruptError, match="outside the checkpoint"):
        store.verify(path)
    entry, skipped = store.latest_valid()
    assert entry is None and skipped[0].status == "corrupt"


def test_verify_missing_directory_and_uncommitted(store, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint directory"):
        store.verify(str(tmp_path / "nope"))
    path = make_step(store, 4, commit=False)
    with pytest.raises(CheckpointCorruptError, match="never finished committing"):
        store.verify(path)


def test_cleanup_removes_partial_dirs_and_temp_debris_only(store):
    make_step(store, 1)
    partial = make_step(store, 2, commit=False)
    debris = os.path.join(store.export_dir, ".tmp-epoch0epochstep1globalstep1.abcd")
    os.makedirs(debris)
    marker_tmp = os.path.join(store.recover_dir, ".tmp-COMMITTED.123")
    open(marker_tmp, "w").close()
    removed = store.cleanup_partial()
    assert set(removed) == {partial, debris, marker_tmp}
    assert store.committed_steps() == [1]


def test_delete_tolerates_files_already_gone(store):
    path = make_step(store, 1)
    os.unlink(os.path.join(path, "state", "arrays", "leaf_0"))
    assert store.delete(path) is True
    assert not os.path.exists(path)
    assert store.delete(path) is True  # racing second delete: nothing left, no error


def test_delete_uncommits_before_removing_files(store, monkeypatch):
    path = make_step(store, 1)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed mid-delete")

    monkeypatch.setattr(store.storage, "delete_prefix", crash)
    with pytest.raises(KeyboardInterrupt):
        store.delete(path)
    # The files are still there, but the directory is no longer a committed checkpoint.
    assert os.path.exists(os.path.join(path, "driver.json"))
    assert store.committed_steps() == []


def test_checkpoint_being_read_is_not_deleted(store):
    path = make_step(store, 1)
    with store.reading(path):
        assert store.delete(path) is False
        assert os.path.exists(os.path.join(path, COMMIT_MARKER))
    assert store.delete(path) is True


def test_reader_in_another_process_blocks_deletion(store):
    path = make_step(store, 1)
    code = (
        "import sys, time; from jaxckpt.commit.store import CheckpointStore\n"
        f"s = CheckpointStore({store.root!r})\n"
        f"with s.reading({path!r}):\n"
        "    print('reading', flush=True); sys.stdin.readline()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "reading"
        assert store.delete(path) is False
    finally:
        proc.communicate("done\n", timeout=30)
    assert store.delete(path) is True


def test_concurrent_deletes_of_one_checkpoint_never_raise(store):
    paths = [make_step(store, i, payload=os.urandom(20000)) for i in range(6)]
    errors = []

    def worker():
        for p in paths:
            try:
                store.delete(p)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.committed_steps() == []


def test_quarantine_moves_aside_instead_of_deleting(store):
    path = make_step(store, 5)
    moved = store.quarantine(path, "corrupt")
    assert not os.path.exists(path) and os.path.isdir(moved)
    assert "superseded" in moved and store.committed_steps() == []


def test_root_lock_excludes_a_second_job_and_names_the_holder(tmp_path):
    first = FlockLock(str(tmp_path))
    first.acquire()
    second = FlockLock(str(tmp_path))
    with pytest.raises(RootLockedError, match=f"in use by another running job.*{os.getpid()}"):
        second.acquire()
    first.release()
    second.acquire()
    second.release()


def test_root_lock_is_released_when_the_holder_is_killed(tmp_path):
    code = (f"from jaxckpt.storage.posix import FlockLock; l = FlockLock({str(tmp_path)!r}); "
            "l.acquire(); print('locked', flush=True); import time; time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RootLockedError):
            FlockLock(str(tmp_path)).acquire()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    lock = FlockLock(str(tmp_path))
    lock.acquire()  # SIGKILL released it: no stale lock
    lock.release()


def test_verifications_reuse_the_threads_of_the_ones_before(store, monkeypatch):
    """The checks of a verification run on threads kept from the one before: a restore's
    prelude does not start a thread per small request it sends at once (on a busy host
    about a millisecond each, one after the other)."""
    path = make_split_step(store, 1)
    threads: list[set[str]] = []
    checksum = store.storage.checksum

    def recording(*args, **kwargs):
        threads[-1].add(threading.current_thread().name)
        return checksum(*args, **kwargs)

    monkeypatch.setattr(store.storage, "checksum", recording)
    for _ in range(3):
        threads.append(set())
        assert store.verify(path) == []
    # A thread's name is its pool's and its number in the pool: one pool for all three,
    # no more threads than it holds.
    names = set().union(*threads)
    assert all(threads) and len({name.rsplit("_", 1)[0] for name in names}) == 1, threads
    assert len(names) <= store.storage.concurrent_requests, threads
