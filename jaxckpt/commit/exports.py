"""Export directories of a root: listing, publishing and deleting them.

Owns: ``ExportDirs``, the part of ``CheckpointStore`` for ``{root}/export``: the completed
exports (a directory under its final name on POSIX, one with a commit marker on an object
store), where an exporter writes before publishing, publishing by rename (POSIX) or upload
and commit (``object_steps``), and deletion that never leaves half a model under a valid name.

Must not import: jax, orbax, torch.

Concurrency: the primary process only.
"""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, cast

from jaxckpt.commit import object_steps as store_objects
from jaxckpt.core.layout import parse_export_dirname, tmp_name
from jaxckpt.storage.posix import PosixStorage

if TYPE_CHECKING:
    from jaxckpt.commit.store import CheckpointStore
    from jaxckpt.storage.base import Storage

__all__ = ["ExportDirs"]


class ExportDirs:
    """Export directories (a part of ``CheckpointStore``)."""

    if TYPE_CHECKING:
        storage: Storage
        export_dir: str

        def is_committed(self, path: str) -> bool: ...

        def delete_whole(self, path: str) -> bool: ...

    def _posix(self, what: str) -> PosixStorage:
        """The storage, for an operation that needs a POSIX rename (see
        ``PosixStorage.rename_posix``)."""
        if not isinstance(self.storage, PosixStorage):
            raise NotImplementedError(
                f"{what} moves a directory, which only a POSIX filesystem does atomically; "
                f"{type(self.storage).__name__} has no such operation yet")
        return self.storage

    # --- exports ------------------------------------------------------------------------
    def _export_dirs(self) -> list[tuple[int, str]]:
        found = []
        for name in self.storage.list_names(self.export_dir):
            parsed = parse_export_dirname(name.rstrip("/"))
            if parsed:
                found.append((parsed[2], os.path.join(self.export_dir, name.rstrip("/"))))
        return sorted(found)

    def export_entries(self) -> list[tuple[int, str]]:
        """(global_step, path) of every completed export, oldest first (on an object store:
        those with a commit marker, ``store_objects``)."""
        if isinstance(self.storage, PosixStorage):
            return self._export_dirs()
        return [(step, path) for step, path in self._export_dirs() if self.is_committed(path)]

    def export_tmp_path(self, name: str) -> str:
        """Where the exporter writes the export ``name``: a temporary directory beside the
        exports, or a local one for an object store (``store_objects.export_staging``)."""
        if not isinstance(self.storage, PosixStorage):
            return store_objects.export_staging(name)
        return os.path.join(self.export_dir, tmp_name(name, uuid.uuid4().hex[:8]))

    def publish_export(self, tmp: str, final: str) -> None:
        """Give the export written in ``tmp`` (``export_tmp_path``) its name ``final``,
        replacing an export already there (from a discarded attempt at the step): a rename on
        POSIX, an upload and a commit marker on an object store."""
        if not isinstance(self.storage, PosixStorage):
            store_objects.publish_export(cast("CheckpointStore", self), tmp, final)
            return
        posix = self._posix("publish_export")
        if os.path.lexists(final):  # POSIX only anyway: a link counts as an entry too
            self.delete_export(final)
        posix.rename_posix(tmp, final)

    def delete_export(self, path: str) -> None:
        """Delete an export: renamed to a temp name first (so a crash midway leaves debris
        that start-up cleanup removes, never a half model under a valid name); on an object
        store, its commit marker first."""
        if not isinstance(self.storage, PosixStorage):
            self.delete_whole(path)
            return
        doomed = self.export_tmp_path(os.path.basename(path) + ".deleting")
        try:
            self._posix("delete_export").rename_posix(path, doomed)
        except FileNotFoundError:
            return
        self.storage.delete_prefix(doomed)
