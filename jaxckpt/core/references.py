"""Reference counting of incremental checkpoints' files: who uses which file, what may go.

Owns: from the manifests of the committed checkpoints of a root, which checkpoints use each
physical file (``users``: its own files and its refs), which files of a step directory other
checkpoints still refer to (``referrers``), what deleting or tidying a step directory removes
(``plan_removal``: whole, or retire and keep the referred files), the ``RETIRED`` marker's
record (``retired_record``, ``parse_retired``) and merging the refs of several processes
(``merge_refs``). The store (jaxckpt/commit/retire.py) observes and acts; no I/O here.

Must not import: jax, orbax, torch, os.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from .layout import COMMIT_MARKER, RETIRED_MARKER, parse_ref_key, ref_key
from .manifest import Manifest

__all__ = ["RETIRED_FORMAT", "Removal", "users", "referrers", "plan_removal",
           "retired_record", "parse_retired", "merge_refs"]

RETIRED_FORMAT = "jaxckpt.retired/1"


def users(manifests: Mapping[int, Manifest]) -> dict[str, list[int]]:
    """Ref key of every physical file the checkpoints ``manifests`` (step -> manifest) use
    -> the steps using it, oldest first (the owner, if committed, and every referrer)."""
    found: dict[str, set[int]] = {}
    for step, manifest in manifests.items():
        for rel in manifest.files:
            found.setdefault(ref_key(step, rel), set()).add(step)
        for key in manifest.refs:
            found.setdefault(key, set()).add(step)
    return {key: sorted(steps) for key, steps in sorted(found.items())}


def referrers(owner: int, manifests: Mapping[int, Manifest]) -> dict[str, list[int]]:
    """Files of step directory ``owner`` (path inside it) that the checkpoints ``manifests``
    other than ``owner`` refer to -> those steps, oldest first."""
    found: dict[str, set[int]] = {}
    for step, manifest in manifests.items():
        if step == owner:
            continue
        for key in manifest.refs:
            parsed = parse_ref_key(key)
            if parsed is not None and parsed[0] == owner:
                found.setdefault(parsed[1], set()).add(step)
    return {rel: sorted(steps) for rel, steps in sorted(found.items())}


@dataclasses.dataclass(frozen=True, slots=True)
class Removal:
    """What removing (or tidying) one step directory does."""

    step: int
    kept: dict[str, list[int]]
    """Files other committed checkpoints refer to -> those steps: they stay. Empty: the
    directory goes whole (``whole``)."""
    doomed: tuple[str, ...]
    """Present files to delete once the directory is retired (the markers aside, which the
    store removes in their own order)."""

    @property
    def whole(self) -> bool:
        """Nothing in it is referred to: delete the directory whole."""
        return not self.kept


def plan_removal(step: int, present: Iterable[str],
                 manifests: Mapping[int, Manifest]) -> Removal:
    """How to remove step directory ``step`` holding the files ``present`` (paths inside
    it), given the manifests of every committed checkpoint of the root (the directory's own,
    if any, is ignored: it is on its way out). A file a manifest refers to is kept even if it
    is not present (a damaged checkpoint is still reported as damaged, never as valid)."""
    kept = referrers(step, manifests)
    markers = (COMMIT_MARKER, RETIRED_MARKER)
    doomed = tuple(sorted(rel for rel in present if rel not in kept and rel not in markers))
    return Removal(step=step, kept=kept, doomed=doomed)


def retired_record(removal: Removal) -> bytes:
    """The ``RETIRED`` marker of a retired step directory: what it keeps and for whom."""
    body = {"format": RETIRED_FORMAT, "step": removal.step, "kept": removal.kept}
    return json.dumps(body, indent=1, sort_keys=True).encode()


def parse_retired(data: bytes) -> dict[str, list[int]] | None:
    """The kept files -> referring steps of a ``RETIRED`` marker; None when it cannot be
    read (the directory still counts as retired: the marker's presence decides that)."""
    try:
        body = json.loads(data)
        kept = body["kept"] if body.get("format") == RETIRED_FORMAT else None
        if not isinstance(kept, dict):
            return None
        return {str(rel): [int(s) for s in steps] for rel, steps in kept.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def merge_refs(parts: Iterable[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The refs of one checkpoint from each process's share (done markers and the
    primary's own). ``ValueError`` naming the key when two processes give one key different
    entries (they read one base listing, so that is a bug, never a valid checkpoint)."""
    merged: dict[str, dict[str, Any]] = {}
    for part in parts:
        for key, entry in part.items():
            if key in merged and merged[key] != dict(entry):
                raise ValueError(f"two processes refer to {key!r} with different entries "
                                 f"({merged[key]!r} and {dict(entry)!r})")
            merged[key] = dict(entry)
    return merged
