"""``python benchmarks/experiments/bench_read_memory.py``: a cold restore against the raw
read floor, side by side in one process, with the memory each reads into as the variable.

Owns: the experiment behind docs/performance.md, "Tenth round (rawread)": one checkpoint
written once, then, per round and in a rotated order, each variant read cold (page cache
dropped, freed memory handed back, optionally ``--gap`` seconds of waiting so that a VM's
free page reporting returns the freed memory to its host first): the raw ``O_DIRECT`` read
of the checkpoint's own files into numpy's buffers (huge pages asked for), into
``buffers.fresh_blocks`` (the restore's memory), into maps advised for and against huge
pages; the same read on 8 threads with the checksum and placement into jax arrays (a floor
that ends where a restore ends); the backend's read; the restore; and the restore into
numpy's buffers. Per variant: the median wall time and its range, CPU (user, system),
minor page faults, the huge pages the kernel made (``/proc/vmstat``) and those the
process holds at the end (``AnonHugePages``).

Needs root for the cold reads (``/proc/sys/vm/drop_caches``); about 2.5x ``--mib`` of memory.

Must not import: torch.

A one-off experiment, outside the wheel: run it as a script from a checkout, against the
installed package (``pip install -e .`` or the wheel), from the repository root.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import mmap
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxckpt.backends.orbax import chunk_io, zarr_format
from jaxckpt.storage import buffers
from jaxckpt.tools import bench

_MiB = 1 << 20
_VMSTAT = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall")
_SHOWN = ("wall", "user", "sys", "minflt") + _VMSTAT + ("huge_mib",)


def _counters() -> dict[str, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    found: dict[str, float] = {"user": usage.ru_utime, "sys": usage.ru_stime,
                               "minflt": usage.ru_minflt}
    with open("/proc/vmstat") as handle:
        for line in handle:
            name, value = line.split()
            if name in _VMSTAT:
                found[name] = int(value)
    with open("/proc/self/smaps_rollup") as handle:
        for line in handle:
            if line.startswith("AnonHugePages:"):
                found["huge_mib"] = int(line.split()[1]) / 1024
    return found


def _measure(action: Callable[[], Any], gap_s: float) -> dict[str, float]:
    """One cold run of ``action``: its wall time and the counters' growth while it ran
    (the huge pages: those held when it returned, its result still alive)."""
    bench._drop_page_cache()
    bench._settle()
    if gap_s:
        time.sleep(gap_s)
    before = _counters()
    start = time.perf_counter()
    result = action()
    wall = time.perf_counter() - start
    after = _counters()
    del result
    row = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    row["wall"] = wall
    return row


def _mapped(nbytes: int, advice: int) -> np.ndarray:
    memory = mmap.mmap(-1, -(-max(nbytes, 1) // mmap.PAGESIZE) * mmap.PAGESIZE,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(advice)
    return np.frombuffer(memory, np.uint8)


_MEMORY: dict[str, Callable[[int], np.ndarray]] = {
    "numpy": buffers.aligned_blocks,  # np.empty: numpy asks for huge pages from 4 MiB
    "restore's": lambda nbytes: buffers.fresh_blocks(nbytes),  # looked up when called
    "huge": lambda nbytes: _mapped(nbytes, mmap.MADV_HUGEPAGE),
    "nohuge": lambda nbytes: _mapped(nbytes, mmap.MADV_NOHUGEPAGE),
}


def _read_file(path: str, size: int, memory: Callable[[int], np.ndarray],
               checksum: bool) -> np.ndarray:
    """``bench._raw_read_direct``'s read (8 MiB ``preadv``, ``O_DIRECT``) into ``memory``,
    with the restore's checksum on the way when asked."""
    from jaxckpt.core.checksum import extend

    out = memory(size)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    crc = 0
    try:
        offset = 0
        while offset < size:
            piece = out[offset:offset + chunk_io.PIECE]
            got = os.preadv(fd, [piece.data], offset)
            if got <= 0:
                break
            if checksum:
                crc = extend("crc32c", crc, piece[:min(got, size - offset)])
            offset += got
    finally:
        os.close(fd)
    return out[:size]


@contextlib.contextmanager
def _restore_reads_into(memory: Callable[[int], np.ndarray]) -> Iterator[None]:
    real = buffers.fresh_blocks
    buffers.fresh_blocks = memory  # type: ignore[assignment]
    try:
        yield
    finally:
        buffers.fresh_blocks = real


