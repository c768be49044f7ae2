"""PosixStorage keeps the Storage contract (tests/support/storage_contract.py), plus what only a
filesystem has: links that must never be followed, temporary names, directory moves."""

import os

import pytest

from jaxckpt.core.layout import TMP_PREFIX
from jaxckpt.storage.base import Storage
from jaxckpt.storage.posix import FlockLock, PosixStorage

from support import storage_contract

SPAWN = "from jaxckpt.storage.posix import PosixStorage\nstorage = PosixStorage()"


@pytest.fixture
def storage():
    return PosixStorage()


@pytest.fixture
def base(tmp_path):
    return str(tmp_path / "base")


@pytest.mark.parametrize("check", storage_contract.CHECKS, ids=lambda check: check.__name__)
def test_contract(check, storage, base):
    check(storage, base)


def test_contract_lock(storage, base):
    storage_contract.check_lock_excludes_a_second_holder(storage, base, SPAWN)


def test_posix_storage_is_a_storage_and_its_lock_is_the_root_lock(storage, base):
    assert isinstance(storage, Storage)
    os.makedirs(base)
    lease = storage.lock_root(base)
    try:
        assert isinstance(lease, FlockLock) and lease.path == os.path.join(base, ".lock")
    finally:
        lease.release()


def test_writes_leave_no_temporary_files(storage, base):
    os.makedirs(base)
    storage.write(os.path.join(base, "a"), b"1")
    storage.create(os.path.join(base, "b"), b"2")
    with pytest.raises(FileExistsError):
        storage.create(os.path.join(base, "b"), b"3")
    assert sorted(os.listdir(base)) == ["a", "b"]
    assert not any(name.startswith(TMP_PREFIX) for name in os.listdir(base))


def test_links_are_listed_never_followed_and_never_inside(storage, base, tmp_path):
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "dir" / "secret").write_bytes(b"s" * 10)
    (outside / "file").write_bytes(b"f" * 3)
    ck = os.path.join(base, "ck")
    os.makedirs(os.path.join(ck, "state", "inner"))
    with open(os.path.join(ck, "state", "inner", "data"), "wb") as handle:
        handle.write(b"d")
    os.symlink(outside / "dir", os.path.join(ck, "state", "linked_dir"))
    os.symlink(outside / "file", os.path.join(ck, "linked_file"))
    listed = storage.list_files(ck)
    assert set(listed) == {"state/inner/data", "state/linked_dir", "linked_file"}
    assert listed["state/inner/data"] == 1
    inside = storage.resolves_inside
    assert inside(os.path.join(ck, "state", "inner", "data"), ck)
    assert not inside(os.path.join(ck, "linked_file"), ck)
    assert not inside(os.path.join(ck, "state", "linked_dir"), ck)
    assert not inside(os.path.join(ck, "state", "linked_dir", "secret"), ck)
    # A link between the checkpoint's directories that stays inside it is followed, as
    # realpath would.
    os.symlink(os.path.join(ck, "state", "inner"), os.path.join(ck, "state", "alias"))
    assert inside(os.path.join(ck, "state", "alias", "data"), ck)
    # The checkpoint reached through a link of its own (a root on a symlinked disk) is fine.
    os.symlink(ck, tmp_path / "ck_link")
    assert inside(os.path.join(tmp_path / "ck_link", "state", "inner", "data"),
                  str(tmp_path / "ck_link"))


def test_rename_posix_moves_a_directory_and_creates_the_target_parent(storage, base):
    src = os.path.join(base, "recover", "step_00000001")
    os.makedirs(src)
    with open(os.path.join(src, "data"), "wb") as handle:
        handle.write(b"d")
    dst = os.path.join(base, "recover", "superseded", "step_00000001.corrupt.1.abc")
    storage.rename_posix(src, dst)
    assert not os.path.exists(src)
    assert open(os.path.join(dst, "data"), "rb").read() == b"d"
    with pytest.raises(FileNotFoundError):
        storage.rename_posix(src, dst + "2")


def _tree_to_sync(base):
    for name in ("a", "b", "c"):
        os.makedirs(os.path.join(base, "ck", name, "c"))
        with open(os.path.join(base, "ck", name, "c", "0"), "wb") as stream:
            stream.write(b"x")
    return os.path.join(base, "ck")


def test_sync_fsyncs_every_file_and_directory_and_the_parent(storage, base, monkeypatch):
    from jaxckpt.storage import posix as storage_module

    prefix = _tree_to_sync(base)
    synced = []
    monkeypatch.setattr(storage_module, "fsync_file", lambda path: synced.append(("f", path)))
    monkeypatch.setattr(storage_module, "fsync_dir", lambda path: synced.append(("d", path)))
    storage.sync(prefix)
    directories = {("d", p) for p, _, _ in os.walk(prefix)} | {("d", base)}
    files = {("f", os.path.join(prefix, n, "c", "0")) for n in ("a", "b", "c")}
    assert sorted(synced) == sorted(directories | files)
    synced.clear()
    storage.sync(prefix, data=False)
    assert sorted(synced) == sorted(directories)


def test_sync_skips_only_the_directories_named_durable(storage, base, monkeypatch):
    from jaxckpt.storage import posix as storage_module

    prefix = _tree_to_sync(base)
    synced = []
    monkeypatch.setattr(storage_module, "fsync_file", lambda path: synced.append(("f", path)))
    monkeypatch.setattr(storage_module, "fsync_dir", lambda path: synced.append(("d", path)))
    storage.sync(prefix, skip=("a", "a/c", "b/c"))
    skipped = {os.path.join(prefix, *rel.split("/")) for rel in ("a", "a/c", "b/c")}
    directories = {("d", p) for p, _, _ in os.walk(prefix) if p not in skipped} | {("d", base)}
    files = {("f", os.path.join(prefix, n, "c", "0")) for n in ("a", "b", "c")}
    assert sorted(synced) == sorted(directories | files)  # every file's data still


def test_sync_keeps_several_directory_fsyncs_in_flight(storage, base, monkeypatch):
    """Each fsync waits for a flush of the device's cache; issued together they share
    flushes (benchmarks/results/cold-restore-hugepages_cpu2core_2026-11-25.md). One at a
    time, no two callers ever meet at this barrier and it breaks."""
    import threading

    from jaxckpt.storage import posix as storage_module

    prefix = _tree_to_sync(base)
    meeting = threading.Barrier(4, timeout=10)
    monkeypatch.setattr(storage_module, "fsync_dir", lambda path: meeting.wait())
    storage.sync(prefix, data=False)  # 8 directories: two full meetings
