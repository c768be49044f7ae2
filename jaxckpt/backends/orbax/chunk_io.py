"""Orbax's single-chunk zarr3 arrays, written and read with plain file I/O.

Owns: the on-disk form of one array as Orbax's ``PyTreeCheckpointHandler`` stores it with
zarr3, OCDBT off and no compression, and the PyTree metadata files around those arrays; a
writer that streams an array's bytes to disk with ``O_DIRECT`` and checksums them on the
way; a reader that reads them back the same way into page-aligned buffers and checksums
them on the way.

The form (what tensorstore writes for Orbax; ``tests/integration/test_zarr_io.py`` compares it byte
for byte with files Orbax wrote, and has Orbax read what this module wrote, offsets
included)::

    {name}/zarr.json            shape, dtype, a regular grid of ONE chunk (the whole array),
                                the "sharding_indexed" codec holding one inner chunk in
                                little-endian "bytes"; compact JSON, keys sorted
    {name}/c/0/.../0            the array's raw little-endian bytes in C order, then the
                                shard index: offset (u64, 0 but see below), length (u64 =
                                nbytes), and the crc32c of those 16 bytes (u32); one "0"
                                per dimension, and just "c" for a 0-d array
    _METADATA                   Orbax's tree metadata: every name, as a numpy array
    _CHECKPOINT_METADATA        Orbax's step metadata: handler, timestamps
    commit_success.txt          Orbax's marker of a finished write

One departure, for arrays of ``ZERO_COPY_MIN`` bytes or more (``data_offset``): the bytes
may start up to 4 KiB into the chunk file, after zeros, where the array's memory lines up
with the file's blocks. The shard index's offset says where they start (tensorstore, hence
Orbax, reads such a file as it is: a sharded zarr3 file may hold its chunks anywhere), and
zarr.json carries ``"attributes": {"jaxckpt": {"chunk_offset": N}}``, so that a reader that
knows only offset 0, an older jaxckpt included, sees a layout it does not know and lets
Orbax read the array. Everything else is byte for byte what tensorstore writes.

Why not tensorstore for these: Orbax + tensorstore spent several times the CPU of a
plain buffered write of the same bytes a save, and the commit then read every file back
to checksum it (benchmarks/results/save-restore-round2_cpu2core_2026-11-22.md).
Here the bytes go to disk with ``O_DIRECT``: the device copies from our memory, so
nothing is copied into the page cache, and the bytes are checksummed
(crc32c) from the memory that is written, so the commit does not read them again. Each
I/O thread has one reused bounce buffer backed by huge pages where the system gives them;
then every piece of an array in jax's host memory is copied through it and written from
it, because the device takes a write from huge pages in a third as many requests as one
from the array's own 4 KiB pages, and that is faster than the copy costs (our own
staging and pack buffers, page-aligned at offset 0 and already in huge pages, are written
from their own memory). Without huge pages, where the
array's memory and its file's blocks line up (the offset above; our own staging buffers,
page-aligned, at offset 0) the blocks are written from the array itself; where they do
not (jax's host buffers are only 64-byte aligned, ``O_DIRECT`` wants 512 or 4096) each
piece is copied through the bounce buffer first. ``O_DIRECT`` also
keeps gigabytes of checkpoint out of the page cache, where they would push out the
training data's pages. Filesystems that refuse ``O_DIRECT`` (tmpfs, some network and FUSE
filesystems) get plain buffered writes, checksummed from the source the same way.

Reading mirrors it: ``O_DIRECT`` reads into 4 KiB-aligned buffers (jax adopts the array's
bytes there without a copy on CPU: they sit at the offset, a multiple of 64) with the
checksum computed as each piece arrives, on the reading thread, so a restore needs no
separate verification pass over the same bytes. The buffers are memory maps of their own
(``fresh_blocks``), not numpy's allocations, which ask for huge pages: faulting in fresh
huge pages made restores 1.5-4x slower than the read on the development VM.

Arrays sharded over several processes are stored as Orbax stores them: a regular grid of
chunks of the shard shape (``chunk_shape`` in both places of zarr.json), one file per
chunk at ``c/i/j/...`` (its grid position), each holding one inner chunk at offset 0 and
its shard index; each process writes the chunks it owns (``chunk_grid``, ``parse_grid``).

Anything this module does not write the same way (other codecs, compression, uneven
grids, sub-byte or big-endian dtypes, zero-size arrays) is left to Orbax: ``supported``,
``parse_metadata`` and ``parse_grid`` say which.

Must not import: jax, orbax, tensorstore, torch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import itertools
import json
import mmap
import os
import struct
import sys
import threading
from typing import Any

import ml_dtypes  # noqa: F401 - registers bfloat16 / float8 with numpy
import numpy as np

from jaxckpt.core.checksum import extend
from jaxckpt.errors import CheckpointCorruptError
from jaxckpt.storage import buffers
from jaxckpt.storage.buffers import ALIGN

__all__ = [
    "SUPPORTED_DTYPES",
    "ZERO_COPY_MIN",
    "array_bytes",
    "chunk_grid",
    "chunk_relpath",
    "data_offset",
    "metadata_text",
    "parse_grid",
    "parse_metadata",
    "INDEX_BYTES",
    "read_chunk",
    "shard_index",
    "supported",
    "tree_metadata_text",
    "checkpoint_metadata_text",
    "commit_success_text",
    "write_chunk",
]

#: Bytes per read or write call, and the size of each thread's bounce buffer.
PIECE = 8 << 20
#: Arrays from this size on may start past the beginning of their chunk file, so that
#: they are written from their own memory (``data_offset``).
ZERO_COPY_MIN = 1 << 20
_HOST_ALIGN = 64  # jax adopts host memory aligned this far without a copy (CPU)
_ATTRIBUTE = "jaxckpt"  # our key in zarr.json's attributes
#: Bytes of the shard index after the data: offset u64, length u64, crc32c u32.
INDEX_BYTES = 20

#: dtypes stored one element per ``itemsize`` bytes, as numpy holds them, that Orbax's
#: tensorstore writes with exactly this layout (checked by tests/integration/test_zarr_io.py).
#: Sub-byte types (int4, float4) and anything else go through Orbax.
SUPPORTED_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "bfloat16", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2",
})

_ORBAX_HANDLER = ("orbax.checkpoint._src.handlers.pytree_checkpoint_handler."
                  "PyTreeCheckpointHandler")


def supported(array: np.ndarray) -> bool:
    """Whether this module writes ``array`` (else the whole write goes through Orbax)."""
    dtype = array.dtype
    return (dtype.name in SUPPORTED_DTYPES and array.size > 0
            and dtype.byteorder in "=|<" and sys.byteorder == "little")


def chunk_relpath(ndim: int, index: tuple[int, ...] | None = None) -> str:
    """Path of the chunk file at grid position ``index`` (default: the one chunk of a
    single-chunk array) of an array of ``ndim`` dimensions, below its directory: zarr3's
    default chunk key encoding, "c" then one component per dimension."""
    return "/".join(["c"] + [str(i) for i in (index if index is not None else (0,) * ndim)])


def chunk_grid(shape: tuple[int, ...],
               chunk_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """Every chunk of an array of ``shape`` cut into ``chunk_shape`` (which divides it):
    its grid position and the slices of the array it holds, in C order."""
    counts = [size // chunk for size, chunk in zip(shape, chunk_shape, strict=True)]
    return [(index, tuple(slice(i * chunk, (i + 1) * chunk)
                          for i, chunk in zip(index, chunk_shape, strict=True)))
            for index in itertools.product(*(range(count) for count in counts))]


def _fill_value(dtype_name: str) -> Any:
    if dtype_name == "bool":
        return False
    if dtype_name.startswith("complex"):
        return [0.0, 0.0]
    if dtype_name.startswith(("int", "uint")):
        return 0
    return 0.0


def _metadata(shape: tuple[int, ...], dtype_name: str,
              chunk_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    chunk = list(shape if chunk_shape is None else chunk_shape)
    inner: dict[str, Any] = {"name": "bytes"}
    if np.dtype(dtype_name).itemsize > 1:  # one-byte types carry no endianness
        inner["configuration"] = {"endian": "little"}
    return {
        "chunk_grid": {"configuration": {"chunk_shape": chunk}, "name": "regular"},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"configuration": {
            "chunk_shape": chunk,
            "codecs": [inner],
            "index_codecs": [{"configuration": {"endian": "little"}, "name": "bytes"},
                             {"name": "crc32c"}]},
            "name": "sharding_indexed"}],
        "data_type": dtype_name,
        "fill_value": _fill_value(dtype_name),
        "node_type": "array",
        "shape": list(shape),
        "zarr_format": 3,
    }


def metadata_text(shape: tuple[int, ...], dtype_name: str, offset: int = 0,
                  chunk_shape: tuple[int, ...] | None = None) -> str:
    """The ``zarr.json`` of one array, as tensorstore writes it (sorted keys, compact);
    with ``offset`` (where the bytes start in the chunk file, see ``data_offset``) also
    the attribute that records it. ``chunk_shape``: a grid of chunks of that shape (one
    file each, every one at offset 0: several processes write them), else one chunk."""
    if chunk_shape is not None and tuple(chunk_shape) != tuple(shape) and offset:
        raise ValueError("a data offset is recorded only for single-chunk arrays")
    document = _metadata(shape, dtype_name, chunk_shape)
    if offset:
        document["attributes"] = {_ATTRIBUTE: {"chunk_offset": offset}}
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def parse_metadata(text: bytes | str) -> tuple[tuple[int, ...], np.dtype, int] | None:
    """Shape, dtype and data offset of a single-chunk ``zarr.json`` in exactly a form this
    module writes, or None when it is anything else (then Orbax reads that array)."""
    parsed = parse_grid(text)
    if parsed is None or parsed[3] != parsed[0]:
        return None
    return parsed[:3]


def parse_grid(text: bytes | str) -> tuple[tuple[int, ...], np.dtype, int,
                                           tuple[int, ...]] | None:
    """Shape, dtype, data offset and chunk shape of a ``zarr.json`` in exactly a form this
    module writes (one chunk, or a regular grid of chunks that divides the shape, each a
    file holding one inner chunk at offset 0: what Orbax writes for a sharded array), or
    None when it is anything else (then Orbax reads that array)."""
    try:
        found = json.loads(text)
        shape = tuple(int(n) for n in found["shape"])
        chunk_shape = tuple(int(n) for n in found["chunk_grid"]["configuration"]["chunk_shape"])
        name = found["data_type"]
        offset = 0
        attributes = found.pop("attributes", None)
        if attributes is not None:  # only ours, and only the one key
            if set(attributes) != {_ATTRIBUTE} or set(attributes[_ATTRIBUTE]) != {"chunk_offset"}:
                return None
            offset = attributes[_ATTRIBUTE]["chunk_offset"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if (name not in SUPPORTED_DTYPES or len(chunk_shape) != len(shape)
            or found != _metadata(shape, name, chunk_shape) or 0 in shape
            or 0 in chunk_shape or any(s % c for s, c in zip(shape, chunk_shape, strict=True))
            or type(offset) is not int or not 0 <= offset < ALIGN
            or (offset and chunk_shape != shape)):
        return None
    return shape, np.dtype(name), offset, chunk_shape


def _crc32c(data: bytes) -> int:
    return extend("crc32c", 0, data)


def shard_index(nbytes: int, offset: int = 0) -> bytes:
    """The shard index that ends a chunk file: where its one chunk starts and its length."""
    head = struct.pack("<QQ", offset, nbytes)
    return head + struct.pack("<I", _crc32c(head))


def tree_metadata_text(names: list[str]) -> str:
    """Orbax's ``_METADATA`` for a flat dict of numpy arrays named ``names``."""
    tree = {f"('{name}',)": {"key_metadata": [{"key": name, "key_type": 2}],
                             "value_metadata": {"value_type": "np.ndarray",
                                                "skip_deserialize": False}}
            for name in sorted(names)}
    return json.dumps({"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": True,
                       "store_array_data_equal_to_fill_value": True, "custom_metadata": None})


