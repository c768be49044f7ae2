"""The store's side of incremental checkpoints: the files a save may refer to, and checking refs.

Owns: what a base checkpoint offers a save (``incremental_files``: its own files as ref keys
plus its refs, those still present with their recorded size), the commit's check of the refs
a writer made (``checked_refs``), checking a checkpoint's refs at ``recover/<key>`` in its
verification (``ref_problems``, each physical file once per ``memo``), and the body of the
done marker a process leaves with its checksums and refs (``done_body``, ``parse_done``).

Must not import: jax, orbax, torch.

Concurrency: any thread; the checks run on the store's pool.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from jaxckpt.core.layout import RETIRED_MARKER, parse_ref_key, ref_key
from jaxckpt.core.manifest import Manifest
from jaxckpt.errors import CheckpointWriteError

if TYPE_CHECKING:
    from jaxckpt.commit.store import CheckpointStore

__all__ = ["Memo", "incremental_files", "checked_refs", "ref_problems", "remember",
           "done_body", "parse_done"]

Check = Callable[[str, str, dict[str, Any], dict[str, int], str], str | None]
"""(owner directory, path inside it, entry, its listing, name in problems) -> problem."""


class Memo:
    """Problems of physical files already checked in one pass over a root (by ref key), so
    that a file many checkpoints use is read once and reported under each of them."""

    def __init__(self) -> None:
        self.found: dict[str, str | None] = {}
        self.listings: dict[str, dict[str, int]] = {}
        self.lock = threading.Lock()


def _listings(store: CheckpointStore, owners: set[int],
              memo: Memo | None = None) -> dict[int, dict[str, int]]:
    """The file listing of each owner's step directory (one request each, a few at a time;
    kept in ``memo`` for the rest of its pass)."""
    def listing(owner: int) -> dict[str, int]:
        path = store.step_path(owner)
        if memo is not None and path in memo.listings:
            return memo.listings[path]
        found = store.storage.list_files(path)
        if memo is not None:
            memo.listings[path] = found
        return found

    ordered = sorted(owners)
    return dict(zip(ordered, store.pool().map(listing, ordered), strict=True))


def _split(refs: Mapping[str, Any]) -> dict[str, tuple[int, str]]:
    """key -> (owner step, path inside it) of every well-formed ref key."""
    return {key: parsed for key in refs if (parsed := parse_ref_key(key)) is not None}


def incremental_files(store: CheckpointStore, path: str, step: int,
                      manifest: Manifest) -> dict[str, dict[str, Any]]:
    """Every file committed checkpoint ``path`` (of ``step``) uses, by ref key, with its
    manifest entry: its own and its refs, keeping only those present with their recorded
    size (one listing per step directory). {} when it is retired."""
    candidates = {ref_key(step, rel): info for rel, info in manifest.files.items()}
    candidates.update(manifest.refs)
    where = _split(candidates)
    listed = _listings(store, {owner for owner, _ in where.values()} | {step})
    if RETIRED_MARKER in listed[step]:
        return {}
    return {key: dict(info) for key, info in candidates.items()
            if key in where and listed[where[key][0]].get(where[key][1]) == info["size"]}


def checked_refs(store: CheckpointStore, path: str, step: int,
                 refs: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The refs a writer made for the checkpoint of ``step`` at ``path``, each checked to
    name a file of an earlier step that is there with its recorded size; raises
    ``CheckpointWriteError`` naming the first that is not (nothing is committed)."""
    checked = {key: dict(info) for key, info in (refs or {}).items()}
    where = _split(checked)
    for key in checked:
        if key not in where or where[key][0] >= step:
            raise CheckpointWriteError(
                f"commit of {path}: the writer refers to {key!r}, not a file of a checkpoint "
                f"before step {step}. This save is not committed.")
    listed = _listings(store, {owner for owner, _ in where.values()})
    for key, (owner, rel) in sorted(where.items()):
        size = listed[owner].get(rel)
        if size != checked[key].get("size"):
            raise CheckpointWriteError(
                f"commit of {path}: the file it refers to, {store.recover_dir}/{key}, is "
                f"{'missing' if size is None else f'{size} bytes'} where its base listed "
                f"{checked[key].get('size')} bytes (deleted or quarantined meanwhile?). This "
                f"save is not committed.")
    return checked


def ref_problems(store: CheckpointStore, manifest: Manifest, check: Check,
                 memo: Memo | None = None) -> list[str]:
    """What is wrong with the files ``manifest`` refers to, each named by its key and the
    step it is referenced from (``check``: the store's check of one file). With ``memo``,
    a file checked before in the same pass is not read again."""
    where = _split(manifest.refs)
    listed = _listings(store, {owner for owner, _ in where.values()}, memo)

    def one(key: str) -> str | None:
        owner, rel = where[key]
        name = f"{key} (referenced from step {owner})"
        if memo is not None:
            with memo.lock:
                if key in memo.found:
                    found = memo.found[key]
                    return None if found is None else name + found
        problem = check(store.step_path(owner), rel, manifest.refs[key], listed[owner], name)
        if memo is not None:
            with memo.lock:
                memo.found[key] = None if problem is None else problem[len(name):]
        return problem

    return [p for p in store.pool().map(one, sorted(where)) if p]


def remember(memo: Memo | None, step: int, rel: str, problem: str | None) -> str | None:
    """Record the verdict on a checkpoint's own file in ``memo`` (for its referrers), or
    take the one recorded (the problem worded for ``rel``)."""
    if memo is None:
        return problem
    key = ref_key(step, rel)
    with memo.lock:
        memo.found.setdefault(key, None if problem is None else problem[len(rel):])
    return problem


def done_body(known: Mapping[str, Any] | None, refs: Mapping[str, Any] | None) -> bytes:
    """A done marker's content: the process's checksum entries and refs (empty: none)."""
    if not known and not refs:
        return b""
    return json.dumps({"files": dict(known or {}), "refs": dict(refs or {})},
                      sort_keys=True).encode()


def parse_done(data: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checksum entries, refs) of a done marker's content (``done_body``)."""
    body = json.loads(data or b"{}")
    return dict(body.get("files") or {}), dict(body.get("refs") or {})

