"""Reference-counted removal of step directories: delete whole, or retire, then purge.

Owns: the survey of a root's step directories by their markers (committed, retired,
partial) with the committed manifests (read once per store: a committed manifest never
changes), and acting on ``core.references.plan_removal``: a directory no committed manifest
refers to is deleted whole (commit marker first, as ever); one that is still referred to is
retired (``RETIRED`` written, then ``COMMITTED`` deleted, then the files nobody refers to),
and a retired directory is tidied, then purged, as its referrers go. Every step is safe to
kill: a file a committed manifest refers to is never deleted, and ``cleanup_partial`` (or the
next removal) finishes the job. The same on an object store (no rename needed).

Must not import: jax, orbax, torch.

Concurrency: the primary process only, under the root lock (retention's commit thread, or
start-up cleanup); reads of the manifest cache from any thread.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import TYPE_CHECKING

from jaxckpt.core.layout import (
    COMMIT_MARKER,
    RETIRED_MARKER,
    parse_ref_key,
    parse_step_dirname,
)
from jaxckpt.core.manifest import Manifest
from jaxckpt.core.references import plan_removal, referrers, retired_record
from jaxckpt.errors import CheckpointCorruptError

if TYPE_CHECKING:
    from jaxckpt.commit.store import CheckpointStore

__all__ = ["Survey", "ManifestCache", "markers", "survey", "remove", "sweep", "step_of"]


class ManifestCache:
    """Parsed manifests of committed checkpoints by directory (they never change while
    committed); the store forgets a directory when it commits, deletes or moves it."""

    def __init__(self) -> None:
        self._manifests: dict[str, Manifest] = {}
        self._lock = threading.Lock()

    def get(self, store: CheckpointStore, path: str) -> Manifest | None:
        """The manifest of committed ``path`` (read on first use); None when it has none."""
        with self._lock:
            found = self._manifests.get(path)
        if found is None:
            found = store.read_manifest(path)
            if found is not None:
                self.put(path, found)
        return found

    def holds(self, path: str) -> bool:
        with self._lock:
            return path in self._manifests

    def put(self, path: str, manifest: Manifest) -> None:
        with self._lock:
            self._manifests[path] = manifest

    def forget(self, path: str) -> None:
        with self._lock:
            self._manifests.pop(path, None)


def markers(store: CheckpointStore, path: str, *,
            committed_only: bool = False) -> tuple[bool, bool]:
    """(has a commit marker, has a retired marker) of one step directory. A committed
    directory whose manifest this store holds is not retired (only the root lock's holder
    retires, and it forgets the manifest first): no second request, and on an object store
    none at all for the markers this process wrote. ``committed_only``: the retired marker
    of an uncommitted directory is not asked for (reported False)."""
    has_commit = store.storage.exists(os.path.join(path, COMMIT_MARKER))
    if (has_commit and store.manifests.holds(path)) or (committed_only and not has_commit):
        return has_commit, False
    return has_commit, store.storage.exists(os.path.join(path, RETIRED_MARKER))


def step_of(store: CheckpointStore, path: str) -> int | None:
    """The step of ``path`` when it is a step directory of ``store``'s ``recover/``."""
    head, _, name = path.rstrip("/").rpartition("/")
    if head.rstrip("/") != store.recover_dir.rstrip("/"):
        return None
    return parse_step_dirname(name)


@dataclasses.dataclass(frozen=True, slots=True)
class Survey:
    """The step directories of a root by what their markers say."""

    manifests: dict[int, Manifest]
    """Committed (and not retired) checkpoints whose manifest parses: what refers to files."""
    committed: list[int]
    """Every committed, not retired step (a few may have an unreadable manifest)."""
    others: dict[int, str]
    """Retired or partial step directories (no checkpoint), by step."""
    retired: frozenset[int]


def survey(store: CheckpointStore) -> Survey:
    """One look at every step directory (a listing each, run a few at a time) and the
    committed manifests (from the cache). A manifest that does not parse refers to nothing:
    its checkpoint can never be restored. Other errors propagate (nothing is decided on a
    partial view)."""
    found = store._step_dirs()
    pool = store.pool()
    seen = list(pool.map(lambda item: markers(store, item[1]), found))
    manifests: dict[int, Manifest] = {}
    committed: list[int] = []
    others: dict[int, str] = {}
    retired = set()
    for (step, path), (has_commit, has_retired) in zip(found, seen, strict=True):
        if has_retired:
            retired.add(step)
        if has_commit and not has_retired:
            committed.append(step)
        else:
            others[step] = path
    for step, manifest in zip(committed, pool.map(
            lambda s: _manifest_or_none(store, store.step_path(s)), committed), strict=True):
        if manifest is not None:
            manifests[step] = manifest
    return Survey(manifests=manifests, committed=committed, others=others,
                  retired=frozenset(retired))


