"""Taking a checkpoint root for one job: its layout, its lock, the debris of a crash.

Owns: ``prepare_root``, what the primary process does to a root before a manager uses it
(create the directories, take the exclusive root lock, remove the partial and temporary
entries an interrupted run left), with the errors a root that cannot be used raises. The
lock itself (``CheckpointStore.lock``, a ``RootLease``) and the layout are the store's.

Must not import: jax, orbax, torch, or any part of the manager.

Concurrency contract: called once per manager, by the primary process only, before any
other process touches the root (the manager's start-up barrier follows). Across jobs: the
lock admits one job per root; a second job's ``prepare_root`` raises and leaves the root as
it was.
"""

from __future__ import annotations

import logging

from .errors import CheckpointError, CheckpointRootError
from .storage import RootLease
from .store import CheckpointStore

__all__ = ["prepare_root"]

log = logging.getLogger("jaxckpt")


def prepare_root(store: CheckpointStore) -> RootLease:
    """Primary: create the layout, take the root lock, clean what a crash left behind.
    Returns the held lock (the caller releases it); the lock is released again if
    anything after it fails."""
    root = store.root
    try:
        store.ensure_dirs()
        lock = store.lock()
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointRootError(
            f"checkpoint root {root!r} cannot be used: {exc.strerror or exc} ({exc.filename}). "
            f"The root must be a directory this process can create and write (it is "
            f"created if missing). Fix: pass another root, or give this user write access "
            f"to it (chmod/chown).") from exc
    try:
        removed = store.cleanup_partial()
    except BaseException:
        lock.release()
        raise
    if removed:
        log.warning("jaxckpt: removed %d partial or temporary entries left by an "
                    "interrupted run: %s", len(removed), removed)
    return lock
