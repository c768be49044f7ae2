"""The contract every ``jaxckpt.storage.base.Storage`` implementation keeps, as plain functions.

Each ``check_*`` takes a storage and ``base``, a location under which it may write freely
(a fresh temporary directory for ``PosixStorage``; a fresh prefix of a test bucket for an
object store), so that a second implementation runs the same suite with its own fixture:

    @pytest.mark.parametrize("check", storage_contract.CHECKS, ids=lambda c: c.__name__)
    def test_contract(check, storage, base):
        check(storage, base)

``check_lock_excludes_a_second_holder`` also needs ``spawn``: Python source that binds the
same kind of storage to the name ``storage`` in a fresh process (the lock must exclude other
processes, not just other objects).
"""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest

from jaxckpt import RootLockedError
from jaxckpt.core.checksum import default_algorithm, extend


def _join(base: str, *names: str) -> str:
    return "/".join([base.rstrip("/"), *names])


def _prepared(storage, base: str, *dirs: str) -> None:
    for name in ("", *dirs):
        storage.make_prefix(_join(base, name) if name else base)


def check_read_returns_what_was_written(storage, base):
    _prepared(storage, base)
    path = _join(base, "blob")
    data = bytes(range(256)) * 40
    storage.write(path, data)
    assert storage.read(path) == data
    assert storage.read(path, offset=100, length=50) == data[100:150]
    assert storage.read(path, offset=len(data) - 10) == data[-10:]
    assert storage.read(path, offset=len(data) - 10, length=100) == data[-10:]
    assert storage.size(path) == len(data)
    assert storage.exists(path)


def check_write_replaces_the_whole_object(storage, base):
    _prepared(storage, base)
    path = _join(base, "blob")
    storage.write(path, b"x" * 1000)
    storage.write(path, b"short")
    assert storage.read(path) == b"short" and storage.size(path) == 5


def check_open_writer_stores_the_object_at_close_only(storage, base):
    _prepared(storage, base)
    path = _join(base, "streamed")
    storage.write(path, b"old")
    writer = storage.open_writer(path)
    piece = bytearray(b"first ")
    writer.write(piece)
    piece[:] = b"XXXXX "  # the caller reuses its buffer: what was written stays
    writer.write(memoryview(b"second"))
    assert storage.read(path) == b"old"  # nothing of it before close
    writer.close()
    assert storage.read(path) == b"first second"
    aborted = storage.open_writer(_join(base, "aborted"))
    aborted.write(b"lost")
    aborted.abort()
    assert not storage.exists(_join(base, "aborted"))


def check_missing_object_is_file_not_found(storage, base):
    _prepared(storage, base)
    path = _join(base, "never-written")
    assert not storage.exists(path)
    with pytest.raises(FileNotFoundError):
        storage.read(path)
    with pytest.raises(FileNotFoundError):
        storage.size(path)


def check_create_only_fails_on_an_existing_object(storage, base):
    _prepared(storage, base)
    path = _join(base, "COMMITTED")
    storage.create(path, b"first")
    assert storage.read(path) == b"first"
    with pytest.raises(FileExistsError):
        storage.create(path, b"second")
    assert storage.read(path) == b"first"  # the refused write changed nothing
    storage.write(path, b"third")  # a plain write still replaces
    assert storage.read(path) == b"third"


def check_create_after_delete_succeeds(storage, base):
    _prepared(storage, base)
    path = _join(base, "COMMITTED")
    storage.create(path, b"one")
    storage.delete(path)
    storage.create(path, b"two")
    assert storage.read(path) == b"two"


def check_list_names_shows_direct_children(storage, base):
    _prepared(storage, base, "step_1", "step_1/state", "step_2")
    storage.write(_join(base, "step_1", "state", "data"), b"abc")
    storage.write(_join(base, "step_2", "driver.json"), b"{}")
    storage.write(_join(base, "top"), b"1")
    assert storage.list_names(base) == ["step_1/", "step_2/", "top"]
    assert storage.list_names(_join(base, "step_1")) == ["state/"]
    assert storage.list_names(_join(base, "nothing-here")) == []
    assert storage.is_prefix(_join(base, "step_1"))
    assert not storage.is_prefix(_join(base, "nothing-here"))
    assert not storage.is_prefix(_join(base, "top"))


def check_list_files_lists_every_object_below_with_sizes(storage, base):
    _prepared(storage, base, "ck", "ck/state", "ck/state/arrays", "ckpt2")
    storage.write(_join(base, "ck", "driver.json"), b"{}")
    storage.write(_join(base, "ck", "state", "tree.json"), b"[1, 2]")
    storage.write(_join(base, "ck", "state", "arrays", "leaf"), b"\0" * 4096)
    storage.write(_join(base, "ckpt2", "other"), b"not below ck/")
    assert storage.list_files(_join(base, "ck")) == {
        "driver.json": 2, "state/tree.json": 6, "state/arrays/leaf": 4096}
    assert storage.list_files(_join(base, "nothing-here")) == {}


