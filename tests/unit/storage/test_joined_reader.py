"""JoinedReader: several buffers read as one seekable file, without joining them."""

from __future__ import annotations

import io

import numpy as np
import pytest

from jaxckpt.storage.readers import JoinedReader


def pieces() -> list:
    return [b"", memoryview(np.arange(10, dtype=np.uint8)), b"", b"abc"]


def _read_all(reader: JoinedReader, size: int) -> bytes:
    chunks = []
    while chunk := reader.read(size):
        chunks.append(bytes(chunk))
    return b"".join(chunks)


def test_reads_in_any_sizes_give_the_concatenation_and_then_empty_bytes():
    want = bytes(range(10)) + b"abc"
    for size in (1, 3, 4, 100):
        reader = JoinedReader(pieces())
        got = _read_all(reader, size)
        assert got == want, size
        assert reader.read(5) == b"" and reader.tell() == len(want) == len(reader)


def test_a_read_never_copies_and_never_spans_two_pieces():
    array = np.arange(10, dtype=np.uint8)
    reader = JoinedReader([memoryview(array), b"xyz"])
    first = reader.read(100)
    assert isinstance(first, memoryview) and first.nbytes == 10
    array[0] = 99
    assert first[0] == 99  # a view of the array's memory, not a copy
    assert bytes(reader.read(100)) == b"xyz"


def test_seek_and_tell_rewind_for_a_retry_and_read_all_returns_the_rest():
    reader = JoinedReader(pieces())
    assert bytes(reader.read(12)) == bytes(range(10))  # stops at the piece's end
    assert reader.seek(0) == 0
    assert reader.read() == bytes(range(10)) + b"abc"
    assert reader.seek(-2, io.SEEK_END) == 11 and reader.read(-1) == b"bc"
    assert reader.seek(8) == 8 and reader.seek(1, io.SEEK_CUR) == 9
    buffer = bytearray(8)
    assert reader.readinto(buffer) == 1 and buffer[:1] == b"\x09"
    with pytest.raises(ValueError, match="negative"):
        reader.seek(-1)
