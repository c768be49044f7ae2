"""Reference counting of incremental checkpoints, pure: who uses each file, what removing a
step directory deletes or keeps, the RETIRED record and the merge of several processes'
refs. Tables of manifests, no filesystem (the store acting on them: tests/unit/commit/
test_retire.py)."""

import pytest

from jaxckpt.core.layout import COMMIT_MARKER, RETIRED_MARKER
from jaxckpt.core.manifest import Manifest
from jaxckpt.core.references import (
    merge_refs,
    parse_retired,
    plan_removal,
    referrers,
    retired_record,
    users,
)

E = {"size": 4, "crc32c": "00000001"}


def m(step, files=("driver.json",), refs=()):
    return Manifest(step=step, created=0.0, files=dict.fromkeys(files, E),
                    refs={key: E for key in refs})


K0A, K0B, K1A = "step_00000000/state/a", "step_00000000/state/b", "step_00000001/state/a"
# 0 writes a and b; 1 writes a again, refers to 0's b; 2 refers to 0's b and 1's a.
CHAIN = {0: m(0, ("driver.json", "state/a", "state/b")),
         1: m(1, ("driver.json", "state/a"), (K0B,)),
         2: m(2, ("driver.json",), (K0B, K1A))}


def test_users_names_every_checkpoint_using_each_physical_file():
    assert users(CHAIN) == {
        "step_00000000/driver.json": [0], K0A: [0], K0B: [0, 1, 2],
        "step_00000001/driver.json": [1], K1A: [1, 2], "step_00000002/driver.json": [2]}


@pytest.mark.parametrize("owner, committed, kept", [
    (0, (0, 1, 2), {"state/b": [1, 2]}),
    (0, (0, 2), {"state/b": [2]}),
    (0, (0,), {}),
    (1, (0, 1, 2), {"state/a": [2]}),
    (1, (1,), {}),
    (2, (0, 1, 2), {}),
    (7, (0, 1, 2), {}),
], ids=["shared-twice", "shared-once", "alone", "middle", "only-itself", "newest", "unknown"])
def test_referrers_are_the_other_committed_checkpoints_naming_the_owner(owner, committed, kept):
    assert referrers(owner, {s: CHAIN[s] for s in committed}) == kept


@pytest.mark.parametrize("owner, committed, present, kept, doomed", [
    # Nobody refers to it: deleted whole.
    (2, (0, 1, 2), ("COMMITTED", "driver.json"), {}, ("driver.json",)),
    # Retire: the referred file stays, the rest goes; markers are the store's to order.
    (0, (0, 1, 2), ("COMMITTED", "driver.json", "state/a", "state/b"),
     {"state/b": [1, 2]}, ("driver.json", "state/a")),
    # Killed mid-retire, both markers there: the same plan.
    (0, (1, 2), ("COMMITTED", "RETIRED", "state/a", "state/b"),
     {"state/b": [1, 2]}, ("state/a",)),
    # A retired directory once its last referrer went: purged whole.
    (0, (), ("RETIRED", "state/b"), {}, ("state/b",)),
    # A referred file already gone is still kept (its referrers are reported corrupt).
    (0, (1,), ("RETIRED",), {"state/b": [1]}, ()),
], ids=["whole", "retire", "resume", "purge", "missing-kept"])
def test_plan_removal_keeps_exactly_what_committed_checkpoints_refer_to(
        owner, committed, present, kept, doomed):
    removal = plan_removal(owner, present, {s: CHAIN[s] for s in committed})
    assert removal.kept == kept and removal.doomed == doomed
    assert removal.whole is (not kept)
    assert COMMIT_MARKER not in removal.doomed and RETIRED_MARKER not in removal.doomed


def test_retired_record_round_trips_and_garbage_reads_as_unknown():
    removal = plan_removal(0, ("state/a", "state/b"), CHAIN)
    assert parse_retired(retired_record(removal)) == {"state/b": [1, 2]}
    for data in (b"", b"[]", b'{"format": "x", "kept": {}}', b'{"format": '
                 b'"jaxckpt.retired/1", "kept": {"a": ["z"]}}'):
        assert parse_retired(data) is None


def test_merge_refs_takes_the_union_and_refuses_two_entries_for_one_key():
    assert merge_refs([{K0A: E}, {K0A: dict(E), K0B: E}, {}]) == {K0A: E, K0B: E}
    with pytest.raises(ValueError, match="step_00000000/state/a"):
        merge_refs([{K0A: E}, {K0A: {**E, "size": 5}}])
