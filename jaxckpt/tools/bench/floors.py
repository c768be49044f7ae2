"""The raw floors of ``jaxckpt bench``: what the disk gives with no library in the way.

Owns: the raw writes (buffered, and ``O_DIRECT`` from aligned blocks), the raw reads into
new memory, the listing of a checkpoint's files and the ``O_DIRECT`` probe, shared by the
bench's rows (``jaxckpt.tools.bench``) and the ``--scale`` run (``bench.scale``).

Must not import: jax, orbax, torch (numpy, ``jaxckpt.storage.buffers``, the chunk I/O's
``PIECE``).

Concurrency contract: each function is safe on any thread; callers run them on pools.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import mmap
import os
from collections.abc import Callable

import numpy as np

_MiB = 1 << 20


def _raw_write(path: str, arrays: list[np.ndarray]) -> None:
    """The disk's durable write speed for these bytes: one file, 64 MiB writes, one fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for array in arrays:
            view = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
            while view:
                written = os.write(fd, view[:64 * _MiB])
                view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """``os.pwrite`` until all of ``view`` is written (a write may take only part of it)."""
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _raw_write_direct(path: str, block: np.ndarray) -> None:
    """The same with O_DIRECT: ``block`` is already ALIGN-aligned and whole blocks long,
    so the device copies straight from it (8 MiB writes, what chunk_io writes)."""
    from jaxckpt.backends.orbax.chunk_io import PIECE

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        view = block.data
        for offset in range(0, len(view), PIECE):
            _pwrite_all(fd, view[offset:offset + PIECE], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_read_direct(path: str, nbytes: int, *, numpy_memory: bool = False) -> np.ndarray:
    """Read a file with O_DIRECT into one new aligned buffer, in 8 MiB reads: the kind of
    memory a restore reads into and hands over (``buffers.fresh_blocks``), or with
    ``numpy_memory`` numpy's (``np.empty``, which asks for huge pages from 4 MiB on: a row
    of its own, not a floor; benchmarks/results/restore-read-floor_cpu2core_2026-11-25.md)."""
    from jaxckpt.backends.orbax.chunk_io import PIECE
    from jaxckpt.storage.buffers import aligned_blocks, fresh_blocks

    out = aligned_blocks(nbytes) if numpy_memory else fresh_blocks(nbytes)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        offset = 0
        while offset < nbytes:
            got = os.preadv(fd, [out[offset:offset + PIECE].data], offset)
            if got <= 0:
                break
            offset += got
    finally:
        os.close(fd)
    return out[:nbytes]


def _files_under(directory: str) -> list[tuple[str, int]]:
    """Every regular file below ``directory`` with its size, largest first."""
    files = [(os.path.join(parent, name), os.path.getsize(os.path.join(parent, name)))
             for parent, _, names in os.walk(directory) for name in names]
    return sorted(files, key=lambda file: -file[1])


def _read_all(pool: concurrent.futures.Executor, read: Callable[[str, int], np.ndarray],
              files: list[tuple[str, int]]) -> None:
    """``read`` every file into its own new buffer on ``pool`` (the raw floors' way: 4
    threads, started before the clock)."""
    list(pool.map(lambda file: read(*file), files))


def _touch_fresh(nbytes: int) -> None:
    """Allocate ``nbytes`` of the memory a restore reads into (``buffers.fresh_blocks``)
    and write one byte per page: the page faults alone that any read into new memory pays
    (what this VM makes dear when the host reclaimed the memory)."""
    from jaxckpt.storage.buffers import fresh_blocks

    buffer = fresh_blocks(nbytes)
    buffer[::mmap.PAGESIZE] = 1


def _raw_read(path: str, nbytes: int) -> np.ndarray:
    """Read a whole file into one new buffer (what a restore has to produce at least), in
    8 MiB reads rather than one giant read(). The buffer is the kind of memory a restore
    reads into and hands over (``buffers.fresh_blocks``): numpy's own memory would make the
    floor measure the memory's history rather than the disk
    (benchmarks/results/restore-read-floor_cpu2core_2026-11-25.md)."""
    from jaxckpt.storage.buffers import fresh_blocks

    out = fresh_blocks(nbytes)[:nbytes]
    with open(path, "rb", buffering=0) as handle:
        view = out.data
        while view:
            got = handle.readinto(view[:8 * _MiB])
            if not got:
                break
            view = view[got:]
    return out


def _direct_refused(directory: str) -> str:
    """"" when ``directory`` takes O_DIRECT writes of aligned blocks, else why not."""
    from jaxckpt.storage.buffers import ALIGN, aligned_blocks

    if not hasattr(os, "O_DIRECT"):
        return "no O_DIRECT on this platform"
    path = os.path.join(directory, "probe")
    try:
        _raw_write_direct(path, aligned_blocks(ALIGN))
    except OSError as error:
        return f"the filesystem refuses O_DIRECT ({error.strerror})"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return ""
