"""The steps of the commit protocol that take another form on an object store (no rename).

Owns: quarantine by server-side copy then delete, marker first (``copy_then_delete``), and
exports on an object store (``export_staging``, ``publish_export``): the exporter writes a
local temporary directory, whose files are uploaded under the export's name and vouched
for by a ``COMMITTED`` manifest created last, as for a recovery checkpoint; a prefix
without it is debris for the next start-up cleanup. ``CheckpointStore`` calls these for
storages other than ``PosixStorage``.

Must not import: jax, orbax, torch.

Concurrency: the primary process only, under the root lock, one thread per checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from jaxckpt.core.checksum import RunningChecksum
from jaxckpt.core.layout import parse_export_dirname

if TYPE_CHECKING:
    from jaxckpt.commit.store import CheckpointStore

__all__ = ["copy_then_delete", "export_staging", "publish_export"]


def copy_then_delete(store: CheckpointStore, path: str, target: str) -> None:
    """Copy every object below ``path`` to the same name below ``target``, then delete
    ``path`` (its commit marker first). ``FileNotFoundError`` when nothing is at ``path``."""
    files = store.storage.list_files(path)
    if not files:
        raise FileNotFoundError(2, "nothing to move", path)
    for rel in sorted(files):
        store.storage.copy(f"{path}/{rel}", f"{target}/{rel}")
    store.delete_whole(path)


def export_staging(name: str) -> str:
    """A new local temporary directory the exporter writes the export ``name`` into."""
    return tempfile.mkdtemp(prefix=f"jaxckpt-export-{name}-")


def publish_export(store: CheckpointStore, tmp: str, final: str) -> None:
    """Upload the export written in the local directory ``tmp`` to ``final`` (replacing an
    export already there), then commit it with a manifest of the checksums computed from
    the local files; ``tmp`` is removed whatever happens."""
    try:
        if store.storage.is_prefix(final):
            store.delete_whole(final)
        known: dict[str, dict[str, Any]] = {}
        for dirpath, _, filenames in os.walk(tmp):
            for filename in sorted(filenames):
                local = os.path.join(dirpath, filename)
                rel = os.path.relpath(local, tmp).replace(os.sep, "/")
                with open(local, "rb") as stream:
                    data = stream.read()
                store.storage.write(f"{final}/{rel}", data)
                known[rel] = RunningChecksum().add(data).entry()
        parsed = parse_export_dirname(os.path.basename(final))
        store.commit(final, parsed[2] if parsed else 0, known=known)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
