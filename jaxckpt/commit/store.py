"""The commit protocol over one root: what makes a directory a checkpoint, and its lifecycle.

Owns: ``CheckpointStore``: commit (a ``COMMITTED`` manifest of every file's size and
checksum, created last and create-only after a durability barrier), listing, verification
(whole, or split by ``defer_over`` so that bulk checksums run alongside the backend's
read), latest valid, race-tolerant deletion (marker first; reference-counted, ``retire``),
start-up cleanup, quarantine and export directories; incremental checkpoints' refs are
checked in ``incremental``. Names come from ``core.layout``, the format from ``core.manifest``,
and every I/O from a ``storage.base.Storage``: this module holds the protocol only.

Must not import: jax, orbax, torch.

Concurrency: ``commit``, ``delete``, ``cleanup_partial`` and ``quarantine`` run on the
primary only; ``delete`` never removes a checkpoint held by ``reading`` (in any process of
the host). Requests run on a process-wide pool whose tasks never wait on one another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

from jaxckpt.commit import incremental, object_steps as store_objects, retire
from jaxckpt.commit.done_markers import DoneMarkers
from jaxckpt.commit.exports import ExportDirs
from jaxckpt.core.checksum import default_algorithm, extend
from jaxckpt.core.content_hash import HASH_NAME, is_hash
from jaxckpt.core.layout import (
    COMMIT_MARKER,
    EXPORT,
    ITEMS,
    RECOVER,
    RETIRED_MARKER,
    SUPERSEDED,
    is_item_dirname,
    is_tmp_name,
    parse_step_dirname,
    parse_version_dirname,
    step_dirname,
    superseded_name,
    version_dirname,
)
from jaxckpt.core.manifest import (
    DEFER_CHECKSUMS_OVER,
    Manifest,
    algorithm_of,
    checksum_problem,
    deferrable,
    missing_problem,
    outside_problem,
    size_problem,
    unlisted_problem,
    unreadable_problem,
)
from jaxckpt.errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointWriteError
from jaxckpt.storage.base import RootLock, Storage
from jaxckpt.storage.posix import PosixStorage
from jaxckpt.storage.threads import SharedThreads

__all__ = ["CheckpointStore", "Entry", "Memo", "OnManifest", "Status", "write_file_soon"]

Memo = incremental.Memo
"""Verdicts shared by the verifications of one pass over a root (``CheckpointStore.verify``)."""

OnManifest = Callable[[str, Manifest], None]
"""Told (directory, manifest) as soon as a committed checkpoint's manifest is read, before
the rest of it is verified (a restore starts fetching its bulk files there)."""


Status = Literal["committed", "partial", "corrupt"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One checkpoint directory as found on disk."""

    step: int
    path: str
    status: Status
    problems: tuple[str, ...] = ()
    manifest: Manifest | None = None


_RETIRED_PROBLEM = (f"{{path}}: retired ({RETIRED_MARKER} marker): no checkpoint any more, "
                    f"it only keeps files that later checkpoints refer to")

_POOLS: dict[int, SharedThreads] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The process-wide pool of ``workers`` threads that runs the store's requests (checks,
    checksums, listings), kept from call to call: a fresh pool starts a thread per request
    sent at once, one after the other (about a millisecond each on a busy host), so the
    last small GET of a restore's verification went out over ten milliseconds after the
    first. One per distinct ``workers`` (a storage's ``concurrent_requests``)."""
    with _POOLS_LOCK:
        shared = _POOLS.get(workers)
        if shared is None:
            shared = _POOLS[workers] = SharedThreads(workers, "jaxckpt-store")
    return shared.get()


def _new_pools_lock() -> None:
    """In a forked child: a parent's thread may have held the lock (each pool restarts by
    itself)."""
    global _POOLS_LOCK
    _POOLS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_pools_lock)


def _run_checks(check: Callable[[tuple[str, dict[str, Any]]], str | None],
                entries: list[tuple[str, dict[str, Any]]], workers: int) -> list[str]:
    """The problems ``check`` finds in manifest ``entries``, in order, ``workers`` at a time
    (checksums release the GIL and overlap I/O)."""
    return [problem for problem in _pool(workers).map(check, entries) if problem]


