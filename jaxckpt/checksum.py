"""File checksums for commit manifests.

Owns: the checksum algorithms a ``COMMITTED`` manifest may name, computing one over a file
(through a read-only memory map: no bytes objects are allocated per chunk), and the choice
of algorithm for new commits.

- ``crc32c`` (Castagnoli), the default for new commits, computed by ``google-crc32c``'s C
  extension with the CPU's CRC instruction: about 10 GiB/s here against 5.5 GiB/s for
  zlib's crc32, and it releases the GIL. The commit pass re-reads every byte a save wrote,
  so this halves the CPU that a commit takes away from the training loop (72 MiB: 16 ms ->
  9 ms; docs/performance.md). tensorstore and cloud object stores use the same polynomial.
- ``crc32`` (zlib), what manifests of format 1 carry; still verified, and what new commits
  fall back to when ``google-crc32c`` has no compiled extension on a platform (its pure
  Python fallback runs at a few MB/s, too slow for gigabytes).

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import mmap
import os
import zlib

import numpy as np

__all__ = ["ALGORITHMS", "default_algorithm", "file_checksum", "fd_checksum"]

ALGORITHMS = ("crc32c", "crc32")
_CHUNK = 64 * 1024 * 1024

try:  # the C extension only: see the module docstring
    import google_crc32c as _crc32c_module

    _HAVE_CRC32C = getattr(_crc32c_module, "implementation", "") == "c"
except ImportError:  # pragma: no cover - a dependency; absent only in broken installs
    _crc32c_module = None
    _HAVE_CRC32C = False


def default_algorithm() -> str:
    """The algorithm new commits record: crc32c when its C extension is present."""
    return "crc32c" if _HAVE_CRC32C else "crc32"


def _check_available(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: "
                         f"{', '.join(ALGORITHMS)}")
    if algorithm == "crc32c" and _crc32c_module is None:
        raise RuntimeError(
            "this checkpoint's manifest uses crc32c checksums but the google-crc32c package "
            "is not installed. Fix: pip install google-crc32c (a jaxckpt dependency), or "
            "verify with sizes only.")


def _extend(algorithm: str, crc: int, view: np.ndarray) -> int:
    if algorithm == "crc32c":
        return int(_crc32c_module.extend(crc, view))  # type: ignore[union-attr]
    return zlib.crc32(view, crc)


def fd_checksum(fd: int, algorithm: str) -> tuple[int, str]:
    """Size and checksum (8 hex digits) of an open file, read through a memory map."""
    _check_available(algorithm)  # before mapping: nothing below raises while a view lives
    size = os.fstat(fd).st_size
    crc = 0
    if size:
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
            data = np.frombuffer(mapped, dtype=np.uint8)  # a view: nothing is copied
            try:
                for start in range(0, size, _CHUNK):
                    crc = _extend(algorithm, crc, data[start:start + _CHUNK])
            finally:
                del data  # release the buffer before the map closes
    return size, f"{crc:08x}"


def file_checksum(path: str, algorithm: str, *, fsync: bool = False) -> tuple[int, str]:
    """Size and checksum of the file at ``path``; ``fsync`` also makes it durable (its
    writer may not have). Opened with O_NOATIME where allowed: reading a just-written file
    would otherwise dirty its inode (atime) and turn the fsync into a journal commit."""
    flags = os.O_RDONLY | getattr(os, "O_NOATIME", 0)
    try:
        fd = os.open(path, flags)
    except PermissionError:  # O_NOATIME needs the file's owner
        fd = os.open(path, os.O_RDONLY)
    try:
        result = fd_checksum(fd, algorithm)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return result