class _Checkpoint:
    """The checkpoint every variant reads, and the reads."""

    def __init__(self, root: str, mib: int, leaves: int):
        import jaxckpt
        from jaxckpt.core.layout import STATE_DIR

        state = bench._jax_state(bench._leaf_arrays(bench._random_bytes(mib * _MiB, 0),
                                                    leaves))
        self.like = bench._abstract(state)
        self.manager = jaxckpt.CheckpointManager(
            root, recover=jaxckpt.RecoverConfig(keep_last_n=1), mode="sync",
            preemption_signals=())
        report = self.manager.save(jaxckpt.StepInfo(0, 0, 0), state)
        self.directory = os.path.join(report.path, STATE_DIR)
        self.nbytes = bench._tree_bytes(state)
        # (chunk file, its size, where the array starts, the array's dtype and shape)
        self.files: list[tuple[str, int, int, np.dtype, tuple[int, ...]]] = []
        for parent, _, names in os.walk(self.directory):
            if "zarr.json" not in names:
                continue
            with open(os.path.join(parent, "zarr.json")) as handle:
                parsed = zarr_format.parse_metadata(handle.read())
            if parsed is None:
                raise RuntimeError(f"{parent} is not in zarr_format's layout")
            shape, dtype, offset = parsed
            path = os.path.join(parent, zarr_format.chunk_relpath(len(shape)))
            self.files.append((path, os.path.getsize(path), offset, dtype, shape))
        self.files.sort(key=lambda file: -file[1])

    def floor(self, pool: concurrent.futures.Executor, memory: Callable[[int], np.ndarray],
              *, as_jax: bool = False) -> list[Any]:
        """Every chunk file read whole into its own new buffer of ``memory``; ``as_jax``:
        checksummed on the way and placed as jax arrays, as a restore ends."""
        buffers = list(pool.map(lambda file: _read_file(file[0], file[1], memory, as_jax),
                                self.files))
        if not as_jax:
            return buffers
        import jax

        arrays = [buffer[offset:offset + int(np.prod(shape)) * dtype.itemsize]
                  .view(dtype).reshape(shape)
                  for buffer, (_, _, offset, dtype, shape) in zip(buffers, self.files,
                                                                   strict=True)]
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.device_put(arrays, [device] * len(arrays))  # adopted on CPU: no copy

    def variants(self, pool4: concurrent.futures.Executor,
                 pool8: concurrent.futures.Executor) -> dict[str, Callable[[], Any]]:
        def restore_into(memory: Callable[[int], np.ndarray]) -> Callable[[], Any]:
            def run() -> Any:
                with _restore_reads_into(memory):
                    return self.manager.restore(self.like)
            return run

        found: dict[str, Callable[[], Any]] = {
            f"floor, 4 threads, into {kind} memory":
                (lambda memory=memory: self.floor(pool4, memory))  # type: ignore[misc]
            for kind, memory in _MEMORY.items()}
        found["floor, 8 threads, into restore's memory"] = (
            lambda: self.floor(pool8, _MEMORY["restore's"]))
        found["floor, 8 threads, restore's memory, crc32c, as jax"] = (
            lambda: self.floor(pool8, _MEMORY["restore's"], as_jax=True))
        found["floor, 8 threads, numpy memory, crc32c, as jax"] = (
            lambda: self.floor(pool8, _MEMORY["numpy"], as_jax=True))
        found["backend read (verify=sizes)"] = (
            lambda: self.manager.backend.read(self.directory, self.like))
        found["restore (the default)"] = lambda: self.manager.restore(self.like)
        found["restore into numpy memory"] = restore_into(buffers.aligned_blocks)
        return found


def _table(rows: dict[str, list[dict[str, float]]], nbytes: int) -> str:
    lines = [f"{'variant':56s}" + "".join(f"{name[:11]:>12s}" for name in _SHOWN)
             + "   wall range"]
    for name, runs in rows.items():
        medians = [statistics.median(run.get(key, 0) for run in runs) for key in _SHOWN]
        walls = [run["wall"] for run in runs]
        lines.append(f"{name:56s}" + "".join(f"{value:12.3f}" if value % 1 else
                                             f"{int(value):12d}" for value in medians)
                     + f"   {min(walls):.3f}-{max(walls):.3f}")
    lines.append(f"({nbytes / _MiB:.0f} MiB; medians; CPU in seconds, memory in MiB)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--leaves", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--gap", type=float, default=0.0,
                        help="seconds to wait before each read (freed memory back to a host)")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as workdir, \
            concurrent.futures.ThreadPoolExecutor(4) as pool4, \
            concurrent.futures.ThreadPoolExecutor(8) as pool8:
        checkpoint = _Checkpoint(os.path.join(workdir, "root"), args.mib, args.leaves)
        try:
            variants = checkpoint.variants(pool4, pool8)
            names = list(variants)
            _measure(variants["restore (the default)"], 0)  # first use: caches, threads
            for turn in range(args.rounds):
                order = names[turn % len(names):] + names[:turn % len(names)]
                for name in order[::-1] if turn % 2 else order:
                    rows.setdefault(name, []).append(_measure(variants[name], args.gap))
                print(f"round {turn + 1} of {args.rounds}, load {os.getloadavg()[0]:.1f}",
                      file=sys.stderr, flush=True)
        finally:
            checkpoint.manager.close()
    print(json.dumps(rows) if args.json else _table(rows, checkpoint.nbytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
