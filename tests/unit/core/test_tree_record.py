"""tree.json read as a plain document (no jax): its owner, version and shape are checked."""

from __future__ import annotations

import json

import pytest

from jaxckpt.core.tree_record import (
    TREE_FORMAT,
    TREE_FORMAT_VERSION,
    parse_tree_record,
    read_tree_record,
)
from jaxckpt.errors import CheckpointCorruptError, CheckpointFormatError


def doc(**changes) -> str:
    body = {"format": TREE_FORMAT, "version": TREE_FORMAT_VERSION, "leaves": []}
    body.update(changes)
    return json.dumps(body)


@pytest.mark.parametrize("text, error, words", [
    (doc(format="orbax"), CheckpointCorruptError, "format is 'orbax'"),
    (doc(version=TREE_FORMAT_VERSION + 1), CheckpointFormatError, "upgrade jaxckpt"),
    (doc(version="3"), CheckpointCorruptError, "not an int"),
    (doc(leaves=None), CheckpointCorruptError, "no list of leaves"),
    ("[1, 2]", CheckpointCorruptError, "format is [1, 2]"),
    ("{not json", CheckpointCorruptError, "unreadable"),
])
def test_a_record_of_another_owner_or_version_is_refused_naming_why(text, error, words):
    with pytest.raises(error, match="ckpt/state/tree.json is unreadable") as info:
        parse_tree_record(text, "ckpt/state")
    assert words in str(info.value)


def test_a_valid_record_reads_back_and_a_missing_one_names_the_fix(tmp_path):
    (tmp_path / "tree.json").write_text(doc(leaves=[{"path": "['w']"}]))
    assert read_tree_record(str(tmp_path))["leaves"] == [{"path": "['w']"}]
    with pytest.raises(CheckpointCorruptError, match="no tree.json.*Fix"):
        read_tree_record(str(tmp_path / "other"))
