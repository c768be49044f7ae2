"""How a restore verifies the checkpoints it considers.

Owns: the verification plan of one restore (``plan``: sizes, checksums, and which bulk
checksums are deferred to run alongside the backend's read), the checks of a step asked for
explicitly, of the item versions a checkpoint refers to, and the deferred checksums run in a
thread while the backend reads (``Verifier.start_deferred_checks``), with
``DeferredChecksumsFailed``, how a failed deferred check reaches recovery.

Must not import: jax, orbax, torch, or the other parts of the manager.

Concurrency contract: a ``Verifier`` is used from the training thread; the deferred checks
run on a thread of their own (one per restore), touch nothing but the files under a reader
lock, and hand back their problems through a future. Only the primary verifies; the other
processes take its verdict (recovery broadcasts it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from jaxckpt.commit.deferred_checks import DeferredChecks
from jaxckpt.commit.store import CheckpointStore, OnManifest
from jaxckpt.config import RecoverConfig
from jaxckpt.core.layout import DRIVER_FILE
from jaxckpt.core.manifest import DEFER_CHECKSUMS_OVER, Manifest
from jaxckpt.errors import CheckpointCorruptError, CheckpointNotFoundError

__all__ = ["Verification", "DeferredChecksumsFailed", "Verifier", "plan"]


@dataclasses.dataclass(frozen=True, slots=True)
class Verification:
    """How one restore checks the checkpoints it considers."""

    checksums: bool
    """Checksums as well as sizes (``RecoverConfig.verify == "checksums"``)."""
    defer_over: int | None
    """Bulk files larger than this are checksummed while the backend reads them, not before
    (``CheckpointStore.verify(defer_over=...)``); None: every checksum up front."""
    deferred_items: frozenset[str]
    """Items whose bulk checksums are deferred as well: those being restored."""
    read_ahead: bool = False
    """The state's deferred files are all claimed and loaded whole by the backend
    (``BackendFeatures.takes_read_ahead``, a full restore in one process): on an object
    store the manager starts fetching them as soon as it has the manifest
    (``read_ahead.ReadAhead``), before the verification's other requests."""


class DeferredChecksumsFailed(Exception):
    """Internal: the checksums checked alongside a read failed (every process raises it,
    the primary with the problems it found). Never leaves the manager: recovery turns it
    into a fallback or a ``CheckpointCorruptError``."""

    def __init__(self, path: str, own: list[str], items: list[str]):
        super().__init__(path)
        self.path = path
        self.own = own
        self.items = items

    @property
    def problems(self) -> tuple[str, ...]:
        return (*self.own, *self.items)

    def corrupt_error(self) -> CheckpointCorruptError:
        """What ``restore(step=...)`` raises, worded as when the checksums fail up front."""
        if self.own:
            return CheckpointCorruptError(
                f"checkpoint {self.path} failed verification: " + "; ".join(self.problems)
                + ". Restore another step (step=None picks the latest valid one).")
        if self.items:
            return CheckpointCorruptError(
                f"checkpoint {self.path} refers to unusable items: " + "; ".join(self.items)
                + ". Restore another step.")
        return CheckpointCorruptError(
            f"checkpoint {self.path} failed verification on the primary process (its error "
            f"names the damaged files). Restore another step (step=None picks the latest "
            f"valid one).")


def plan(config: RecoverConfig, backend: Any, items: Mapping[str, Any] | None, *,
         partial: bool = False, processes: int = 1) -> Verification:
    """How one restore checks checkpoints. With checksums on, the checksums of bulk array
    files are checked alongside the read (the read brings the same bytes in from disk,
    so the two share one pass) and the restored values are thrown away if it fails. A
    backend that reads into the caller's live objects (``reads_in_place``, e.g. DCP)
    could not take its values back, so it gets every checksum before the read, unless it
    also ``verifies_reads`` (it checks what it claims before loading any of it) and the
    restore runs in one process (``processes``: the others are given no claims); items,
    which it reads without claims, are checked first either way.

    ``partial`` (a restore of a subtree): every data file's checksum waits for the read,
    whatever its size, so that the backend can withdraw those of the files it does not
    read (``DeferredChecks.limit``): a partial restore checksums what it restores, and only
    sizes and metadata of the rest."""
    checksums = config.verify == "checksums"
    features = backend.features
    in_place = features.reads_in_place
    checks_first = in_place and features.verifies_reads and processes == 1
    overlap = checksums and (not in_place or checks_first)
    defer_over = (0 if partial else DEFER_CHECKSUMS_OVER) if overlap else None
    deferred_items = frozenset(items or ()) if overlap and not in_place else frozenset()
    # A partial restore fetches only what it loads: nothing is fetched before it knows.
    read_ahead = checksums and checks_first and not partial and features.takes_read_ahead
    return Verification(checksums=checksums, defer_over=defer_over,
                        deferred_items=deferred_items, read_ahead=read_ahead)


