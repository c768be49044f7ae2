"""Taking a checkpoint root for one job: its layout, its lock, the debris of a crash.

Owns: ``open_store`` (a root string to a store over its ``Storage``, refused when it holds
another tool's files), ``attach_backend`` (an object-store root's storage handed to a
backend that writes there) and ``prepare_root``, what the primary does before a manager
uses a root: check conditional writes on an object store (``storage.write_probe``), create
the directories, take the root lock (``CheckpointStore.lock``), remove partial and
temporary entries and unfinished uploads; with the errors of an unusable root.

Must not import: jax, orbax, torch, or any part of the manager.

Concurrency: once per manager, by the primary, before any other process touches the root;
a second job's ``prepare_root`` raises and leaves the root as it was.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, cast

from jaxckpt.backends.base import Backend, ObjectStorageBackend
from jaxckpt.commit.ownership import check_root
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.errors import CheckpointError, CheckpointRootError
from jaxckpt.storage.base import RootLock
from jaxckpt.storage.posix import PosixStorage
from jaxckpt.storage.url import parse_root
from jaxckpt.storage.write_probe import check_conditional_writes

__all__ = ["attach_backend", "open_store", "prepare_root"]

log = logging.getLogger("jaxckpt")


def open_store(root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None,
               backend: Backend | None = None) -> CheckpointStore:
    """The store of ``root``: a local path, or an ``s3://`` URL served by the storage
    ``storage_options`` configure (``root_url.parse_root``). Refuses (``CheckpointRootError``)
    an unknown scheme, an object-store root for a ``backend`` that cannot write there (None:
    the default Orbax backend, which can), and a root holding files jaxckpt did not write.
    Creates nothing, locally or remotely."""
    _, where = parse_root(root, storage_options)
    if isinstance(where, str):
        check_root(where)
        return CheckpointStore(where)
    url = os.fspath(root).rstrip("/")
    if backend is not None:
        _check_writes_objects(url, backend)
    check_root(url, storage=where)
    return CheckpointStore(url, storage=where)


def _check_writes_objects(url: str, backend: Backend) -> None:
    if not backend.features.object_storage:
        raise CheckpointRootError(
            f"{url!r}: object-storage roots are not supported by the array backends yet for "
            f"the {backend.name!r} backend (it writes local paths only). Nothing was written. "
            f"Fix: use a local or network filesystem root with this backend, or the Orbax "
            f"backend (jaxckpt.CheckpointManager), which writes s3:// roots.")


def attach_backend(store: CheckpointStore, backend: Backend) -> None:
    """Hand an object-store root's storage to the backend (``Backend.attach_storage``);
    ``CheckpointRootError`` for a backend that cannot write there. Nothing for local roots."""
    if isinstance(store.storage, PosixStorage):
        return
    _check_writes_objects(store.root, backend)
    # Declaring the feature is declaring the member (backend.ObjectStorageBackend).
    cast(ObjectStorageBackend, backend).attach_storage(store.storage)


def prepare_root(store: CheckpointStore) -> RootLock:
    """Primary: check an object store's conditional writes (``ConditionalWritesError``),
    create the layout, take the root lock, clean what a crash left behind.
    Returns the held lock (the caller releases it); the lock is released again if
    anything after it fails."""
    root = store.root
    if not isinstance(store.storage, PosixStorage):
        # Before anything else is written: the lease itself relies on what this checks.
        check_conditional_writes(store.storage, root)
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