def _manifest_or_none(store: CheckpointStore, path: str) -> Manifest | None:
    try:
        return store.manifests.get(store, path)
    except CheckpointCorruptError:
        return None


def remove(store: CheckpointStore, path: str, step: int, *,
           seen: Survey | None = None) -> bool:
    """Remove step directory ``path`` as far as the committed manifests allow: whole when
    nothing refers to it, else retire it. False when it is being read (nothing changed).
    ``seen``: a survey just taken (cleanup acts on many directories with one)."""
    seen = survey(store) if seen is None else seen
    try:
        own = store.manifests.get(store, path)
    except CheckpointCorruptError:
        own = None
    marker = os.path.join(path, COMMIT_MARKER)
    store.manifests.forget(path)  # first: see ``markers``
    if not referrers(step, seen.manifests):  # the usual case: no listing needed
        # Un-commit first: a crash from here on leaves a partial directory, never a
        # committed checkpoint with files missing.
        if not store.storage.delete_unless_reading(marker):
            return False
        store.storage.delete_prefix(path)
    else:
        present = store.storage.list_files(path)
        removal = plan_removal(step, present, seen.manifests)
        retired = os.path.join(path, RETIRED_MARKER)
        was_retired = RETIRED_MARKER in present and COMMIT_MARKER not in present
        store.storage.write(retired, retired_record(removal))
        if not store.storage.delete_unless_reading(marker):
            if not was_retired:
                store.storage.delete(retired)
            return False
        _delete_files(store, path, removal.doomed)
    if own is not None:
        sweep(store, _owners(own) - {step}, {s: m for s, m in seen.manifests.items()
                                             if s != step})
    return True


def sweep(store: CheckpointStore, owners: set[int],
          manifests: dict[int, Manifest] | None = None) -> None:
    """Tidy the retired directories among ``owners`` (steps): delete the files no committed
    manifest refers to any more, and the whole directory once nothing is left that is."""
    for owner in sorted(owners):
        path = store.step_path(owner)
        has_commit, has_retired = markers(store, path)
        if not has_retired:
            continue
        if manifests is None:
            manifests = survey(store).manifests
        present = store.storage.list_files(path)
        removal = plan_removal(owner, present, manifests)
        if removal.whole:
            store.storage.delete_prefix(path)  # nothing refers to it: any order is safe
        elif removal.doomed or has_commit:
            store.storage.write(os.path.join(path, RETIRED_MARKER), retired_record(removal))
            store.storage.delete(os.path.join(path, COMMIT_MARKER))
            _delete_files(store, path, removal.doomed)


def _owners(manifest: Manifest) -> set[int]:
    """Steps whose files ``manifest`` refers to."""
    return {parsed[0] for key in manifest.refs if (parsed := parse_ref_key(key)) is not None}


def _delete_files(store: CheckpointStore, path: str, rels: tuple[str, ...]) -> None:
    """Delete these files of ``path``, a few at a time."""
    storage = store.storage
    list(store.pool().map(lambda rel: storage.delete(os.path.join(path, *rel.split("/"))),
                          rels))


def delete_step(store: CheckpointStore, path: str, step: int) -> bool:
    """``CheckpointStore.delete`` of a step directory: ``remove``, and a directory that was
    retired already (the caller wants its name back: a step saved again) and is still
    referred to is moved to ``superseded/`` (its referrers then fail verification)."""
    has_commit, has_retired = markers(store, path)
    if not store.storage.is_prefix(path):
        return True
    if not remove(store, path, step):
        return False
    if has_retired and not has_commit and store.storage.is_prefix(path):
        store.quarantine(path, "retired")
    return True


def clean_steps(store: CheckpointStore) -> list[str]:
    """Start-up cleanup of step directories that are no checkpoint: partial ones are deleted
    (a file a committed manifest refers to excepted: then retired), retired ones finished
    (a kill mid-retire) and tidied or purged. Returns the directories deleted whole."""
    seen = survey(store)
    removed = []
    for step, path in sorted(seen.others.items()):
        remove(store, path, step, seen=seen)
        if not store.storage.is_prefix(path):
            removed.append(path)
    return removed
