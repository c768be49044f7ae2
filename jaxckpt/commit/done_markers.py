"""The done markers of a save by several processes: how each says its writes are durable.

Owns: ``DoneMarkers``, the part of ``CheckpointStore`` that writes a process's
``done.p{index}`` marker with the checksums it computed and the refs it made while writing
(``incremental.done_body``), tells when every process is done, and gives the primary the
merged checksums and refs for the commit.

Must not import: jax, orbax, torch.

Concurrency: each process writes its own marker; the primary reads them all, once they exist.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from jaxckpt.commit import incremental
from jaxckpt.core.layout import done_marker_name
from jaxckpt.core.references import merge_refs
from jaxckpt.errors import CheckpointWriteError

if TYPE_CHECKING:
    from jaxckpt.storage.base import Storage

__all__ = ["DoneMarkers"]


class DoneMarkers:
    """Done markers of a multi-process save (a part of ``CheckpointStore``)."""

    if TYPE_CHECKING:
        storage: Storage

        def read_file(self, path: str, name: str) -> bytes: ...

    def mark_done(self, path: str, process_index: int,
                  known: dict[str, dict[str, Any]] | None = None, *,
                  refs: dict[str, dict[str, Any]] | None = None) -> None:
        """Say that process ``process_index``'s writes of the save in ``path`` are durable
        (multi-process commit: the primary waits for every other process's marker), with
        the manifest entries of the files it checksummed while writing (``known``) and the
        files of earlier checkpoints it referred to instead (``refs``, by ref key)."""
        self.storage.write(os.path.join(path, done_marker_name(process_index)),
                           incremental.done_body(known, refs))

    def all_done(self, path: str, process_count: int) -> bool:
        """Whether every process but the primary (index 0) has marked ``path`` done."""
        return all(self.storage.exists(os.path.join(path, done_marker_name(index)))
                   for index in range(1, process_count))

    def done_checksums(self, path: str, process_count: int) -> dict[str, dict[str, Any]]:
        """The manifest entries the other processes' done markers carry (``mark_done``)."""
        found: dict[str, dict[str, Any]] = {}
        for index in range(1, process_count):
            found.update(incremental.parse_done(
                self.read_file(path, done_marker_name(index)))[0])
        return found

    def done_refs(self, path: str, process_count: int,
                  own: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """The refs of the other processes' done markers merged with the primary's ``own``;
        ``CheckpointWriteError`` when two give one key different entries."""
        parts = [incremental.parse_done(self.read_file(path, done_marker_name(index)))[1]
                 for index in range(1, process_count)]
        try:
            return merge_refs([*parts, own or {}])
        except ValueError as exc:
            raise CheckpointWriteError(f"commit of {path}: {exc}. Not committed.") from None
