"""A DCP data file written to an object store as DCP produces it: ``UploadStream``.

Owns: the stream DCP's writer writes a data file into on an object store: each byte extends
the file's checksum and goes to the storage's ``ObjectWriter`` (``Storage.open_writer``: on
S3, parts go up while DCP serialises the next tensors). Closing stores the object (complete
or absent) and records its entry, so the commit reads nothing back; an error aborts it. It
has no ``seek``: DCP writes a file from start to end.

Must not import: jax, orbax, torch.

Concurrency: one stream per file, used by the DCP writer thread writing it; ``written`` is
shared by one writer's streams, each storing one key.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from jaxckpt.core.checksum import RunningChecksum
from jaxckpt.storage.base import Storage

__all__ = ["UploadStream"]


class UploadStream:
    """A file DCP writes (it needs ``write``, ``tell``, ``flush``), sent to ``path`` of
    ``storage`` as it comes; its entry (size, checksum of the bytes sent) is put in
    ``written`` when it is closed."""

    def __init__(self, storage: Storage, path: str, written: dict[str, dict[str, Any]]):
        self._target = storage.open_writer(path)
        self._path = path
        self._written = written
        self._sum = RunningChecksum()
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._sum.add(view)
        self._target.write(view)
        return len(view)

    def tell(self) -> int:
        return self._sum.size

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """Nothing: bytes are sent in parts, the rest at ``close``."""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._target.close()
        self._written[self._path] = self._sum.entry()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._target.abort()

    def __enter__(self) -> UploadStream:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
