"""One chunk file of Orbax's zarr3 form written and read with plain file I/O, checksummed.

Owns: ``write_chunk`` (an array's bytes streamed to a new file with ``O_DIRECT`` and made
durable, checksummed from the memory that is written, so that the commit reads nothing
back), ``read_chunk`` (a chunk file read with ``O_DIRECT`` into memory jax adopts without a
copy, checksummed as each piece arrives), ``read_chunk_into`` (the same into memory the
caller's array owns) and ``array_bytes``, where an array's bytes start
(``data_offset``: where its memory lines up with the file's blocks), each I/O thread's
bounce buffer (huge pages where the system gives them), and the fallback to buffered I/O on
filesystems that refuse ``O_DIRECT``. The form of the files is ``zarr_format``'s; why our
own I/O rather than tensorstore's: docs/design.md, "Orbax's files, our I/O".

Must not import: jax, orbax, tensorstore, torch.

Concurrency contract: any thread may write or read; each thread has its own bounce buffer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import mmap
import os
import threading
from collections.abc import Callable

import numpy as np

from jaxckpt.backends.orbax.zarr_format import INDEX_BYTES, shard_index
from jaxckpt.core.checksum import extend
from jaxckpt.errors import CheckpointCorruptError
from jaxckpt.storage import buffers
from jaxckpt.storage.buffers import ALIGN
from jaxckpt.storage.threads import SharedThreads

__all__ = ["PIECE", "ZERO_COPY_MIN", "array_bytes", "data_offset", "read_chunk",
           "check_index", "read_chunk_into", "write_chunk"]

#: Bytes per read or write call, and the size of each thread's bounce buffer.
PIECE = 8 << 20
#: Arrays from this size on may start past the beginning of their chunk file, so that
#: they are written from their own memory (``data_offset``).
ZERO_COPY_MIN = 1 << 20
_HOST_ALIGN = 64  # jax adopts host memory aligned this far without a copy (CPU)

_local = threading.local()
#: Size and alignment of a transparent huge page (x86-64 and arm64 with 4 KiB pages).
_HUGE_PAGE = 2 << 20
#: Bytes copied into the bounce buffer, then checksummed there, at a time: the checksum
#: reads what was just copied while it is still in the CPU's cache.
_COPY_STEP = 1 << 20
#: The first piece of a file copied through the bounce buffer (``_piece_at``).
_FIRST_PIECE = 1 << 20


def _bounce() -> tuple[np.ndarray, bool]:
    """This thread's bounce buffer of two ``PIECE``-byte halves, made once, and whether
    huge pages back it (then arrays in jax's memory are written from it: ``_write_direct``;
    one half is filled while the other is written).

    Private anonymous memory, aligned to a huge page, with huge pages asked for
    (``MADV_HUGEPAGE``): ``O_DIRECT`` hands the device the buffer's pages, and a request
    holds a bounded number of physically contiguous runs (254 on the development VM's
    virtio disk), so 4 KiB pages cut a write into requests of about 400 KiB where huge
    pages make them 1-4 MiB: a third as many requests, and a faster write
    (benchmarks/results/save-write-floor_cpu2core_2026-11-25.md). Python's ``mmap`` maps shared
    memory by default, which never gets huge pages here: hence ``MAP_PRIVATE``."""
    found = getattr(_local, "bounce", None)
    if found is None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        memory = mmap.mmap(-1, 2 * PIECE + _HUGE_PAGE, flags=flags)
        raw = np.frombuffer(memory, np.uint8)
        start = (-raw.ctypes.data) % _HUGE_PAGE
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            with contextlib.suppress(OSError):
                memory.madvise(advice, start, 2 * PIECE)
        buffer = raw[start:start + 2 * PIECE]
        buffer[:] = 0  # faulted in now, so that the kernel's choice of pages can be seen
        found = _local.bounce = (buffer, _huge_pages_at(buffer.ctypes.data))
    return found


def _huge_pages_at(address: int) -> bool:
    """Whether transparent huge pages back the memory mapping that holds ``address``
    (Linux: its ``AnonHugePages`` in ``/proc/self/smaps``); False where that cannot be
    told. Reading smaps is slow in a process using jax: asked once per thread."""
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as smaps:
            inside = False
            for line in smaps:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:  # a mapping's first line: low-high ...
                    low, _, high = head.partition("-")
                    inside = int(low, 16) <= address < int(high, 16)
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) > 0
    except (OSError, ValueError):
        pass
    return False


# Filesystems (st_dev) found to refuse O_DIRECT: asked once, then written buffered.
_no_direct: set[int] = set()


def data_offset(array: np.ndarray, directory: str, *, direct: bool = True) -> int:
    """Where ``array``'s bytes should start in its chunk file in ``directory``.

    ``O_DIRECT`` moves whole blocks between the disk and memory at the same position
    modulo the block size. An array whose address is 64 bytes past a page boundary (where
    jax puts its host buffers) therefore starts 64 bytes into its file: the file's blocks
    then line up with the array's memory and are written from it, without the copy
    through a bounce buffer, and a restore's page-aligned read puts the bytes back at a
    64-byte boundary, which jax still adopts without a copy. Only the first block (the zeros
    and the array's first 4 KiB - offset bytes) is copied, through the bounce buffer; the
    shard index records the offset, so Orbax reads the file as it is; zarr.json records it
    too (``zarr_format.metadata_text``), so that readers that only know offset 0 hand the
    array to Orbax.
    Where the I/O thread's bounce buffer has huge pages, every block is copied through it
    anyway (``_write_direct``); the offset is kept, so that the layout does not depend on
    the memory a save happened to get.

    0 (the layout tensorstore writes, byte for byte) for arrays under ``ZERO_COPY_MIN``
    (the copy costs little there), for memory not aligned to 64 bytes (the restored array
    would not be either), and where ``O_DIRECT`` is off or refused.
    """
    if (not direct or not hasattr(os, "O_DIRECT") or array.nbytes < ZERO_COPY_MIN
            or not array.flags.c_contiguous):
        return 0
    address = array.ctypes.data
    if address % _HOST_ALIGN:
        return 0
    if os.stat(directory).st_dev in _no_direct:
        return 0
    return address % ALIGN


def _open_for_write(path: str, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class _FileImage:
    """The bytes of one chunk file without building them: ``offset`` zeros, the array's
    bytes (``flat``), the shard index (``tail``)."""

    def __init__(self, flat: np.ndarray, offset: int, tail: np.ndarray) -> None:
        self.flat, self.offset, self.tail = flat, offset, tail
        self.end = offset + flat.size  # where the array's bytes end
        self.size = self.end + tail.size

    def fill(self, out: np.ndarray, start: int) -> None:
        """Copy the file's bytes ``[start, start + out.size)``, within the array's part or
        before it, into ``out``."""
        zeros = max(0, min(self.offset - start, out.size))
        out[:zeros] = 0
        first = start + zeros - self.offset
        out[zeros:] = self.flat[first:first + out.size - zeros]

    def piece(self, start: int, stop: int) -> np.ndarray:
        """The file's bytes ``[start, stop)`` as a new array (for the small parts)."""
        out = np.empty(stop - start, np.uint8)
        data_stop = min(stop, self.end)
        if start < data_stop:
            self.fill(out[:data_stop - start], start)
        if stop > self.end:
            out[max(start, self.end) - start:] = self.tail[max(start - self.end, 0):
                                                           stop - self.end]
        return out


def write_chunk(path: str, data: np.ndarray, *, algorithm: str, direct: bool = True,
                offset: int = 0, created: Callable[[], None] | None = None,
                sync_later: Callable[[Callable[[], None]], None] | None = None,
                ) -> tuple[int, str]:
    """Write one array's chunk file (``offset`` zero bytes, the array's bytes, then the
    shard index) to the new file ``path`` and make it durable. ``data`` is the array (any
    alignment; C-contiguous); ``offset`` comes from ``data_offset`` (0: tensorstore's
    layout) and must be the one given to ``zarr_format.metadata_text``. ``created``: called
    each time the file is created, before its bytes are written (twice where the first
    ``O_DIRECT`` write is refused and the file is made again), so that the caller can make
    its name durable while the bytes go out.
    ``sync_later``: where given, the file's fsync (and the closing of its descriptor) is
    handed to it as a function to run on another thread, and this returns once the bytes
    are written: the caller then counts the file durable only once that function returned
    (``sync_later`` must run it, or raise without having taken it).

    Returns (file size, checksum of the whole file with ``algorithm``), computed from the
    bytes as they were handed to the kernel.
    """
    if not 0 <= offset < ALIGN:
        raise ValueError(f"offset {offset} is outside 0..{ALIGN - 1}")
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    image = _FileImage(flat, offset, np.frombuffer(shard_index(flat.size, offset), np.uint8))
    dev = os.stat(os.path.dirname(path) or ".").st_dev
    fd, is_direct = _open_for_write(path, direct and dev not in _no_direct)
    try:
        if created is not None:
            created()
        if is_direct:
            try:
                crc = _write_direct(fd, image, algorithm)
            except _DirectRefused:
                # Opened, but the first write was refused (alignment rules stricter than
                # ours): this filesystem gets buffered writes from now on. A failure later
                # in the file (a full disk, a size limit) is an error like any other.
                _no_direct.add(dev)
                os.close(fd)
                fd = -1
                os.unlink(path)
                fd, is_direct = _open_for_write(path, False)
                if created is not None:
                    created()
                crc = _write_buffered(fd, image, algorithm)
        else:
            if direct:
                _no_direct.add(dev)
            crc = _write_buffered(fd, image, algorithm)
        if sync_later is None:
            os.fsync(fd)
        else:
            sync_later(functools.partial(_sync_and_close, fd))
            fd = -1  # the function handed over closes it
    finally:
        if fd >= 0:
            os.close(fd)
    return image.size, crc


def _sync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: The threads that checksum a piece of an array while an I/O thread writes it (one per
#: I/O thread of the backend's default; a piece waits for none but its own).
_checksummer = SharedThreads(4, "jaxckpt-crc")


class _DirectRefused(Exception):
    """The first O_DIRECT write of a file failed with EINVAL."""


def _write_direct(fd: int, image: _FileImage, algorithm: str) -> str:
    """The file's whole blocks with O_DIRECT; what is left through the page cache on the
    same descriptor, flushed by the caller's fsync: the last partial block and the shard
    index (under 4 KiB + 20 bytes).

    Where huge pages back this thread's bounce buffer (``_bounce``), every piece of an
    array at a nonzero offset (jax's memory) is copied into it and written from it
    (``_write_bounced``): the device then gets a few large requests where the array's own
    4 KiB pages made three times as many small ones, which is slower by more than the copy
    costs. Otherwise the blocks come straight from the array's memory when it lines up
    with the file (``data_offset``; ``_write_own_memory``), and an array that does not is
    copied through the bounce buffer too. Checksums are taken in file order from the
    memory that is written, on another thread while the device writes the piece before.

    Padding the last block and truncating the file afterwards costs more: shrinking to
    a size inside a block makes the filesystem zero the rest of that block in the page
    cache, one more write and journal update per file."""
    flat, offset = image.flat, image.offset
    whole = image.end - image.end % ALIGN
    bounce, huge = _bounce()
    aligned = (flat.ctypes.data - offset) % ALIGN == 0
    # A page-aligned array at offset 0 is one of our own buffers (staging, packs:
    # ``aligned_empty``, which numpy backs with huge pages from 4 MiB on): written from its
    # own memory, as a copy would gain no larger requests: copying packs through the huge
    # bounce made their save slower (benchmarks/results/save-write-floor_cpu2core_2026-11-25.md).
    # jax's arrays sit at a nonzero offset (``data_offset``) in 4 KiB pages: those gain
    # from the copy, unless the copy fell behind the device in this thread's last file
    # (``_write_bounced``): then this one goes without it, and the next tries again.
    lagged = getattr(_local, "copy_lagged", False)
    _local.copy_lagged = False
    if aligned and (not huge or offset == 0 or lagged):
        crc = _write_own_memory(fd, image, algorithm, whole, bounce)
    else:
        crc = _write_bounced(fd, image, algorithm, whole, bounce)
    rest = image.piece(whole, image.size)
    crc = extend(algorithm, crc, rest)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    _pwrite_all(fd, rest.data, whole)
    return f"{crc:08x}"


def _pwrite_direct(fd: int, memory: np.ndarray, position: int) -> None:
    """One O_DIRECT write; EINVAL on a file's first one means the filesystem refuses it."""
    try:
        _pwrite_all(fd, memory.data, position)
    except OSError as error:
        if position == 0 and error.errno == errno.EINVAL:
            raise _DirectRefused() from error
        raise


def _write_own_memory(fd: int, image: _FileImage, algorithm: str, whole: int,
                      bounce: np.ndarray, position: int = 0, crc: int = 0) -> int:
    """The whole blocks ``[position, whole)`` written from the array's own memory, each
    piece checksummed on another thread during its write (the array does not change under
    it; benchmarks/results/cold-restore-hugepages_cpu2core_2026-11-25.md, item 12), ``crc``
    being the checksum of the bytes before ``position``. From 0 with a nonzero offset, the
    first block (the zeros and the array's first bytes) is put together in ``bounce`` and
    written with O_DIRECT too: through the page cache it cost a copy, a dirty page for the
    fsync to write back, and 4 KiB of the array in the cache, per file. Returns the
    checksum so far."""
    flat, offset = image.flat, image.offset
    if position == 0 and offset and whole:
        head = bounce[:min(ALIGN, whole)]
        image.fill(head, 0)
        crc = extend(algorithm, crc, head)
        _pwrite_direct(fd, head, 0)
        position = head.size
    while position < whole:
        count = min(PIECE, whole - position)
        memory = flat[position - offset:position - offset + count]
        pending = _checksummer.get().submit(extend, algorithm, crc, memory)
        try:
            _pwrite_direct(fd, memory, position)
        finally:
            crc = pending.result()
        position += count
    return crc


def _piece_at(position: int, whole: int) -> int:
    """The size of the bounced piece that starts at ``position`` of a file whose whole
    blocks end at ``whole``: ``_FIRST_PIECE`` at the start, then as large as all the
    pieces before it together, up to ``PIECE``. The first write of a file waits for its
    piece's copy and checksum, the device meanwhile idle where the other I/O threads are
    between files too (all start their files together); each later piece is copied while
    one half its size or more is written, which takes the device longer."""
    return min(PIECE, max(_FIRST_PIECE, position), whole - position)


def _write_bounced(fd: int, image: _FileImage, algorithm: str, whole: int,
                   bounce: np.ndarray) -> int:
    """The whole blocks ``[0, whole)`` copied through the two halves of ``bounce``: while
    one half is written, the next piece is copied into the other, a megabyte at a time,
    and checksummed there while in the CPU's cache, on a checksum thread; copy and
    checksum overlap the device instead of following each write. Where the copy falls
    behind the device (other processes have the CPUs) and the array's memory lines up
    with the file, the rest of the file is written from that memory (``_write_own_memory``):
    smaller requests, but no copy to wait for
    (benchmarks/results/save-floor-breakdown_cpu2core_2026-11-28.md); that is judged on
    writes of a whole ``PIECE`` only, since the small first pieces (``_piece_at``) may
    well be written sooner than the next is copied. Returns the checksum so far."""
    halves = (bounce[:PIECE], bounce[PIECE:2 * PIECE])
    own = (image.flat.ctypes.data - image.offset) % ALIGN == 0

    def prepare(position: int, half: int, crc: int) -> int:
        memory = halves[half][:_piece_at(position, whole)]
        for step in range(0, memory.size, _COPY_STEP):
            part = memory[step:step + _COPY_STEP]
            image.fill(part, position + step)
            crc = extend(algorithm, crc, part)
        return crc

    crc = prepare(0, 0, 0) if whole else 0
    position, half, copying = 0, 0, True
    while position < whole:
        count = _piece_at(position, whole)
        after = position + count
        ahead = (_checksummer.get().submit(prepare, after, 1 - half, crc)
                 if copying and after < whole else None)
        try:
            _pwrite_direct(fd, halves[half][:count], position)
        except BaseException:
            if ahead is not None and not ahead.cancel():  # never left filling this buffer
                concurrent.futures.wait([ahead])
            raise
        if ahead is None:  # the end, or the rest goes from the array's memory
            position = after
            break
        if own and count == PIECE and not ahead.done():  # the copy fell behind
            _local.copy_lagged = True
            if ahead.cancel():  # not even started
                return _write_own_memory(fd, image, algorithm, whole, bounce, after, crc)
            copying = False  # the piece it copies is written next, then the array's memory
        crc = ahead.result()
        position, half = after, 1 - half
    if position < whole:
        crc = _write_own_memory(fd, image, algorithm, whole, bounce, position, crc)
    return crc


def _write_buffered(fd: int, image: _FileImage, algorithm: str) -> str:
    head = np.zeros(image.offset, np.uint8)
    crc = extend(algorithm, 0, head)
    _pwrite_all(fd, head.data, 0)
    flat = image.flat
    for start in range(0, flat.size, PIECE):
        piece = flat[start:start + PIECE]
        crc = extend(algorithm, crc, piece)  # numpy: checksummed without the GIL
        _pwrite_all(fd, piece.data, image.offset + start)
    crc = extend(algorithm, crc, image.tail)
    _pwrite_all(fd, image.tail.data, image.end)
    return f"{crc:08x}"


# ------------------------------------------------------------------------------- reading

def _open_for_read(path: str, direct: bool) -> tuple[int, bool, int]:
    """(descriptor, whether it is ``O_DIRECT``, the filesystem's st_dev) of ``path``."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    dev = os.stat(os.path.dirname(path) or ".").st_dev
    if direct and hasattr(os, "O_DIRECT") and dev not in _no_direct:
        try:
            return os.open(path, flags | os.O_DIRECT), True, dev
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            _no_direct.add(dev)
    return os.open(path, flags), False, dev


def _check_size(path: str, fd: int, nbytes: int, offset: int) -> int:
    size = os.fstat(fd).st_size
    if size != offset + nbytes + INDEX_BYTES:
        raise CheckpointCorruptError(
            f"{path} has {size} bytes; an array of {nbytes} bytes at offset {offset} is "
            f"stored in {offset + nbytes + INDEX_BYTES}. The checkpoint is damaged; "
            "restore another one.")
    return size


def read_chunk(path: str, nbytes: int, *, algorithm: str | None, direct: bool = True,
               offset: int = 0) -> tuple[np.ndarray, str | None]:
    """Read the chunk file at ``path`` of an array of ``nbytes`` bytes starting at
    ``offset`` (from its zarr.json: ``zarr_format.parse_metadata``).

    Returns (the whole file in an ``ALIGN``-aligned uint8 array, its checksum with
    ``algorithm`` or None); ``array_bytes`` then checks the shard index and gives the
    array's bytes. Raises CheckpointCorruptError when the file's size is not that of an
    ``nbytes`` array in this module's layout.
    """
    fd, is_direct, dev = _open_for_read(path, direct)
    try:
        size = _check_size(path, fd, nbytes, offset)
        buffer = buffers.fresh_blocks(size)  # the array's memory once jax adopts it: no copy
        crc = 0
        if hasattr(os, "posix_fadvise") and not is_direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        offset = 0
        while offset < size:
            piece = buffer[offset:offset + PIECE]
            try:
                got = os.preadv(fd, [piece.data], offset)
            except OSError as error:
                if not is_direct or error.errno != errno.EINVAL:
                    raise
                _no_direct.add(dev)  # refused after all: read the rest through the cache
                os.close(fd)
                fd, is_direct, _ = _open_for_read(path, False)
                continue
            if got <= 0:
                raise CheckpointCorruptError(f"{path} ended at byte {offset} of {size} while "
                                             "being read. Restore another checkpoint.")
            if algorithm is not None:
                crc = extend(algorithm, crc, piece[:min(got, size - offset)])
            offset += got
    finally:
        os.close(fd)
    return buffer[:size], (f"{crc:08x}" if algorithm is not None else None)


def read_chunk_into(path: str, out: np.ndarray, *, algorithm: str | None,
                    direct: bool = True, offset: int = 0) -> tuple[np.ndarray, str | None]:
    """Read the chunk file at ``path`` of an array of ``out.size`` bytes starting at
    ``offset`` (as ``read_chunk``), putting the array's bytes into ``out`` (a writable,
    C-contiguous uint8 array: memory the caller's array owns). Returns (the file's shard
    index as read, the whole file's checksum with ``algorithm`` or None); ``check_index``
    then checks the index (after the checksum was handed on, as with ``read_chunk``).

    With ``O_DIRECT``, where ``out`` lines up with the file's blocks (``out``'s address
    minus ``offset`` on an ``ALIGN`` boundary: jax's host buffers and ``data_offset``'s
    layout), the array's whole blocks go straight into ``out`` and only the first and the
    last block pass through this thread's scratch buffer; otherwise every block does
    (one copy). Buffered reads land the array's bytes in ``out`` directly.
    Raises CheckpointCorruptError as ``read_chunk`` does.
    """
    nbytes = out.size
    fd, is_direct, dev = _open_for_read(path, direct)
    try:
        size = _check_size(path, fd, nbytes, offset)
        try:
            crc, tail = _read_parts(fd, path, out, size, offset, algorithm, is_direct)
        except _DirectRefused:  # opened, but the reads refused: buffered, from the start
            _no_direct.add(dev)
            os.close(fd)
            fd, is_direct, _ = _open_for_read(path, False)
            crc, tail = _read_parts(fd, path, out, size, offset, algorithm, is_direct)
    finally:
        os.close(fd)
    return tail, (f"{crc:08x}" if algorithm is not None else None)


def _read_scratch() -> np.ndarray:
    """This thread's ``PIECE``-byte buffer for the blocks of a file read with ``O_DIRECT``
    that do not land in the array's memory: a map of its own, faulted in as far as used."""
    found = getattr(_local, "read_scratch", None)
    if found is None:
        found = _local.read_scratch = buffers.fresh_blocks(PIECE)
    return found


def _read_parts(fd: int, path: str, out: np.ndarray, size: int, offset: int,
                algorithm: str | None, is_direct: bool) -> tuple[int, np.ndarray]:
    """The file's bytes in order: the array's into ``out`` (straight, or through the
    scratch buffer), the shard index into the returned array; and the checksum of all."""
    end = offset + out.size
    if not is_direct:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        parts = [(0, offset, False), (offset, end, True), (end, size, False)]
    else:
        first = -(-offset // ALIGN) * ALIGN
        whole = end - end % ALIGN
        if (out.ctypes.data - offset) % ALIGN or first >= whole:
            parts = [(0, size, False)]
        else:
            parts = [(0, first, False), (first, whole, True), (whole, size, False)]
    tail = np.empty(size - end, np.uint8)
    crc = 0
    for start, stop, straight in parts:
        for position in range(start, stop, PIECE):
            count = min(PIECE, stop - position)
            if straight:
                memory = out[position - offset:position - offset + count]
                _pread_full(fd, path, memory, position, size, is_direct)
            else:
                scratch = _read_scratch()
                length = -(-count // ALIGN) * ALIGN if is_direct else count
                _pread_full(fd, path, scratch[:length], position, size, is_direct, count)
                memory = scratch[:count]
                low, high = max(position, offset), min(position + count, end)
                if low < high:
                    out[low - offset:high - offset] = memory[low - position:high - position]
                low = max(position, end)
                if low < position + count:
                    tail[low - end:position + count - end] = memory[low - position:]
            if algorithm is not None:
                crc = extend(algorithm, crc, memory)
    return crc, tail


def _pread_full(fd: int, path: str, memory: np.ndarray, position: int, size: int,
                is_direct: bool, needed: int | None = None) -> None:
    """Fill ``memory`` from the file at ``position`` (at least ``needed`` bytes of it,
    where the read runs past the end of the file: an ``O_DIRECT`` read of the last block)."""
    needed = memory.size if needed is None else needed
    done = 0
    while done < needed:
        try:
            got = os.preadv(fd, [memory[done:].data], position + done)
        except OSError as error:
            if is_direct and error.errno == errno.EINVAL:
                raise _DirectRefused() from error
            raise
        if got <= 0:
            raise CheckpointCorruptError(f"{path} ended at byte {position + done} of {size} "
                                         "while being read. Restore another checkpoint.")
        done += got


def check_index(path: str, tail: np.ndarray, nbytes: int, offset: int) -> None:
    """CheckpointCorruptError unless ``tail`` (the end of the chunk file ``path``) is the
    shard index of one chunk of ``nbytes`` bytes at ``offset``."""
    if bytes(tail) != shard_index(nbytes, offset):
        raise CheckpointCorruptError(
            f"{path}: its shard index does not describe one chunk of {nbytes} bytes at "
            f"offset {offset} (damaged, or not written in the layout its zarr.json names). "
            "Restore another checkpoint.")


def array_bytes(path: str, content: np.ndarray, nbytes: int, offset: int = 0) -> np.ndarray:
    """The array's bytes in the chunk file ``content`` read from ``path``, after checking
    that its shard index describes them (CheckpointCorruptError otherwise)."""
    check_index(path, content[offset + nbytes:], nbytes, offset)
    return content[offset:offset + nbytes]