class _Counter:
    """Bytes checked so far, reported to a ``progress(done, total)`` callable (thread-safe)."""

    def __init__(self, total: int, progress: Callable[[int, int], None] | None):
        self.total, self.done, self.progress = total, 0, progress
        self._lock = threading.Lock()

    def add(self, nbytes: Any) -> None:
        if self.progress is None:
            return
        with self._lock:
            self.done += int(nbytes) if isinstance(nbytes, int) else 0
            self.progress(self.done, self.total)


def _listing(storage: Storage, path: str) -> Future[dict[str, int]]:
    """``storage.list_files(path)``, started on the store's pool (the caller does not wait
    for it: a listing that nobody needs, of a directory found partial, ends alone)."""
    return _pool(storage.concurrent_requests).submit(storage.list_files, path)


def _committable(rel: str) -> bool:
    """Whether a file found in a checkpoint directory belongs in its manifest: everything
    but the marker itself and temporary entries."""
    return rel != COMMIT_MARKER and not is_tmp_name(rel.rsplit("/", 1)[-1])


def _check_file(storage: Storage, path: str, rel: str, info: dict[str, Any], *,
                checksums: bool, listed: dict[str, int] | None = None,
                name: str | None = None) -> str | None:
    """What is wrong with one manifest entry in ``storage`` (None: nothing): a path that
    leaves the checkpoint, a missing or unreadable file, a size or (when asked) checksum
    mismatch. ``listed``: sizes from a listing of ``path`` just taken (saves asking the
    storage for each file's size). ``name``: the file's name in problems (``rel``)."""
    full = os.path.join(path, *rel.split("/"))
    name = rel if name is None else name
    if not storage.resolves_inside(full, path):
        return outside_problem(name)
    size = None if listed is None else listed.get(rel)
    if size is None:
        try:
            size = storage.size(full)
        except FileNotFoundError:
            return missing_problem(name)
        except OSError as exc:
            return unreadable_problem(name, exc)
    problem = size_problem(name, info, size)
    if problem or not checksums:
        return problem
    try:
        _, crc = storage.checksum(full, algorithm_of(info))
    except OSError as exc:
        return unreadable_problem(name, exc)
    return checksum_problem(name, info, crc)


