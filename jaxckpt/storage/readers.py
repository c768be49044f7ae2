"""A read-only file over several buffers in turn, without joining them: ``JoinedReader``.

Owns: ``SeekableReader`` (the position of a read-only, seekable binary file: what every
such reader of ours shares) and ``JoinedReader``, the body of one request made of pieces
(an array's memory, then a few bytes of index after it) that the HTTP client reads, hashes
and sends piece by piece, rewinding it to retry, where joining them would first copy every
byte into fresh memory.

Must not import: jax, orbax, torch, boto3 (the client only calls the file methods).

Concurrency contract: one reader per request, used by one thread at a time; the pieces must
not change while it is read (the writer's staged arrays do not).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

__all__ = ["JoinedReader", "SeekableReader"]


class SeekableReader(io.RawIOBase):
    """A read-only binary file's position: ``tell`` and ``seek`` (from the start, the
    position or ``_end()``, never before the start). Subclasses read from ``_position``."""

    def __init__(self) -> None:
        super().__init__()
        self._position = 0

    def _end(self) -> int:
        """The size of the file (asked only by a seek from the end)."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            base = 0
        elif whence == io.SEEK_CUR:
            base = self._position
        elif whence == io.SEEK_END:
            base = self._end()
        else:
            raise ValueError(f"invalid whence {whence!r}")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position


class JoinedReader(SeekableReader):
    """The concatenation of ``pieces`` as a seekable binary file. ``read(n)`` returns a
    view into one piece (at most ``n`` bytes, never across two pieces: a short read, which
    file readers allow), or ``b""`` at the end; ``len()`` is the total size."""

    def __init__(self, pieces: Sequence[bytes | bytearray | memoryview]):
        super().__init__()
        self._pieces = [memoryview(piece).cast("B") for piece in pieces if len(piece)]
        self._size = sum(piece.nbytes for piece in self._pieces)

    def __len__(self) -> int:
        return self._size

    def _end(self) -> int:
        return self._size

    def read(self, size: int | None = -1) -> bytes | memoryview:
        if size is None or size < 0:  # everything left: one copy, as a plain file gives
            return b"".join(self._rest())
        start = self._position
        for piece in self._pieces:
            if start < piece.nbytes:
                view = piece[start:start + size]
                self._position += view.nbytes
                return view if view.nbytes else b""
            start -= piece.nbytes
        return b""

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = self.read(len(buffer))
        memoryview(buffer).cast("B")[:len(view)] = view
        return len(view)

    def _rest(self) -> list[memoryview]:
        rest, start = [], self._position
        for piece in self._pieces:
            if start < piece.nbytes:
                rest.append(piece[start:])
                start = 0
            else:
                start -= piece.nbytes
        self._position = self._size
        return rest
