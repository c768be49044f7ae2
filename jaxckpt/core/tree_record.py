"""tree.json as a document: its format tag and version, and reading it without jax.

Owns: the identity of the Orbax backend's tree record (``TREE_FORMAT``, the versions) and
``read_tree_record``, which reads a checkpoint's ``state/tree.json`` as plain JSON and
refuses a file of another owner or of a newer version. The backend's own parsing of each
leaf (``backends.orbax.tree``) starts from this; tools that only list a checkpoint's leaves
(``jaxckpt info``, ``jaxckpt export-hf``) use it as it is, without loading jax.

Must not import: jax, orbax, torch (this module is part of the pure layer).
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointFormatError
from .layout import TREE_FILE

__all__ = ["TREE_FORMAT", "TREE_FORMAT_VERSION", "PACKED_TREE_VERSION",
           "UNPACKED_TREE_VERSION", "parse_tree_record", "read_tree_record", "leaf_nbytes"]

#: value of the "format" field of tree.json; identifies the file's owner.
TREE_FORMAT = "jaxckpt.orbax.tree"
#: bumped on any incompatible change of tree.json; readers refuse newer versions. Version 2
#: adds packed leaves (an "offset" on the leaf, whose "name" is then its pack's, and a
#: "packs" list); a checkpoint without packed leaves is still written as version 1,
#: readable by every release. Version 3 adds arrays stored as their bytes (a "data_dtype"
#: of uint8 and a "data_shape" on a leaf of kind "array": dtypes Orbax has no type for);
#: only a checkpoint holding such a leaf is written as version 3.
TREE_FORMAT_VERSION = 3
PACKED_TREE_VERSION = 2
UNPACKED_TREE_VERSION = 1


def parse_tree_record(text: str | bytes, where: str) -> dict[str, Any]:
    """The tree.json document in ``text`` (of the checkpoint ``where``), checked for its
    owner, version and shape (a list of leaves); ``CheckpointFormatError`` for a newer
    version, ``CheckpointCorruptError`` for anything else wrong."""
    try:
        document = json.loads(text)
        if not isinstance(document, dict) or document.get("format") != TREE_FORMAT:
            found = document.get("format") if isinstance(document, dict) else document
            raise ValueError(f"format is {found!r}, not {TREE_FORMAT!r}")
        version = document.get("version", 0)
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version is {version!r}, not an int")
        if version > TREE_FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{where}/{TREE_FILE} is unreadable: version {version} is newer than this "
                f"jaxckpt reads ({TREE_FORMAT_VERSION}); upgrade jaxckpt")
        if not isinstance(document.get("leaves"), list):
            raise ValueError("it has no list of leaves")
    except ValueError as error:
        raise CheckpointCorruptError(f"{where}/{TREE_FILE} is unreadable: {error}") from error
    return document


def leaf_nbytes(leaf: dict[str, Any]) -> int | None:
    """Bytes a leaf of a tree record holds in storage, from its metadata alone: the stored
    shape and dtype (``data_shape``/``data_dtype`` where the leaf is stored as other data:
    typed keys as their key data, sub-byte dtypes as bytes), else its own. None when the
    dtype is unknown to NumPy (and ml_dtypes)."""
    import ml_dtypes  # noqa: F401 - registers bfloat16, float8 and friends with NumPy
    import numpy as np

    shape = leaf.get("data_shape", leaf.get("shape")) or []
    try:
        itemsize = np.dtype(leaf.get("data_dtype", leaf.get("dtype"))).itemsize
    except TypeError:
        return None
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def read_tree_record(state_dir: str) -> dict[str, Any]:
    """``parse_tree_record`` of ``state_dir/tree.json``; ``CheckpointCorruptError`` naming
    the fix when the file is missing (a checkpoint of another backend, or an unfinished
    write)."""
    try:
        with open(os.path.join(state_dir, TREE_FILE), "rb") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{state_dir} has no {TREE_FILE}: it was not written by jaxckpt's Orbax backend "
            f"(jaxckpt.CheckpointManager), or its write did not finish. Fix: point at a "
            f"checkpoint that the Orbax backend wrote completely.") from None
    return parse_tree_record(text, state_dir)