class CheckpointStore(DoneMarkers, ExportDirs):
    """Checkpoint directories of one root: ``{root}/recover`` and ``{root}/export``.

    Concurrency contract: see the module docstring; the store keeps no state of its own
    beyond its root, its storage and the committed manifests it read (``manifests``, a
    thread-safe cache), so any number of threads may use one.
    """

    def __init__(self, root: str | os.PathLike[str], *, storage: Storage | None = None):
        self.root = os.fspath(root)
        self.storage: Storage = storage if storage is not None else PosixStorage()
        self.recover_dir = os.path.join(self.root, RECOVER)
        self.export_dir = os.path.join(self.root, EXPORT)
        #: Committed manifests read so far, by directory (``retire.ManifestCache``).
        self.manifests = retire.ManifestCache()

    def pool(self) -> ThreadPoolExecutor:
        """The process-wide pool this store's requests run on (``_pool``)."""
        return _pool(self.storage.concurrent_requests)

    # --- naming -------------------------------------------------------------------------
    def step_path(self, step: int) -> str:
        return os.path.join(self.recover_dir, step_dirname(step))

    def item_path(self, name: str, version: int) -> str:
        """Directory of one version of an auxiliary item (e.g. a GRPO reference policy)."""
        return os.path.join(self.recover_dir, ITEMS, name, version_dirname(version))

    def item_versions(self, name: str, *, committed_only: bool = True) -> list[int]:
        """Versions of an item on disk, oldest first (committed ones unless told otherwise)."""
        base = os.path.join(self.recover_dir, ITEMS, name)
        out = []
        for entry in self.storage.list_names(base):
            version = parse_version_dirname(entry.rstrip("/"))
            if version is not None and (not committed_only or self.storage.exists(
                    os.path.join(base, entry.rstrip("/"), COMMIT_MARKER))):
                out.append(version)
        return sorted(out)

    def item_names(self) -> list[str]:
        names = (n.rstrip("/") for n in self.storage.list_names(
            os.path.join(self.recover_dir, ITEMS)))
        return sorted(n for n in names if is_item_dirname(n))

    def ensure_dirs(self) -> None:
        for path in (self.root, self.recover_dir, self.export_dir):
            self.storage.make_prefix(path)

    def lock(self) -> RootLock:
        """Take the root lock for this job's lifetime (``Storage.lock_root``); raises
        ``RootLockedError`` naming the holder when another live job has it."""
        return self.storage.lock_root(self.root)

    # --- files of one checkpoint ----------------------------------------------------------
    def is_committed(self, path: str) -> bool:
        """Whether ``path`` has a commit marker (not verified; cheap)."""
        return self.storage.exists(os.path.join(path, COMMIT_MARKER))

    def write_file(self, path: str, name: str, data: bytes) -> None:
        """Write one file of a checkpoint being saved (``driver.json``, a process's local
        driver state), atomically and durably (``Storage.write``)."""
        self.storage.write(os.path.join(path, name), data)

    def read_file(self, path: str, name: str) -> bytes:
        """The bytes of one file of a checkpoint; ``FileNotFoundError`` when it has none."""
        return self.storage.read(os.path.join(path, name))

    def size_of(self, path: str) -> int:
        """Bytes of every file below ``path`` (an export, whose writer did not say)."""
        return sum(self.storage.list_files(path).values())

    # --- listing and verification ---------------------------------------------------------
    def _step_dirs(self) -> list[tuple[int, str]]:
        found = []
        for name in self.storage.list_names(self.recover_dir):
            step = parse_step_dirname(name[:-1]) if name.endswith("/") else None
            if step is not None:
                found.append((step, os.path.join(self.recover_dir, name[:-1])))
        return sorted(found)

    def read_manifest(self, path: str) -> Manifest | None:
        """The manifest of a checkpoint directory, or None when it has no marker."""
        try:
            data = self.storage.read(os.path.join(path, COMMIT_MARKER))
        except FileNotFoundError:
            return None
        except OSError as exc:  # a directory in its place, no permission, I/O error
            raise CheckpointCorruptError(f"{path}: commit marker is unreadable ({exc})") from exc
        return Manifest.parse(data, path)

    def committed_manifest(self, path: str) -> Manifest:
        """The manifest of ``path``; raises like :meth:`verify` when there is none. The
        marker is asked for first: when it is there (the usual case) the directory is too,
        and the request that tells a missing directory from an uncommitted one is saved."""
        try:
            manifest = self.read_manifest(path)
        except CheckpointCorruptError:
            if not self.storage.is_prefix(path):  # e.g. a file in its place
                raise CheckpointNotFoundError(f"no checkpoint directory at {path!r}") from None
            raise
        if manifest is None and not self.storage.is_prefix(path):
            raise CheckpointNotFoundError(f"no checkpoint directory at {path!r}")
        if manifest is None and self.storage.exists(os.path.join(path, RETIRED_MARKER)):
            raise CheckpointCorruptError(_RETIRED_PROBLEM.format(path=path))
        if manifest is None:
            raise CheckpointCorruptError(
                f"{path}: no {COMMIT_MARKER} marker: this checkpoint never finished committing "
                f"(the job stopped while saving); it is not restorable")
        return manifest

    def verify(self, path: str, *, checksums: bool = True, defer_over: int | None = None,
               progress: Callable[[int, int], None] | None = None,
               manifest: Manifest | None = None,
               listed: Future[dict[str, int]] | None = None,
               memo: incremental.Memo | None = None) -> list[str]:
        """Problems found in a committed checkpoint (empty when it is valid).

        Every listed file must exist inside the directory with its listed size (and checksum
        with ``checksums``), and no file may be present that the manifest does not list.
        ``defer_over``: leave out the checksums of bulk-data files larger than this many bytes
        (``DEFER_CHECKSUMS_OVER``; all else, sizes included, is still checked), which
        :meth:`verify_deferred` checks later; None: every checksum here. ``progress(done,
        total)``: called (from worker threads) with the bytes of the listed files checked so
        far. ``manifest``, ``listed``: the manifest just read from ``path`` and its listing
        under way (``_listing``), saving a request each. The files of earlier checkpoints
        it refers to (``Manifest.refs``) are checked the same way, never deferred, at
        ``recover/<key>``; ``memo``: verdicts shared by one pass over a root (each physical
        file is read once, its problem reported under every checkpoint using it).

        Raises ``CheckpointNotFoundError`` when ``path`` is not a directory and
        ``CheckpointCorruptError`` when it has no or an unreadable commit marker.
        """
        manifest = self.committed_manifest(path) if manifest is None else manifest
        sizes = self.storage.list_files(path) if listed is None else listed.result()
        counted = _Counter(manifest.total_bytes + manifest.referenced_bytes, progress)

        def check(item: tuple[str, dict[str, Any]]) -> str | None:
            rel, info = item
            crc = checksums and (defer_over is None or not deferrable(rel, info, defer_over))
            problem = _check_file(self.storage, path, rel, info, checksums=crc, listed=sizes)
            counted.add(info.get("size", 0))
            return incremental.remember(memo, manifest.step, rel, problem) if crc else problem

        def check_ref(owner: str, rel: str, info: dict[str, Any], listed: dict[str, int],
                      name: str) -> str | None:
            counted.add(info.get("size", 0))
            return _check_file(self.storage, owner, rel, info, checksums=checksums,
                               listed=listed, name=name)

        problems = _run_checks(check, sorted(manifest.files.items()),
                               self.storage.concurrent_requests)
        if manifest.refs:
            problems += incremental.ref_problems(self, manifest, check_ref, memo)
        present = {rel for rel in sizes if _committable(rel)}
        for rel in sorted(present - set(manifest.files)):
            # A file the commit never vouched for could be read by a backend all the same.
            problems.append(_RETIRED_PROBLEM.format(path=path) if rel == RETIRED_MARKER
                            else unlisted_problem(rel))
        return problems

    def verify_deferred(self, path: str, *, over: int = DEFER_CHECKSUMS_OVER,
                        manifest: Manifest | None = None) -> list[str]:
        """The second half of ``verify(path, checksums=True, defer_over=over)``: problems in
        the files whose checksums it left out (their sizes are compared again too), empty when
        they match; ``manifest``: the one ``verify`` used. Raises like :meth:`verify`."""
        return self.verify_entries(path, self.deferred_entries(path, over=over,
                                                               manifest=manifest))

    def deferred_entries(self, path: str, *, over: int = DEFER_CHECKSUMS_OVER,
                         manifest: Manifest | None = None) -> list[tuple[str, dict[str, Any]]]:
        """The manifest entries whose checksums ``verify(defer_over=over)`` leaves out, as
        (manifest path, entry); ``manifest`` as in :meth:`verify_deferred`. Raises like
        :meth:`verify`."""
        manifest = self.committed_manifest(path) if manifest is None else manifest
        return [(rel, info) for rel, info in sorted(manifest.files.items())
                if deferrable(rel, info, over)]

    def verify_entries(self, path: str, entries: list[tuple[str, dict[str, Any]]]) -> list[str]:
        """Problems in these manifest entries of ``path`` (size and checksum), a few files
        at a time."""
        storage = self.storage
        return _run_checks(lambda item: _check_file(storage, path, *item, checksums=True),
                           entries, storage.concurrent_requests)

    def entry(self, path: str, *, checksums: bool = False) -> Entry:
        """One checkpoint directory with its status, as :meth:`entries` reports it; its step
        is the manifest's, else the one in its name (``step_N``, ``vN``), else 0."""
        name = os.path.basename(path)
        step = parse_step_dirname(name)
        if step is None:
            step = parse_version_dirname(name)
        entry = _classify(self, step or 0, path, checksums=checksums) or Entry(
            step=step or 0, path=path, status="corrupt",
            problems=(_RETIRED_PROBLEM.format(path=path),))
        if entry.manifest is not None and entry.manifest.step != entry.step:
            entry = dataclasses.replace(entry, step=entry.manifest.step)
        return entry

    def entries(self, *, checksums: bool = False,
                progress: Callable[[int, int], None] | None = None) -> list[Entry]:
        """Every step directory but retired ones, oldest first, with its status (a file
        several checkpoints use is checked once, its problem reported under each).
        ``progress(done, total)``: called with the count of directories classified so far,
        after each."""
        found = self._step_dirs()
        entries: list[Entry] = []
        memo = incremental.Memo()
        for done, (step, path) in enumerate(found, 1):
            entry = _classify(self, step, path, checksums=checksums, memo=memo)
            if entry is not None:
                entries.append(entry)
            if progress is not None:
                progress(done, len(found))
        return entries

    def committed_steps(self) -> list[int]:
        """Steps with a commit marker and not retired (not re-verified; cheap), oldest
        first."""
        found = self._step_dirs()
        seen = self.pool().map(
            lambda item: retire.markers(self, item[1], committed_only=True), found)
        return [step for (step, _), (committed, retired) in zip(found, seen, strict=True)
                if committed and not retired]

    def latest_valid(self, *, checksums: bool = True, at_or_before: int | None = None,
                     defer_over: int | None = None, on_manifest: OnManifest | None = None,
                     ) -> tuple[Entry | None, list[Entry]]:
        """The newest valid checkpoint and the newer ones skipped (partial or corrupt).

        With ``defer_over`` (see :meth:`verify`) the returned entry is valid except for the
        checksums left out, which the caller must check with :meth:`verify_deferred`.
        ``on_manifest``: told each candidate's manifest before the candidate is verified."""
        skipped: list[Entry] = []
        for step, path in reversed(self._step_dirs()):
            if at_or_before is not None and step > at_or_before:
                continue
            entry = _classify(self, step, path, checksums=checksums, defer_over=defer_over,
                              on_manifest=on_manifest)
            if entry is None:  # retired: not a checkpoint
                continue
            if entry.status == "committed":
                return entry, skipped
            skipped.append(entry)
        return None, skipped

    # --- commit ---------------------------------------------------------------------------
    def commit(self, path: str, step: int, *, exclude: tuple[str, ...] = (),
               known: dict[str, dict[str, Any]] | None = None,
               refs: dict[str, dict[str, Any]] | None = None,
               durable_dirs: Collection[str] = ()) -> Manifest:
        """Make ``path`` a valid checkpoint: checksum every file and make it and every
        directory durable, then create the marker. Call only after every process's writes
        ended.

        ``known``: manifest entries (``{"size": n, algorithm: hex}``, by path relative to
        ``path``) of files whose writer computed their checksum from the bytes it wrote and
        made them durable itself (``chunk_io``): those are not read back, only their size is
        checked against the file's; an entry may add its content hash (``HASH_NAME``).
        Entries of another algorithm than this commit's, or of files that are not there, are
        refused (a writer's bug, never a valid manifest).

        ``refs``: files of earlier checkpoints this one uses instead of writing them, by ref
        key (``incremental_files`` of its base), each checked to be present with its size
        (else ``CheckpointWriteError``, nothing committed).

        ``durable_dirs``: directories below ``path`` (relative, "/"-separated) whose
        writer made their entries durable after the last one was made (``Storage.sync``'s
        ``skip``); every other directory, ``path`` and its parent are synced here.
        """
        for rel in durable_dirs:
            if rel.startswith("/") or not set(rel.split("/")).isdisjoint({"", ".", ".."}):
                raise ValueError(f"commit of {path}: durable directory {rel!r} is not a "
                                 f"path below the checkpoint")
        listed = self.storage.list_files(path)
        files = sorted(rel for rel in listed if _committable(rel) and rel not in exclude)
        algorithm = default_algorithm()
        known = dict(known or {})
        for rel, info in known.items():
            if (rel not in files or set(info) - {HASH_NAME} != {"size", algorithm}
                    or not is_hash(info.get(HASH_NAME, "0" * 32))):
                raise ValueError(f"commit of {path}: the writer's checksum entry for {rel!r} "
                                 f"({info!r}) names no file of the checkpoint or is not "
                                 f"{{'size', {algorithm!r}[, {HASH_NAME!r}]}}")
        checked = incremental.checked_refs(self, path, step, refs)
        sums = _summarise_and_name(self.storage, path,
                                   [rel for rel in files if rel not in known], algorithm,
                                   durable_dirs)
        for rel, info in known.items():
            size = listed[rel]
            if size != info["size"]:
                raise CheckpointWriteError(
                    f"{os.path.join(path, rel)} has {size} bytes but its writer wrote "
                    f"{info['size']}: the file changed after it was written. This save is "
                    "not committed.")
            sums[rel] = (size, info[algorithm])
        entries = {rel: {"size": sums[rel][0], algorithm: sums[rel][1]} for rel in files}
        for rel, info in known.items():
            if HASH_NAME in info:
                entries[rel][HASH_NAME] = info[HASH_NAME]
        manifest = Manifest(step=step, created=time.time(), files=entries, refs=checked)
        self.storage.create(os.path.join(path, COMMIT_MARKER), manifest.to_bytes())
        self.manifests.put(path, manifest)
        return manifest

    def incremental_files(self, path: str) -> dict[str, dict[str, Any]]:
        """What a save may refer to with committed checkpoint ``path`` as its base
        (``backends.base.IncrementalBase.files``): every file it uses, its own and those it
        refers to, by ref key with its manifest entry, if still present with its recorded
        size ({} for a retired directory). Raises like :meth:`verify` without a manifest."""
        manifest = self.manifests.get(self, path)
        if manifest is None:
            manifest = self.committed_manifest(path)
        return incremental.incremental_files(self, path, manifest.step, manifest)

    # --- reading and deletion ----------------------------------------------------------------
    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[None]:
        """Hold a shared lock on a checkpoint while restoring it, so retention skips it."""
        with self.storage.reading(os.path.join(path, COMMIT_MARKER)):
            yield

    def delete(self, path: str) -> bool:
        """Delete one checkpoint directory; False when it is being read (try again later).

        Files already gone (another deleter, a user) count as deleted. A step directory is
        deleted as far as other checkpoints' refs allow (``retire.remove``): one whose files
        are still referred to is retired instead; one that was retired already is moved to
        ``superseded/`` (its name is about to be written again).
        """
        step = retire.step_of(self, path)
        if step is not None:
            return retire.delete_step(self, path, step)
        self.manifests.forget(path)
        return self.delete_whole(path)

    def delete_whole(self, path: str) -> bool:
        """``delete`` of the whole directory, whoever refers to it (a quarantine's last step
        on an object store, items, exports)."""
        self.manifests.forget(path)
        # Un-commit first: a crash from here on leaves a partial directory, never a
        # committed checkpoint with files missing.
        if not self.storage.delete_unless_reading(os.path.join(path, COMMIT_MARKER)):
            return False
        self.storage.delete_prefix(path)
        return True

    def cleanup_partial(self) -> list[str]:
        """Remove recovery directories without a commit marker (finishing retired ones:
        ``retire.clean_steps``) and stray temp entries, as a job starts (under the root
        lock, so no other job can be writing them)."""
        removed = self.storage.discard_incomplete_uploads(self.root)
        removed += retire.clean_steps(self)
        if isinstance(self.storage, PosixStorage):
            # A write killed before its rename leaves its temp file, also inside a step
            # that stays committed (retention's RETIRED marker); object stores have none.
            for _, path in self._step_dirs():
                for name in self.storage.list_names(path):
                    if is_tmp_name(name):
                        full = os.path.join(path, name.rstrip("/"))
                        self.storage.delete_prefix(full)
                        removed.append(full)
        for name in self.item_names():
            for version in self.item_versions(name, committed_only=False):
                path = self.item_path(name, version)
                if not self.storage.exists(os.path.join(path, COMMIT_MARKER)):
                    self.storage.delete_prefix(path)
                    removed.append(path)
        if not isinstance(self.storage, PosixStorage):  # exports commit with a marker there
            for _, path in self._export_dirs():
                if not self.is_committed(path):
                    self.storage.delete_prefix(path)
                    removed.append(path)
        for parent in (self.recover_dir, self.export_dir):
            for name in self.storage.list_names(parent):
                if is_tmp_name(name):
                    full = os.path.join(parent, name.rstrip("/"))
                    self.storage.delete_prefix(full)
                    removed.append(full)
        return removed

    def quarantine(self, path: str, reason: str) -> str:
        """Move a checkpoint that must not stay at its name (corrupt, or from a discarded
        future) to ``recover/superseded/``, keeping it for inspection instead of deleting:
        a rename on POSIX, copy-then-delete on an object store (``store_objects``)."""
        target = os.path.join(self.recover_dir, SUPERSEDED, superseded_name(
            os.path.basename(path), reason, int(time.time()), uuid.uuid4().hex[:6]))
        self.manifests.forget(path)
        if isinstance(self.storage, PosixStorage):
            self.storage.rename_posix(path, target)
        else:
            store_objects.copy_then_delete(self, path, target)
        return target