def checkpoint_metadata_text(init_ns: int, commit_ns: int) -> str:
    """Orbax's ``_CHECKPOINT_METADATA`` of a PyTreeCheckpointHandler checkpoint."""
    return json.dumps({"item_handlers": _ORBAX_HANDLER, "metrics": {},
                       "performance_metrics": {}, "init_timestamp_nsecs": init_ns,
                       "commit_timestamp_nsecs": commit_ns, "custom_metadata": {}})


def commit_success_text(directory: str) -> str:
    return f"Checkpoint commit was successful to {directory}"


_local = threading.local()
#: Size and alignment of a transparent huge page (x86-64 and arm64 with 4 KiB pages).
_HUGE_PAGE = 2 << 20
#: Bytes copied into the bounce buffer, then checksummed there, at a time: the checksum
#: reads what was just copied while it is still in the CPU's cache.
_COPY_STEP = 1 << 20


def _bounce() -> tuple[np.ndarray, bool]:
    """This thread's bounce buffer of ``PIECE`` bytes, made once, and whether huge pages
    back it (then arrays in jax's memory are written from it: ``_write_direct``).

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
        memory = mmap.mmap(-1, PIECE + _HUGE_PAGE, flags=flags)
        raw = np.frombuffer(memory, np.uint8)
        start = (-raw.ctypes.data) % _HUGE_PAGE
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            with contextlib.suppress(OSError):
                memory.madvise(advice, start, PIECE)
        buffer = raw[start:start + PIECE]
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
    shard index records
    the offset, so Orbax reads the file as it is; zarr.json records it too
    (``metadata_text``), so that readers that only know offset 0 hand the array to Orbax.
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
                offset: int = 0) -> tuple[int, str]:
    """Write one array's chunk file (``offset`` zero bytes, the array's bytes, then the
    shard index) to the new file ``path`` and make it durable. ``data`` is the array (any
    alignment; C-contiguous); ``offset`` comes from ``data_offset`` (0: tensorstore's
    layout) and must be the one given to ``metadata_text``.

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
                crc = _write_buffered(fd, image, algorithm)
        else:
            if direct:
                _no_direct.add(dev)
            crc = _write_buffered(fd, image, algorithm)
        os.fsync(fd)
    finally:
        if fd >= 0:
            os.close(fd)
    return image.size, crc


