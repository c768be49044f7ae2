"""DCP's file writer for a local directory that checksums and fsyncs each file as it writes it.

Owns: ``checksumming_writer(path)``, a ``FileSystemWriter`` whose streams checksum every
byte on its way to the file, fsync it on close, and keep its manifest entry in
``writer.fs.written``; the commit takes those (``LocalDcpFiles.known_checksums``) instead
of reading the files back. A stream that was sought in records nothing (the commit then
reads that file back).

Must not import: jax, orbax. ``torch.distributed.checkpoint`` is imported on first use.

Concurrency: DCP's writer threads each write their own files; ``written`` is filled under a
lock. A writer serves one ``dcp.save`` in this process only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

from jaxckpt.core.checksum import RunningChecksum

__all__ = ["checksumming_writer", "checksumming_writer_class"]


class _ChecksummingStream:
    """A file opened for writing: every written byte extends the checksum; ``close``
    flushes, fsyncs and reports the entry (unless the stream was sought in)."""

    def __init__(self, raw: Any, report: Any):
        self._raw = raw
        self._report = report
        self._sum = RunningChecksum()
        self._sequential = True
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        count = self._raw.write(view)
        # A raw (unbuffered) file may take less than it was given; a buffered one never.
        self._sum.add(view[:count])
        return count

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._sequential = False  # the checksum no longer describes the file: record none
        return self._raw.seek(offset, whence)

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._raw.flush()
        # The commit relies on this: it reads nothing back, so it fsyncs nothing either.
        os.fsync(self._raw.fileno())
        self._raw.close()
        if self._sequential:
            self._report(self._sum.entry())


@functools.cache
def _writer_class() -> type:
    """The writer and its file system, built on first use so that torch.distributed.checkpoint
    is imported only then."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class _ChecksummingFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self._lock = threading.Lock()
            #: path -> manifest entry of each file written (and fsynced) whole.
            self.written: dict[str, dict[str, Any]] = {}

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            name = str(path)

            def report(entry: dict[str, Any]) -> None:
                with self._lock:
                    self.written[name] = entry

            with open(name, "wb") as raw:
                checksumming = _ChecksummingStream(raw, report)
                yield checksumming
                checksumming.close()

        def rename(self, path: Any, new_path: Any) -> None:
            # DCP's finish writes ".metadata.tmp" and renames it: the entry follows the file.
            super().rename(path, new_path)
            with self._lock:
                entry = self.written.pop(str(path), None)
                if entry is not None:
                    self.written[str(new_path)] = entry

    class _ChecksummingWriter(FileSystemWriter):
        """FileSystemWriter whose files are checksummed and fsynced as they are written."""

        def __init__(self, path: str):
            # sync_files=False: the streams fsync themselves, DCP's fsync would be a second.
            super().__init__(path, sync_files=False)
            self.fs = _ChecksummingFileSystem()
            self.path = self.fs.init_path(path)

    return _ChecksummingWriter


def checksumming_writer_class() -> type:
    """The class of :func:`checksumming_writer`'s writers (for ``dcp.incremental`` to extend)."""
    return _writer_class()


def checksumming_writer(path: str) -> Any:
    """A DCP storage writer into the local directory ``path`` whose ``fs.written`` holds,
    once the save finished, the manifest entry of every file it wrote, by full path."""
    return _writer_class()(path)