def _summarise(storage: Storage, path: str, rels: list[str],
               algorithm: str) -> dict[str, tuple[int, str]]:
    """(size, checksum) of each file, made durable in the same pass, a few at a time."""
    def summarise(rel: str) -> tuple[int, str]:
        full = os.path.join(path, rel)
        # Our writers never make links; one found here is recorded, never followed, and
        # verification refuses it.
        if not storage.resolves_inside(full, path):
            return 0, "link"
        return storage.checksum(full, algorithm, sync=True)

    pool = _pool(storage.concurrent_requests)
    return dict(zip(rels, pool.map(summarise, rels), strict=True))


def _summarise_and_name(storage: Storage, path: str, rels: list[str], algorithm: str,
                        durable_dirs: Collection[str] = ()) -> dict[str, tuple[int, str]]:
    """``_summarise`` (the files ``rels`` checksummed and made durable) while every name
    below ``path`` is made durable (``Storage.sync(data=False)``): both are flushes of the
    device's cache that gain from being in flight together, neither needs the other, and
    only the marker, created after this returns, needs both. Together they shorten the
    commit by about a third (benchmarks/results/save-write-floor_cpu2core_2026-11-25.md).
    ``durable_dirs``: directories whose names the writer made durable (not synced again).
    With no file to summarise (every one checksummed by its writer), the names alone, on
    this thread."""
    if not rels:
        storage.sync(path, data=False, skip=durable_dirs)
        return {}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxckpt-names") as names:
        named = names.submit(storage.sync, path, data=False, skip=durable_dirs)
        try:
            sums = _summarise(storage, path, rels, algorithm)
        finally:
            named_error = named.exception()  # waits: nothing of it outlives the commit
    if named_error is not None:
        raise named_error
    return sums