def check_delete_removes_one_object_and_tolerates_a_missing_one(storage, base):
    _prepared(storage, base)
    keep, doomed = _join(base, "keep"), _join(base, "doomed")
    storage.write(keep, b"k")
    storage.write(doomed, b"d")
    storage.delete(doomed)
    assert not storage.exists(doomed) and storage.read(keep) == b"k"
    storage.delete(doomed)  # already gone: no error


def check_delete_prefix_removes_everything_below_it_only(storage, base):
    _prepared(storage, base, "step_1", "step_1/state", "step_10")
    storage.write(_join(base, "step_1", "COMMITTED"), b"m")
    storage.write(_join(base, "step_1", "state", "data"), b"abc")
    storage.write(_join(base, "step_10", "data"), b"a sibling sharing the name's start")
    storage.delete_prefix(_join(base, "step_1"))
    assert storage.list_files(_join(base, "step_1")) == {}
    assert not storage.is_prefix(_join(base, "step_1"))
    assert storage.list_names(base) == ["step_10/"]
    assert storage.read(_join(base, "step_10", "data")).startswith(b"a sibling")
    storage.delete_prefix(_join(base, "step_1"))  # already gone: no error


def check_checksum_matches_the_bytes(storage, base):
    _prepared(storage, base)
    path = _join(base, "blob")
    data = bytes(range(251)) * 9000  # over one read piece of most implementations
    storage.write(path, data)
    algorithm = default_algorithm()
    expected = (len(data), f"{extend(algorithm, 0, data):08x}")
    assert storage.checksum(path, algorithm) == expected
    assert storage.checksum(path, algorithm, sync=True) == expected
    assert storage.checksum(path, "crc32") == (len(data), f"{zlib.crc32(data):08x}")


def check_sync_keeps_everything_written(storage, base):
    _prepared(storage, base, "ck", "ck/state")
    storage.write(_join(base, "ck", "state", "data"), b"abc")
    storage.sync(_join(base, "ck"))
    storage.sync(_join(base, "ck"), data=False)
    assert storage.list_files(_join(base, "ck")) == {"state/data": 3}


def check_delete_waits_for_readers(storage, base):
    _prepared(storage, base)
    marker = _join(base, "COMMITTED")
    storage.write(marker, b"m")
    with storage.reading(marker):
        assert storage.delete_unless_reading(marker) is False
        assert storage.read(marker) == b"m"
    assert storage.delete_unless_reading(marker) is True
    assert not storage.exists(marker)
    assert storage.delete_unless_reading(marker) is True  # nothing there: deleted already
    with storage.reading(marker):  # holding nothing is allowed
        pass


def check_lock_excludes_a_second_holder(storage, base, spawn):
    _prepared(storage, base)
    attempt = (f"{spawn}\n"
               "from jaxckpt import RootLockedError\n"
               "try:\n"
               f"    storage.lock_root({base!r}).release()\n"
               "    print('acquired')\n"
               "except RootLockedError as exc:\n"
               "    print('refused:', exc)\n")

    def other_process() -> str:
        done = subprocess.run([sys.executable, "-c", attempt], capture_output=True, text=True,
                              timeout=120, check=True)
        return done.stdout.strip()

    lease = storage.lock_root(base)
    try:
        assert other_process().startswith("refused: checkpoint root")
        with pytest.raises(RootLockedError):
            storage.lock_root(base)  # a second holder in this process too
    finally:
        lease.release()
    lease.release()  # idempotent
    assert other_process() == "acquired"
    storage.lock_root(base).release()


CHECKS = [
    check_read_returns_what_was_written,
    check_write_replaces_the_whole_object,
    check_open_writer_stores_the_object_at_close_only,
    check_missing_object_is_file_not_found,
    check_create_only_fails_on_an_existing_object,
    check_create_after_delete_succeeds,
    check_list_names_shows_direct_children,
    check_list_files_lists_every_object_below_with_sizes,
    check_delete_removes_one_object_and_tolerates_a_missing_one,
    check_delete_prefix_removes_everything_below_it_only,
    check_checksum_matches_the_bytes,
    check_sync_keeps_everything_written,
    check_delete_waits_for_readers,
]
"""Every check that takes (storage, base); ``check_lock_excludes_a_second_holder`` also
takes ``spawn``."""
