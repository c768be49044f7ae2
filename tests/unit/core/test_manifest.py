"""The commit manifest on its own: serialise -> parse round trip, the exact bytes of the
format, every refusal of a manifest that cannot be trusted, and the per-file checks. Pure: no
filesystem (the golden checkpoint on disk is tests/integration/test_golden_checkpoint.py)."""

import json

import pytest

from jaxckpt import CheckpointCorruptError
from jaxckpt.core.manifest import (
    DEFER_CHECKSUMS_OVER,
    MANIFEST_FORMAT,
    REFS_MANIFEST_FORMAT,
    Manifest,
    algorithm_of,
    checksum_problem,
    deferrable,
    is_metadata,
    safe_relpath,
    size_problem,
)

FILES = {"driver.json": {"size": 2, "crc32c": "0123abcd"},
         "state/arrays/leaf_0": {"size": 1000, "crc32c": "deadbeef"}}


def test_round_trip_keeps_every_field():
    manifest = Manifest(step=7, files=FILES, created=1700000000.25)
    again = Manifest.parse(manifest.to_bytes(), "here")
    assert again == manifest
    assert again.total_bytes == 1002
    assert again.to_bytes() == manifest.to_bytes()


def test_serialised_form_is_sorted_indented_json_with_a_total():
    data = Manifest(step=7, files={"a": {"size": 3, "crc32c": "00000001"}},
                    created=1.5).to_bytes()
    assert data == (b'{\n "created": 1.5,\n "files": {\n  "a": {\n   "crc32c": "00000001",\n'
                    b'   "size": 3\n  }\n },\n "format": "jaxckpt.commit/2",\n "step": 7,\n'
                    b' "total_bytes": 3\n}')
    assert MANIFEST_FORMAT == "jaxckpt.commit/2"


def test_format_1_with_crc32_parses():
    body = {"format": "jaxckpt.commit/1", "step": 3, "created": 0,
            "files": {"x": {"size": 1, "crc32": "00000000"}}}
    manifest = Manifest.parse(json.dumps(body).encode(), "here")
    assert manifest.step == 3 and algorithm_of(manifest.files["x"]) == "crc32"


def _body(**changes):
    body = {"format": MANIFEST_FORMAT, "step": 1, "created": 1.0, "files": dict(FILES)}
    body.update(changes)
    return json.dumps(body).encode()


@pytest.mark.parametrize("data, message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "commit marker has format"),
    (_body(format="jaxckpt.commit/9"), "expected one of jaxckpt.commit/1, jaxckpt.commit/2"),
    (_body(files=None), "no file list"),
    (_body(files={}), "lists no files"),
    (_body(files={"../x": {"size": 1, "crc32c": "00000000"}}), "outside the checkpoint"),
    (_body(files={"x": {"size": "1", "crc32c": "00000000"}}), "malformed manifest entry"),
    (_body(files={"x": {"size": 1}}), "malformed manifest entry"),
    (_body(step=-1), "not an int >= 0"),
    (_body(step=True), "not an int >= 0"),
    (_body(created="yesterday"), "not a time"),
    (b'{"format": "jaxckpt.commit/2", "step": 1, "created": NaN, "files": {"x": '
     b'{"size": 1, "crc32c": "00000000"}}}', "not a time"),
], ids=["json", "not-a-dict", "format", "no-files", "empty-files", "escape", "size-type",
        "no-checksum", "negative-step", "bool-step", "created-type", "created-nan"])
def test_untrustworthy_manifests_are_refused_saying_why(data, message):
    with pytest.raises(CheckpointCorruptError, match=message) as caught:
        Manifest.parse(data, "/root/recover/step_00000001")
    assert str(caught.value).startswith("/root/recover/step_00000001: ")


@pytest.mark.parametrize("rel, safe", [
    ("a", True), ("state/arrays/leaf_0", True), (".metadata", True),
    ("", False), ("/abs", False), ("\\abs", False), ("a/../b", False), ("a//b", False),
    ("./a", False), ("a\x00b", False), (3, False),
])
def test_manifest_paths_must_stay_inside(rel, safe):
    assert safe_relpath(rel) is safe


