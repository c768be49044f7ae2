"""Page-aligned memory for file I/O: what ``O_DIRECT`` transfers into and out of.

Owns: ``ALIGN`` (the alignment of ``O_DIRECT`` buffers, offsets and lengths), reused
aligned buffers (``aligned_blocks``, ``aligned_empty``) and buffers filled once and handed
over (``fresh_blocks``: a restore's arrays, the DCP reader's fetched ranges), which are
memory maps of their own rather than numpy's allocations, so that they do not ask for huge
pages. Used by the Orbax backend's chunk I/O and by ``torch_bridge``'s DCP reader.

Must not import: jax, orbax, torch, torch_bridge.

Concurrency contract: every function returns new memory; safe on any thread.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

__all__ = ["ALIGN", "FRESH_MIN", "aligned_blocks", "aligned_empty", "fresh_blocks"]

#: Alignment of O_DIRECT buffers, offsets and lengths: 4 KiB covers every logical block
#: size in use (512 B and 4 KiB).
ALIGN = 4096
#: Buffers from this size on are memory maps of their own (``fresh_blocks``): numpy
#: asks for huge pages from 4 MiB on.
FRESH_MIN = 4 << 20


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_blocks(nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` rounded up to whole ``ALIGN`` blocks, starting on an
    ``ALIGN`` boundary (what O_DIRECT transfers into)."""
    padded = _padded(max(nbytes, 1))
    raw = np.empty(padded + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + padded]


def fresh_blocks(nbytes: int) -> np.ndarray:
    """``aligned_blocks`` for a buffer that is filled once and handed over (what a restore
    reads into): from ``FRESH_MIN`` bytes on, an anonymous memory map of its own, given
    back to the system when the last array over it goes.

    Why not ``np.empty``: numpy asks for transparent huge pages (``MADV_HUGEPAGE``) on
    every allocation of 4 MiB or more, and where the kernel's THP setting is ``madvise``
    (the usual default) that opts the buffer in to huge pages found or made at fault time,
    which made a cold ``O_DIRECT`` read in a fresh process slower by up to several times on
    the development VM. A map we do not advise gets whatever the system gives by default:
    4 KiB pages there, huge pages without stalls where THP is ``always``. Huge pages are
    cheaper when the memory was freed moments before and dearer once the VM handed it back
    to its host, while 4 KiB pages cost about the same either way: a restarted job meets
    the second case (benchmarks/results/cold-restore-hugepages_cpu2core_2026-11-25.md,
    benchmarks/results/restore-read-floor_cpu2core_2026-11-25.md)."""
    if nbytes < FRESH_MIN:
        return aligned_blocks(nbytes)
    # mmap's memory starts on a page boundary and is whole pages: ALIGN divides both.
    # Private: shared anonymous memory would be shmem, with its own accounting and limits.
    memory = mmap.mmap(-1, _padded(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(memory, np.uint8)


def aligned_empty(shape: tuple[int, ...], dtype: Any, *, fresh: bool = False) -> np.ndarray:
    """An uninitialised array starting on an ``ALIGN`` boundary: staging buffers made
    this way are written with ``O_DIRECT`` straight from their memory (no bounce copy).
    ``fresh``: from ``fresh_blocks`` (a buffer that is filled once and handed over), else
    from ``aligned_blocks`` (a buffer that is reused)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    blocks = fresh_blocks(nbytes) if fresh else aligned_blocks(nbytes)
    return blocks[:nbytes].view(dtype).reshape(shape)


