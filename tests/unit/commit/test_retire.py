"""Incremental checkpoints in the store, on real files: commit with refs, what a base
offers, verification of refs (each shared file once, reported under every user), and
reference-counted deletion (retire, purge) with every state a kill can leave behind."""

import json
import os

import pytest

from jaxckpt import CheckpointCorruptError, CheckpointWriteError
from jaxckpt.commit import retire
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.core.content_hash import content_hash
from jaxckpt.core.layout import COMMIT_MARKER, RETIRED_MARKER
from jaxckpt.core.references import plan_removal, retired_record

FROZEN = b"f" * 3000
FROZEN_KEY = "step_00000000/state/frozen"


def write(store, step, files):
    path = store.step_path(step)
    for rel, data in files.items():
        full = os.path.join(path, *rel.split("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as stream:
            stream.write(data)
    return path


def save(store, step, base=None, *, train=b"t"):
    """A checkpoint whose ``state/frozen`` is referred to from ``base`` (when given) and
    whose ``state/train`` is written, as an incremental backend would."""
    files = {"driver.json": b"{}", "state/train": train * 100}
    refs = None
    if base is None:
        files["state/frozen"] = FROZEN
    else:
        offered = store.incremental_files(store.step_path(base))
        refs = {key: info for key, info in offered.items() if key.endswith("/state/frozen")}
        assert refs, offered
    path = write(store, step, files)
    from jaxckpt.core.checksum import RunningChecksum

    known = {}
    if "state/frozen" in files:
        known["state/frozen"] = {**RunningChecksum().add(FROZEN).entry(),
                                 "xxh128": content_hash([FROZEN])}
    store.commit(path, step, known=known, refs=refs)
    return path


@pytest.fixture
def store(tmp_path):
    s = CheckpointStore(str(tmp_path / "root"))
    s.ensure_dirs()
    return s


@pytest.fixture
def chain(store):
    """Steps 0 (writes the frozen file), 1 and 2 (refer to it)."""
    for step in range(3):
        save(store, step, None if step == 0 else step - 1, train=bytes([65 + step]))
    return store


def files_of(store, step):
    return sorted(store.storage.list_files(store.step_path(step)))


def test_refs_commit_as_format_3_and_name_the_physical_owner(chain):
    m1, m2 = (chain.read_manifest(chain.step_path(s)) for s in (1, 2))
    assert set(m1.refs) == set(m2.refs) == {FROZEN_KEY}  # never a ref of a ref
    assert m2.referenced_bytes == len(FROZEN) and m2.total_bytes == 2 + 100
    assert json.loads(chain.read_file(chain.step_path(2), COMMIT_MARKER))["format"] == (
        "jaxckpt.commit/3")
    base = chain.read_manifest(chain.step_path(0))
    assert base.files["state/frozen"]["xxh128"] == content_hash([FROZEN])
    assert all(chain.verify(chain.step_path(s)) == [] for s in range(3))


def test_a_base_offers_its_own_files_and_its_refs_present_with_their_size(chain):
    offered = chain.incremental_files(chain.step_path(2))
    assert set(offered) == {FROZEN_KEY, "step_00000002/driver.json",
                            "step_00000002/state/train"}
    assert offered[FROZEN_KEY]["xxh128"] == content_hash([FROZEN])
    os.truncate(os.path.join(chain.step_path(0), "state", "frozen"), 10)
    assert FROZEN_KEY not in chain.incremental_files(chain.step_path(2))
    os.unlink(os.path.join(chain.step_path(0), "state", "frozen"))
    assert FROZEN_KEY not in chain.incremental_files(chain.step_path(1))


@pytest.mark.parametrize("refs, message", [
    ({FROZEN_KEY: {"size": 1, "crc32c": "00000000"}}, "3000 bytes where its base listed 1"),
    ({"step_00000000/state/gone": {"size": 1, "crc32c": "00000000"}}, "is missing"),
    ({"step_00000009/state/x": {"size": 1, "crc32c": "00000000"}}, "before step 3"),
    ({"state/x": {"size": 1, "crc32c": "00000000"}}, "not a file of a checkpoint"),
], ids=["size", "missing", "later-step", "not-a-key"])
def test_a_ref_to_a_file_that_is_not_there_commits_nothing(chain, refs, message):
    path = write(chain, 3, {"driver.json": b"{}"})
    with pytest.raises(CheckpointWriteError, match=message):
        chain.commit(path, 3, refs=refs)
    assert not chain.is_committed(path)


def test_done_markers_carry_refs_and_the_primary_merges_them(store):
    save(store, 0)
    path = write(store, 1, {"driver.json": b"{}"})
    entry = store.incremental_files(store.step_path(0))[FROZEN_KEY]
    store.mark_done(path, 1, refs={FROZEN_KEY: entry})
    store.mark_done(path, 2, {"driver.json": {"size": 2, "crc32c": "00000000"}},
                    refs={FROZEN_KEY: entry})
    assert store.done_refs(path, 3, {FROZEN_KEY: entry}) == {FROZEN_KEY: entry}
    assert set(store.done_checksums(path, 3)) == {"driver.json"}
    store.mark_done(path, 2, refs={FROZEN_KEY: {**entry, "size": 1}})
    with pytest.raises(CheckpointWriteError, match=FROZEN_KEY):
        store.done_refs(path, 3)


def test_a_damaged_shared_file_is_checked_once_and_reported_under_every_user(chain,
                                                                           monkeypatch):
    frozen = os.path.join(chain.step_path(0), "state", "frozen")
    with open(frozen, "r+b") as stream:
        stream.seek(100)
        stream.write(b"X")
    problems = chain.verify(chain.step_path(2))
    assert problems == [f"{FROZEN_KEY} (referenced from step 0): crc32c "
                        + problems[0].split("crc32c ")[1]]
    summed = []
    real = chain.storage.checksum
    monkeypatch.setattr(chain.storage, "checksum",
                        lambda p, *a, **k: summed.append(p) or real(p, *a, **k))
    entries = chain.entries(checksums=True)
    assert [(e.step, e.status) for e in entries] == [(0, "corrupt"), (1, "corrupt"),
                                                     (2, "corrupt")]
    assert entries[0].problems[0].startswith("state/frozen: crc32c")
    assert all(e.problems[0].startswith(f"{FROZEN_KEY} (referenced") for e in entries[1:])
    assert summed.count(frozen) == 1
    assert chain.latest_valid()[0] is None  # recovery falls back past all of them


def test_deleting_a_referred_checkpoint_retires_it_and_the_last_referrer_purges_it(chain):
    assert chain.delete(chain.step_path(0))
    assert files_of(chain, 0) == [RETIRED_MARKER, "state/frozen"]
    record = json.loads(chain.read_file(chain.step_path(0), RETIRED_MARKER))
    assert record["kept"] == {"state/frozen": [1, 2]}
    assert chain.committed_steps() == [1, 2]
    assert [e.step for e in chain.entries()] == [1, 2]
    assert chain.verify(chain.step_path(2)) == []
    assert chain.delete(chain.step_path(1))  # nobody refers to 1: whole
    assert not os.path.exists(chain.step_path(1)) and files_of(chain, 0)
    assert chain.delete(chain.step_path(2))  # the last referrer: 0 is purged with it
    assert not os.path.exists(chain.step_path(0)) and chain.committed_steps() == []


def test_a_retired_directory_is_no_base_and_no_checkpoint(chain):
    kill_state(chain, "retired-only")  # both markers: retired all the same
    assert chain.incremental_files(chain.step_path(0)) == {}
    chain.delete(chain.step_path(0))
    with pytest.raises(CheckpointCorruptError, match="retired"):
        chain.incremental_files(chain.step_path(0))
    entry, skipped = chain.latest_valid(at_or_before=0)
    assert entry is None and skipped == []
    assert chain.entry(chain.step_path(0)).status == "corrupt"


def test_a_checkpoint_being_read_is_neither_retired_nor_deleted(chain):
    with chain.reading(chain.step_path(0)):
        assert not chain.delete(chain.step_path(0))
    assert files_of(chain, 0) == [COMMIT_MARKER, "driver.json", "state/frozen", "state/train"]
    assert chain.committed_steps() == [0, 1, 2]


def kill_state(store, point):
    """Step 0's directory as a kill at ``point`` of its retirement leaves it."""
    path = store.step_path(0)
    removal = plan_removal(0, files_of(store, 0), retire.survey(store).manifests)
    store.storage.write(os.path.join(path, RETIRED_MARKER), retired_record(removal))
    if point in ("uncommitted", "some-deleted"):
        os.unlink(os.path.join(path, COMMIT_MARKER))
    if point == "some-deleted":
        os.unlink(os.path.join(path, "driver.json"))


@pytest.mark.parametrize("point", ["retired-only", "uncommitted", "some-deleted"])
def test_every_state_a_kill_mid_retire_leaves_is_finished_by_cleanup(chain, point):
    kill_state(chain, point)
    fresh = CheckpointStore(chain.root)  # the restarted job
    # Retired as soon as the marker is there, committed marker or not.
    assert fresh.committed_steps() == [1, 2] and [e.step for e in fresh.entries()] == [1, 2]
    fresh.cleanup_partial()
    assert files_of(fresh, 0) == [RETIRED_MARKER, "state/frozen"]
    assert fresh.verify(fresh.step_path(2)) == []


@pytest.mark.parametrize("point", ["retired-only", "uncommitted", "some-deleted"])
def test_a_kill_mid_retire_then_the_referrers_gone_is_purged_by_cleanup(chain, point):
    kill_state(chain, point)
    for step in (1, 2):
        chain.delete_whole(chain.step_path(step))
    CheckpointStore(chain.root).cleanup_partial()
    assert os.listdir(chain.recover_dir) == []


def test_cleanup_never_deletes_a_file_a_committed_checkpoint_refers_to(chain):
    # A directory that lost its commit marker by hand while checkpoint 1 and 2 use its file.
    os.unlink(os.path.join(chain.step_path(0), COMMIT_MARKER))
    chain.cleanup_partial()
    assert files_of(chain, 0) == [RETIRED_MARKER, "state/frozen"]
    assert chain.verify(chain.step_path(1)) == []


def test_a_retired_step_saved_again_is_moved_aside_to_free_its_name(chain):
    chain.delete(chain.step_path(0))
    assert chain.delete(chain.step_path(0))  # what a save at step 0 does to make room
    assert not os.path.exists(chain.step_path(0))
    assert os.listdir(os.path.join(chain.recover_dir, "superseded"))
    assert "missing" in chain.verify(chain.step_path(1))[0]


def test_a_retention_pass_reads_each_committed_manifest_once(chain, monkeypatch):
    fresh = CheckpointStore(chain.root)
    reads = []
    real = fresh.storage.read

    def read(path, **options):
        reads.append(path)
        return real(path, **options)

    monkeypatch.setattr(fresh.storage, "read", read)
    fresh.delete(fresh.step_path(0))
    fresh.delete(fresh.step_path(1))
    markers = [p for p in reads if p.endswith(COMMIT_MARKER)]
    assert len(markers) == len(set(markers)) == 3, markers


def test_cli_ls_shows_referenced_bytes_and_verify_root_names_every_user(chain, capsys):
    from jaxckpt.tools.cli import main

    chain.delete(chain.step_path(0))  # retired: not listed
    assert main(["ls", chain.root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["STEP", "STATUS", "SIZE", "REFERENCED", "AGE", "DIRECTORY"]
    rows = {line.split()[0]: line.split() for line in lines[1:] if line[:1].isdigit()}
    assert set(rows) == {"1", "2"} and rows["2"][2:6] == ["102", "B", "2.9", "KiB"]
    with open(os.path.join(chain.step_path(0), "state", "frozen"), "r+b") as stream:
        stream.write(b"X")
    assert main(["verify", chain.root]) == 1
    out = capsys.readouterr().out
    assert out.count(f"{FROZEN_KEY} (referenced from step 0): crc32c") == 2, out
    assert [line.split()[0] for line in out.splitlines() if not line.startswith(" ")] == [
        "CORRUPT", "CORRUPT"]


def test_asking_for_a_retired_step_says_it_is_retired(chain):
    kill_state(chain, "retired-only")
    assert "retired (RETIRED marker)" in chain.verify(chain.step_path(0))[0]
    fresh = CheckpointStore(chain.root)
    fresh.cleanup_partial()
    with pytest.raises(CheckpointCorruptError, match="retired"):
        fresh.verify(fresh.step_path(0))