_checksum_pool: concurrent.futures.ThreadPoolExecutor | None = None
_checksum_pool_lock = threading.Lock()


def _checksummer() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that checksum a piece of an array while an I/O thread writes it (one
    per I/O thread of the backend's default; a piece waits for none but its own)."""
    global _checksum_pool
    with _checksum_pool_lock:
        if _checksum_pool is None:
            _checksum_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="jaxckpt-crc")
        return _checksum_pool


def _forget_checksummer() -> None:
    """In a forked child: the parent's threads are not there; start new ones on demand."""
    global _checksum_pool, _checksum_pool_lock
    _checksum_pool, _checksum_pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_checksummer)


class _DirectRefused(Exception):
    """The first O_DIRECT write of a file failed with EINVAL."""


def _write_direct(fd: int, image: _FileImage, algorithm: str) -> str:
    """The file's whole blocks with O_DIRECT; what is left through the page cache on the
    same descriptor, flushed by the caller's fsync: the last partial block and the shard
    index (under 4 KiB + 20 bytes).

    Where huge pages back this thread's bounce buffer (``_bounce``), every piece of an
    array at a nonzero offset (jax's memory) is copied into it, a megabyte at a time,
    checksummed there while in the CPU's cache, and written from it: the device then gets
    a few large requests where the array's own 4 KiB pages made three times as many small
    ones, which is slower by more than the copy costs. Otherwise the blocks come
    straight from the array's memory when it lines up with the
    file (``data_offset``), and each piece of an array that does not is copied into the
    bounce buffer first. With a nonzero offset, the first block (the zeros and the
    array's first bytes) is put together in the bounce buffer and written with O_DIRECT
    too: through the page cache it cost a copy, a dirty page for the fsync to write back,
    and 4 KiB of the array in the cache, per file. Checksums are taken in file order from
    the memory that is written; a piece written from the array's own memory is
    checksummed on another thread during its write, so that the checksum's CPU overlaps
    the disk (benchmarks/results/cold-restore-hugepages_cpu2core_2026-11-25.md, item 12).

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
    # from the copy.
    zero_copy = aligned and (not huge or offset == 0)
    # With zero copy, the block holding the leading zeros cannot come from the array:
    # it goes through the bounce buffer, the rest from the array's memory.
    head = min(ALIGN, whole) if zero_copy and offset else 0
    crc = 0
    position = 0
    source: np.ndarray | None  # None: written from the array's own memory
    while position < whole:
        if position < head:
            count, source = head, bounce
        else:
            count = min(PIECE, whole - position)
            source = None if zero_copy else bounce
        pending = None
        if source is None:
            memory = flat[position - offset:position - offset + count]
            # The array's own memory does not change under the write: its checksum runs
            # on another thread while the device reads it.
            pending = _checksummer().submit(extend, algorithm, crc, memory)
        else:
            memory = source[:count]
            for step in range(0, count, _COPY_STEP):
                part = memory[step:step + _COPY_STEP]
                image.fill(part, position + step)
                crc = extend(algorithm, crc, part)
        try:
            _pwrite_all(fd, memory.data, position)
        except OSError as error:
            if position == 0 and error.errno == errno.EINVAL:
                raise _DirectRefused() from error
            raise
        if pending is not None:
            crc = pending.result()
        position += count
    rest = image.piece(whole, image.size)
    crc = extend(algorithm, crc, rest)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    _pwrite_all(fd, rest.data, whole)
    return f"{crc:08x}"


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

def read_chunk(path: str, nbytes: int, *, algorithm: str | None, direct: bool = True,
               offset: int = 0) -> tuple[np.ndarray, str | None]:
    """Read the chunk file at ``path`` of an array of ``nbytes`` bytes starting at
    ``offset`` (from its zarr.json: ``parse_metadata``).

    Returns (the whole file in an ``ALIGN``-aligned uint8 array, its checksum with
    ``algorithm`` or None); ``array_bytes`` then checks the shard index and gives the
    array's bytes. Raises CheckpointCorruptError when the file's size is not that of an
    ``nbytes`` array in this module's layout.
    """
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    dev = os.stat(os.path.dirname(path) or ".").st_dev
    fd = -1
    if direct and hasattr(os, "O_DIRECT") and dev not in _no_direct:
        try:
            fd = os.open(path, flags | os.O_DIRECT)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            _no_direct.add(dev)
    is_direct = fd >= 0
    if fd < 0:
        fd = os.open(path, flags)
    try:
        size = os.fstat(fd).st_size
        if size != offset + nbytes + INDEX_BYTES:
            raise CheckpointCorruptError(
                f"{path} has {size} bytes; an array of {nbytes} bytes at offset {offset} is "
                f"stored in {offset + nbytes + INDEX_BYTES}. The checkpoint is damaged; "
                "restore another one.")
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
                fd = os.open(path, flags)
                is_direct = False
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


def array_bytes(path: str, content: np.ndarray, nbytes: int, offset: int = 0) -> np.ndarray:
    """The array's bytes in the chunk file ``content`` read from ``path``, after checking
    that its shard index describes them (CheckpointCorruptError otherwise)."""
    if bytes(content[offset + nbytes:]) != shard_index(nbytes, offset):
        raise CheckpointCorruptError(
            f"{path}: its shard index does not describe one chunk of {nbytes} bytes at "
            f"offset {offset} (damaged, or not written in the layout its zarr.json names). "
            "Restore another checkpoint.")
    return content[offset:offset + nbytes]
