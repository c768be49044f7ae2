"""The pure half of a partial restore: its verification plan defers every data file's
checksum to the read, and a backend's scope withdraws the checks of files it does not read
(only in the directory it reads; the others, items, keep every check)."""

from __future__ import annotations

import os

from jaxckpt.backends.base import BackendFeatures, SingleProcess
from jaxckpt.commit.deferred_checks import DeferredChecks
from jaxckpt.commit.verification import plan
from jaxckpt.config import RecoverConfig
from jaxckpt.core.manifest import DEFER_CHECKSUMS_OVER


def test_a_partial_restore_defers_every_data_checksum_to_the_read():
    class InPlace(SingleProcess):
        features = BackendFeatures(reads_in_place=True)

    checks = RecoverConfig(verify="checksums")
    assert plan(checks, SingleProcess(), None).defer_over == DEFER_CHECKSUMS_OVER
    assert plan(checks, SingleProcess(), None, partial=True).defer_over == 0
    # A backend that loads in place still gets every checksum first, partial or not.
    assert plan(checks, InPlace(), None, partial=True).defer_over is None
    sizes_only = RecoverConfig(verify="sizes")
    assert plan(sizes_only, SingleProcess(), None, partial=True).defer_over is None


def test_an_in_place_reader_that_checks_its_claims_first_gets_the_data_checksums_alone():
    class ChecksFirst(SingleProcess):
        features = BackendFeatures(reads_in_place=True, verifies_reads=True)

    checks = RecoverConfig(verify="checksums")
    alone = plan(checks, ChecksFirst(), {"ref": None})
    assert alone.defer_over == DEFER_CHECKSUMS_OVER
    assert alone.deferred_items == frozenset()  # items are read without claims: checked first
    assert plan(checks, ChecksFirst(), None, partial=True).defer_over == 0
    # Other processes are given no claims and would load before the primary's verdict.
    assert plan(checks, ChecksFirst(), None, processes=2).defer_over is None


def entry(size=10):
    return {"size": size, "crc32c": "00000000"}


def test_limit_withdraws_only_the_files_outside_the_scope_of_the_directory_read(tmp_path):
    step = os.path.join(tmp_path, "step_1")
    item = os.path.join(tmp_path, "items", "ref", "v1")
    claims = DeferredChecks()
    claims.offer(step, [("state/arrays/model_w/c/0", entry()),
                        ("state/arrays/opt_mu/c/0", entry()),
                        ("state/arrays/opt_nu/c/0", entry())])
    claims.offer(item, [("state/arrays/leaf/c/0", entry())])
    claims.limit(os.path.join(step, "state"), [os.path.join(step, "state", "arrays", "model_w")])
    assert claims.claim(os.path.join(step, "state/arrays/opt_mu/c/0")) is None
    claims.close()
    assert [rel for rel, _ in claims.unclaimed(step)] == ["state/arrays/model_w/c/0"]
    assert [rel for rel, _ in claims.unclaimed(item)] == ["state/arrays/leaf/c/0"]


def test_limit_to_nothing_leaves_nothing_of_that_directory_to_check(tmp_path):
    step = os.path.join(tmp_path, "step_1")
    claims = DeferredChecks()
    claims.offer(step, [("state/arrays/a/c/0", entry()), ("state/arrays/ab/c/0", entry())])
    claims.limit(os.path.join(step, "state"), [os.path.join(step, "state", "arrays", "a")])
    claims.close()
    # A scope is a directory: arrays/a does not take arrays/ab in with it.
    assert [rel for rel, _ in claims.unclaimed(step)] == ["state/arrays/a/c/0"]
    claims.limit(os.path.join(step, "state"), [])
    assert claims.unclaimed(step) == []
