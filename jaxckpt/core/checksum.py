"""File checksums for commit manifests.

Owns: the algorithms a ``COMMITTED`` manifest may name, computing one over a file or buffer
(read in 1 MiB pieces into one reused buffer per thread), and the choice for new commits:
``crc32c`` (``google-crc32c``'s C library, called through ctypes so that the GIL is
released), or ``crc32`` (zlib: format-1 manifests, and the fallback where ``google-crc32c``
has no compiled extension).

Must not import: jax, orbax, torch.

Concurrency: thread-safe; every function may run on many threads at once.
"""

from __future__ import annotations

import os
import threading
import zlib
from typing import Any

import numpy as np

__all__ = ["ALGORITHMS", "RunningChecksum", "default_algorithm", "extend", "file_checksum",
           "fd_checksum"]

ALGORITHMS = ("crc32c", "crc32")
_PIECE = 1024 * 1024
# Pieces up to this size are checksummed as bytes by the extension's own call, the GIL held
# for a few microseconds: the unlocked ctypes call's fixed cost is several times a small
# piece's checksum (torch's writer hands DCP's files over in pieces of a few KiB).
_SMALL = 256 * 1024
_buffers = threading.local()

try:  # the C extension only: see the module docstring
    import google_crc32c as _crc32c_module

    _HAVE_CRC32C = getattr(_crc32c_module, "implementation", "") == "c"
except ImportError:  # pragma: no cover - a dependency; absent only in broken installs
    _crc32c_module = None  # type: ignore[assignment]  # checked by _check_available
    _HAVE_CRC32C = False


def _unlocked_crc32c() -> Any:
    """``crc32c_extend(crc, address, length)`` of the C library under google-crc32c's
    extension, callable without the GIL (ctypes releases it), or None where it cannot be
    found (then the extension is used, GIL held)."""
    if not _HAVE_CRC32C:
        return None
    try:
        import ctypes

        from google_crc32c import _crc32c

        # dlsym on the extension also searches the library it links (crc32c_extend).
        function = ctypes.CDLL(_crc32c.__file__).crc32c_extend
        function.restype = ctypes.c_uint32
        function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        probe = np.frombuffer(b"123456789", np.uint8)
        if function(0, probe.ctypes.data, probe.size) != 0xE3069283:  # the check value
            return None
        return function
    except (ImportError, OSError, AttributeError):  # pragma: no cover - other builds
        return None


_crc32c_unlocked = _unlocked_crc32c()


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


def _extend(algorithm: str, crc: int, view: Any) -> int:
    if algorithm == "crc32c":
        if _HAVE_CRC32C and (isinstance(view, bytes) and len(view) <= _SMALL
                             or isinstance(view, memoryview) and view.nbytes <= _SMALL):
            # bytes of a memoryview: the copy of a small piece costs less than the ctypes call
            return int(_crc32c_module.extend(crc, view if isinstance(view, bytes)
                                             else view.tobytes()))
        if (_crc32c_unlocked is not None and isinstance(view, np.ndarray)
                and view.flags.c_contiguous):
            # ``view`` is held here for the whole call, so its memory stays valid.
            return int(_crc32c_unlocked(crc, view.ctypes.data, view.nbytes))
        return int(_crc32c_module.extend(crc, view))
    return zlib.crc32(view, crc)  # zlib releases the GIL itself


def extend(algorithm: str, crc: int, data: Any) -> int:
    """``crc`` (0 to start) extended over ``data`` (bytes, a numpy array or a memoryview),
    e.g. to checksum a file's bytes while they are being written instead of reading the
    file back."""
    _check_available(algorithm)
    if isinstance(data, memoryview):
        if not (_HAVE_CRC32C and algorithm == "crc32c" and data.nbytes <= _SMALL):
            data = np.frombuffer(data, np.uint8)  # google-crc32c refuses memoryviews
    return _extend(algorithm, crc, data)


class RunningChecksum:
    """A file's manifest entry (its size and checksum) built up as its bytes go by, in
    ``algorithm`` (default: the one new commits use): what a writer that checksums on the
    way reports, and the entry of bytes held whole (``RunningChecksum().add(data)``)."""

    def __init__(self, algorithm: str | None = None):
        self.algorithm = algorithm or default_algorithm()
        self.crc = 0
        self.size = 0

    def add(self, data: Any) -> RunningChecksum:
        """Extend the entry over ``data`` (bytes, a numpy array or a memoryview)."""
        self.crc = extend(self.algorithm, self.crc, data)
        self.size += memoryview(data).nbytes
        return self

    def entry(self) -> dict[str, Any]:
        """``{"size": ..., algorithm: "8 hex digits"}``, as a manifest lists a file."""
        return {"size": self.size, self.algorithm: f"{self.crc:08x}"}


def _buffer() -> tuple[memoryview, np.ndarray]:
    """This thread's read buffer, as a writable view and a uint8 array over the same bytes."""
    cached = getattr(_buffers, "value", None)
    if cached is None:
        raw = bytearray(_PIECE)
        cached = _buffers.value = (memoryview(raw), np.frombuffer(raw, dtype=np.uint8))
    return cached


def fd_checksum(fd: int, algorithm: str) -> tuple[int, str]:
    """Size and checksum (8 hex digits) of an open file, read from its start to its end."""
    _check_available(algorithm)
    view, array = _buffer()
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger readahead when cold
    os.lseek(fd, 0, os.SEEK_SET)
    size = crc = 0
    while True:
        count = os.readv(fd, [view])
        if not count:
            break
        crc = _extend(algorithm, crc, array[:count])
        size += count
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