class Verifier:
    """The checks of one manager's restores (the store's ``verify`` and friends, applied to
    checkpoints and the item versions they refer to)."""

    def __init__(self, store: CheckpointStore, *, primary: bool):
        self._store = store
        self._primary = primary

    def start_deferred_checks(self, path: str, checks: Verification,
                              claims: DeferredChecks | None = None, *,
                              manifest: Manifest | None = None,
                              ) -> concurrent.futures.Future[tuple[list[str], list[str]]] | None:
        """Primary: start checking, in a thread, the checksums that ``choose`` left out,
        of the checkpoint and of the item versions about to be restored with it. The
        result is (the checkpoint's problems, the items' problems).

        With ``claims`` the entries are offered first (here, before the read starts), the
        backend claims the files it checks while reading them, and the thread checks the
        rest once the backend closed its claims (a ``DeferredChecks``). ``manifest``: the
        checkpoint's, as its choice verified it (on an object store, a GET not repeated on
        the way to the first chunk)."""
        if checks.defer_over is None or not self._primary:
            return None
        over = checks.defer_over
        refs = [(name, version) for name, version in self.item_refs(path).items()
                if name in checks.deferred_items]
        directories = [(None, path)] + [(f"item {name!r} v{version}: ",
                                         self._store.item_path(name, version))
                                        for name, version in refs]
        known = {path: manifest} if manifest is not None else {}
        offered: dict[str, list[str]] = {}  # directory -> problems found while offering
        if claims is not None:
            for _, directory in directories:
                try:
                    claims.offer(directory, self._store.deferred_entries(
                        directory, over=over, manifest=known.get(directory)))
                except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
                    offered[directory] = [str(exc)]
                except Exception as exc:  # noqa: BLE001 - unverified bytes are never trusted
                    offered[directory] = [f"checksums could not be checked "
                                          f"({type(exc).__name__}: {exc})"]

        def problems_of(directory: str) -> list[str]:
            if claims is None:
                return self._deferred_problems(directory, over, manifest=known.get(directory))
            if directory in offered:
                return offered[directory]
            return self._deferred_problems(directory, over, claims.unclaimed(directory))

        def run() -> tuple[list[str], list[str]]:
            own = problems_of(path)
            item_problems: list[str] = []
            for prefix, directory in directories[1:]:
                item_problems += [f"{prefix}{problem}" for problem in problems_of(directory)]
            return own, item_problems

        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                     thread_name_prefix="jaxckpt-verify")
        try:
            return pool.submit(run)
        finally:
            pool.shutdown(wait=False)  # the submitted check still runs to its end

    def _deferred_problems(self, path: str, over: int,
                           entries: list[tuple[str, dict[str, Any]]] | None = None, *,
                           manifest: Manifest | None = None) -> list[str]:
        """``store.verify_deferred`` (or ``verify_entries`` of the given ``entries``) under a
        reader lock, reporting instead of raising: a check that cannot run has not vouched
        for anything."""
        try:
            with self._store.reading(path):
                if entries is not None:
                    return self._store.verify_entries(path, entries)
                return self._store.verify_deferred(path, over=over, manifest=manifest)
        except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
            return [str(exc)]
        except Exception as exc:  # noqa: BLE001 - unverified bytes are never trusted
            return [f"checksums could not be checked ({type(exc).__name__}: {exc})"]

    def item_refs(self, path: str) -> dict[str, int]:
        """Item name -> version that a committed checkpoint refers to ({} when its driver
        cannot be read: that problem is reported when the driver is read)."""
        try:
            refs = json.loads(self._store.read_file(path, DRIVER_FILE)).get("items") or {}
        except (OSError, ValueError):
            return {}
        return {name: int(ref.get("version", -1)) for name, ref in refs.items()}

    def item_problems(self, path: str, checks: Verification) -> list[str]:
        """What is wrong with the item versions a committed checkpoint refers to (the
        checksums of bulk files of the items in ``checks.deferred_items`` left out)."""
        problems = []
        for name, version in self.item_refs(path).items():
            item_dir = self._store.item_path(name, version)
            defer = checks.defer_over if name in checks.deferred_items else None
            try:
                for problem in self._store.verify(item_dir, checksums=checks.checksums,
                                                  defer_over=defer):
                    problems.append(f"item {name!r} v{version}: {problem}")
            except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
                problems.append(f"item {name!r} v{version}: {exc}")
        return problems

    def check_requested(self, step: int, checks: Verification) -> int:
        """Primary: the step asked for by ``restore(step=...)``, checked as ``checks`` says
        (deferred checksums left out); raises when it is missing or damaged."""
        self.check_requested_manifest(step, checks)
        return step

    def check_requested_manifest(self, step: int, checks: Verification, *,
                                 on_manifest: OnManifest | None = None) -> Manifest:
        """``check_requested``, giving the manifest it verified (for the deferred checks);
        ``on_manifest(path, manifest)`` is called once the manifest is read, before the
        rest is checked (``store.CheckpointStore.latest_valid``)."""
        path = self._store.step_path(step)
        if not self._store.storage.is_prefix(path):
            available = self._store.committed_steps()
            raise CheckpointNotFoundError(
                f"no checkpoint for step {step} under {self._store.recover_dir}; committed steps "
                f"are {available or 'none'}. Pass one of those, or step=None for the latest.")
        manifest = self._store.committed_manifest(path)
        if on_manifest is not None:
            on_manifest(path, manifest)
        problems = self._store.verify(path, checksums=checks.checksums,
                                      defer_over=checks.defer_over, manifest=manifest)
        if problems:
            raise CheckpointCorruptError(
                f"checkpoint {path} failed verification: " + "; ".join(problems)
                + ". Restore another step (step=None picks the latest valid one).")
        return manifest
