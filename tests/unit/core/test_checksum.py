"""A file's running checksum does not depend on how its bytes are handed over: small pieces
(the extension's own call) and large ones (the unlocked call) give the same value."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from jaxckpt.core.checksum import RunningChecksum, default_algorithm, extend


def test_crc32c_of_the_standard_check_string():
    if default_algorithm() != "crc32c":
        pytest.skip("google-crc32c's C extension is not installed")
    assert extend("crc32c", 0, b"123456789") == 0xE3069283
    assert extend("crc32c", 0, memoryview(b"123456789")) == 0xE3069283


@pytest.mark.parametrize("algorithm", ["crc32c", "crc32"])
@pytest.mark.parametrize("piece", [1, 9 * 1024, 256 * 1024, 256 * 1024 + 1, 1 << 20])
def test_pieces_of_any_size_and_kind_give_the_whole_checksum(algorithm, piece):
    if algorithm == "crc32c" and default_algorithm() != "crc32c":
        pytest.skip("google-crc32c's C extension is not installed")
    data = np.random.default_rng(0).integers(0, 256, 3 * (1 << 20) + 7, dtype=np.uint8)
    whole = extend(algorithm, 0, data)
    if algorithm == "crc32":
        assert whole == zlib.crc32(data.tobytes())
    view = memoryview(data.tobytes())
    step = max(piece, 4096) if piece == 1 else piece  # one-byte pieces over the first 4 KiB
    for kind in (bytes, memoryview, np.asarray):
        running = RunningChecksum(algorithm)
        if piece == 1:
            for i in range(4096):
                running.add(kind(view[i:i + 1]))
            start = 4096
        else:
            start = 0
        for i in range(start, len(view), step):
            running.add(kind(view[i:i + step]) if kind is not np.asarray
                        else np.frombuffer(view[i:i + step], np.uint8))
        assert running.crc == whole and running.size == len(view), kind


def test_a_memoryview_of_another_format_is_checksummed_as_its_bytes():
    floats = np.arange(1000, dtype=np.float32)
    assert RunningChecksum().add(memoryview(floats)).crc == extend(
        default_algorithm(), 0, floats.view(np.uint8))
