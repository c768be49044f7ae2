"""The settings of an OrbaxBackend, validated once.

Owns: :class:`OrbaxOptions` (one field per keyword argument of ``OrbaxBackend(...)``, with
its meaning and the measurement behind its default) and the pack size defaults.

Must not import: jax, orbax, torch (settings only).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OrbaxOptions", "DEFAULT_PACK_LEAF_BYTES", "DEFAULT_PACK_BYTES"]

#: Leaves of at most this many bytes are packed (see ``_orbax_plan``). Orbax's overhead per
#: leaf is worth several MiB of host copy, so packing wins for every leaf below a few MiB;
#: 1 MiB keeps the extra host copy small for real models, whose bytes are in large leaves.
DEFAULT_PACK_LEAF_BYTES = 1 << 20
#: Upper size of one pack array: several packs are written and read in parallel, and a
#: restore never needs one huge contiguous buffer. Sizes from 16 to 64 MiB measured alike
#: at 1 GiB; 8 MiB because at small states larger packs are fewer than the read threads and
#: all finish together, where many packs keep every read thread busy and let the first be
#: unpacked while the last are still read (``read.Unpacker``).
DEFAULT_PACK_BYTES = 8 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class OrbaxOptions:
    """What ``OrbaxBackend(...)`` was asked for; the backend's keyword arguments, checked in
    ``__post_init__`` (ValueError naming the argument and the value)."""

    use_ocdbt: bool = False
    """Orbax's OCDBT container format. Off: one zarr array per leaf was the fastest on CPU
    (docs/design.md "Measured facts"; docs/performance.md, the settings table)."""
    use_zarr3: bool = True
    """zarr v3 array format."""
    use_compression: bool = False
    """zstd compression; costs CPU and barely shrinks float weights."""
    async_timeout_s: int | None = None
    """How long Orbax's background thread waits at its cross-process barriers; None keeps
    Orbax's default."""
    collective_timeout_s: float = 300.0
    """Timeout of ``broadcast_int`` in multi-process runs."""
    pause_gc: bool = True
    """Pause Python's cyclic GC during the blocking parts of write and read (10-20% with
    thousands of leaves: docs/design.md, "Measured facts")."""
    pack_leaf_bytes: int = DEFAULT_PACK_LEAF_BYTES
    """Leaves of at most this many bytes are packed into a few arrays per dtype (see
    ``_orbax_plan``); 0 writes every leaf as its own Orbax array."""
    pack_bytes: int = DEFAULT_PACK_BYTES
    """The largest pack array, in bytes; at least ``pack_leaf_bytes``."""
    reuse_host_buffers: bool = True
    """Keep the host buffers a save copies into (packs; numpy leaves of async saves) and
    copy into them again at the next save of the same layout. Fresh buffers cost page
    faults that take longer than the copy itself; the price is one
    host copy of those leaves held between saves. False allocates per save and frees after
    the write."""
    native_io: bool = True
    """Single-process runs on a local filesystem write, and read back, the arrays with
    jaxckpt's own file I/O (``chunk_io``) in the zarr3 layout Orbax + tensorstore
    produce, instead of through them: a third of the CPU per save, checksums computed on
    the way, no read-back at commit. The files are Orbax's: Orbax
    reads them, and arrays Orbax wrote are read natively when their layout is this one.
    (Large arrays may start a few bytes into their file, where their memory lines up with
    its blocks: ``chunk_io.data_offset``.) False: Orbax writes and reads everything, as with
    several processes."""
    direct_io: bool = True
    """With ``native_io``, move the bytes with ``O_DIRECT`` where the filesystem allows it
    (no copy through the page cache); False: buffered I/O."""
    io_threads: int = 4
    """Threads that write array files in parallel with ``native_io``. Each checksums a
    piece (copied into its aligned buffer first where the array's memory does not line up
    with the file), then waits for the disk; four keep the disk busy, and the training
    loop measured no dearer with 4 than with 2
    (benchmarks/results/save-restore-round4_cpu2core_2026-11-22.md)."""
    read_threads: int = 8
    """Threads that read array files in parallel with ``native_io``. Each reads a piece,
    then checksums it: more reads in flight help a restore up to about 8 on the
    development disk, and nothing else runs then."""

    def __post_init__(self) -> None:
        for field, value in (("pack_leaf_bytes", self.pack_leaf_bytes),
                             ("pack_bytes", self.pack_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"OrbaxBackend({field}=...) must be an int >= 0 (bytes), got "
                                 f"{value!r}.")
        for field, value in (("io_threads", self.io_threads),
                             ("read_threads", self.read_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"OrbaxBackend({field}=...) must be an int >= 1, got "
                                 f"{value!r}.")
        if self.pack_leaf_bytes > 0 and self.pack_bytes < self.pack_leaf_bytes:
            raise ValueError(f"OrbaxBackend(pack_bytes={self.pack_bytes}) must be at least "
                             f"pack_leaf_bytes={self.pack_leaf_bytes}: a pack holds leaves of "
                             "up to pack_leaf_bytes each. Raise pack_bytes or lower "
                             "pack_leaf_bytes.")

    @property
    def handler_options(self) -> dict[str, bool]:
        """The keyword arguments of Orbax's PyTreeCheckpointHandler these options set."""
        return dict(use_ocdbt=self.use_ocdbt, use_zarr3=self.use_zarr3,
                    use_compression=self.use_compression)