@pytest.mark.parametrize("rel, size, deferred", [
    ("state/arrays/leaf_0/c/0", DEFER_CHECKSUMS_OVER + 1, True),
    ("state/__0_0.distcp", DEFER_CHECKSUMS_OVER + 1, True),
    ("state/arrays/leaf_0/c/0", DEFER_CHECKSUMS_OVER, False),
    ("state/tree.json", DEFER_CHECKSUMS_OVER + 1, False),
    ("state/arrays/_METADATA", DEFER_CHECKSUMS_OVER + 1, False),
    ("state/.metadata", DEFER_CHECKSUMS_OVER + 1, False),
    ("COMMITTED", DEFER_CHECKSUMS_OVER + 1, False),
])
def test_only_large_bulk_files_may_have_their_checksum_deferred(rel, size, deferred):
    assert deferrable(rel, {"size": size, "crc32c": "0"}, DEFER_CHECKSUMS_OVER) is deferred
    assert is_metadata(rel) is (not deferred and not rel.endswith("/c/0"))


def test_per_file_checks_name_the_file_and_both_values():
    entry = {"size": 10, "crc32c": "0000abcd"}
    assert size_problem("f", entry, 10) is None
    assert size_problem("f", entry, 4) == (
        "f: size 4 bytes, manifest says 10 (truncated or overwritten)")
    assert checksum_problem("f", entry, "0000abcd") is None
    assert checksum_problem("f", entry, "ffffffff") == (
        "f: crc32c ffffffff, manifest says 0000abcd (contents altered)")


HASH = "0123456789abcdef0123456789abcdef"
REFS = {"step_00000003/state/arrays/leaf_1/c/0": {"size": 500, "crc32c": "00c0ffee",
                                                   "xxh128": HASH}}


def test_refs_make_format_3_with_referenced_bytes_and_round_trip():
    manifest = Manifest(step=7, files=FILES, created=2.0, refs=REFS)
    body = json.loads(manifest.to_bytes())
    assert body["format"] == REFS_MANIFEST_FORMAT == "jaxckpt.commit/3"
    assert body["referenced_bytes"] == manifest.referenced_bytes == 500
    assert body["total_bytes"] == manifest.total_bytes == 1002
    again = Manifest.parse(manifest.to_bytes(), "here")
    assert again == manifest and again.to_bytes() == manifest.to_bytes()


def test_no_refs_stays_format_2_and_a_content_hash_is_accepted_in_any_format():
    files = {"a": {"size": 3, "crc32c": "00000001", "xxh128": HASH}}
    data = Manifest(step=7, files=files, created=1.5).to_bytes()
    assert b'"format": "jaxckpt.commit/2"' in data and b"refs" not in data
    assert Manifest.parse(data, "here").refs == {}
    assert Manifest.parse(data, "here").files == files


def _refs_body(refs, step=7, fmt=REFS_MANIFEST_FORMAT):
    return _body(format=fmt, step=step, refs=refs)


@pytest.mark.parametrize("data, message", [
    (_body(files={"x": {"size": 1, "crc32c": "00000000", "xxh128": "abc"}}),
     "malformed manifest entry"),
    (_refs_body(REFS, fmt=MANIFEST_FORMAT), "only a jaxckpt.commit/3 marker"),
    (_refs_body([1]), "only a jaxckpt.commit/3 marker"),
    (_refs_body({"state/arrays/leaf_1": REFS[next(iter(REFS))]}), "not a file of an earlier"),
    (_refs_body({"step_00000003": {"size": 1, "crc32c": "00000000"}}),
     "not a file of an earlier"),
    (_refs_body({"step_00000003/../x": {"size": 1, "crc32c": "00000000"}}),
     "not a file of an earlier"),
    (_refs_body({"step_00000003/x": {"size": 1}}), "malformed manifest entry"),
    (_refs_body(REFS, step=3), "may only refer to earlier steps"),
    (_refs_body(REFS, step=2), "may only refer to earlier steps"),
], ids=["bad-hash", "refs-in-format-2", "refs-not-a-dict", "key-without-step", "key-no-path",
        "key-escape", "ref-no-checksum", "own-step", "later-step"])
def test_untrustworthy_refs_are_refused_saying_why(data, message):
    with pytest.raises(CheckpointCorruptError, match=message):
        Manifest.parse(data, "/root/recover/step_00000007")