def write_file_soon(store: CheckpointStore, path: str, name: str,
                    data: bytes) -> Future[dict[str, Any]]:
    """``store.write_file``, started on the store's pool: the caller goes on (with the
    arrays' write) and waits for the returned future before committing. Its result is the
    file's manifest entry (size and checksum of ``data``, written durably), which the
    commit may take as ``known`` instead of reading the file back."""
    def write() -> dict[str, Any]:
        store.write_file(path, name, data)
        algorithm = default_algorithm()
        return {"size": len(data), algorithm: f"{extend(algorithm, 0, data):08x}"}

    return _pool(store.storage.concurrent_requests).submit(write)


def _classify(store: CheckpointStore, step: int, path: str, *, checksums: bool,
              defer_over: int | None = None, on_manifest: OnManifest | None = None,
              memo: incremental.Memo | None = None) -> Entry | None:
    """One step directory of ``store`` with its status: partial (no marker), corrupt, or
    committed (``defer_over``, ``memo``: as in ``CheckpointStore.verify``), listed while its
    marker is read (two round trips at once on an object store); ``on_manifest`` is told the
    manifest before the rest is verified. None: a retired directory (no checkpoint)."""
    listed = _listing(store.storage, path)
    try:
        manifest = store.read_manifest(path)
    except CheckpointCorruptError as exc:
        if RETIRED_MARKER in listed.result():
            return None
        return Entry(step=step, path=path, status="corrupt", problems=(str(exc),))
    if RETIRED_MARKER in listed.result():
        return None
    if manifest is None:
        return Entry(step=step, path=path, status="partial")
    store.manifests.put(path, manifest)
    if on_manifest is not None:
        on_manifest(path, manifest)
    problems = tuple(store.verify(path, checksums=checksums, defer_over=defer_over,
                                  manifest=manifest, listed=listed, memo=memo))
    return Entry(step=step, path=path, status="corrupt" if problems else "committed",
                 problems=problems, manifest=manifest)
