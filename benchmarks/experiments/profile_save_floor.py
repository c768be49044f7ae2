"""Where a durable sync save's time goes beyond the O_DIRECT write floor of the same bytes.

Each round, interleaved: the bench's O_DIRECT floor (a file per leaf, 4 threads, from
aligned buffers, each file fsynced), then a jaxckpt sync save of the same state with
timestamps around its parts, then an async save (total to commit). The timestamps come
from wrapping the functions of the write path here, in this process only (a profile, no
library change): the pieces' O_DIRECT writes, copies into the bounce buffer, checksums,
fsyncs, the commit's listing, summaries and marker.

    python benchmarks/experiments/profile_save_floor.py --mib 512 --leaves 16 --rounds 5

Prints one line per round (with ``PROFILE_GAPS=1`` also where, during the chunk writes,
the device had no write or fsync of ours) and the medians, wall and CPU; results:
benchmarks/results/save-floor-breakdown_cpu2core_2026-11-28.md.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

# The checkout this script sits in, not an installed jaxckpt.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_events: list[tuple[str, str, float, float, float]] = []  # label, thread, start, end, cpu
_lock = threading.Lock()


def _wrap(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            end, cpu = time.perf_counter(), time.thread_time() - cpu
            with _lock:
                _events.append((label, threading.current_thread().name, start, end, cpu))

    setattr(owner, name, timed)


def _instrument() -> None:
    from jaxckpt.backends.orbax import chunk_io, files, write
    from jaxckpt.commit import store
    from jaxckpt.storage import posix

    _wrap(chunk_io, "_pwrite_all", "pwrite")
    from jaxckpt.tools.bench import floors

    _wrap(floors, "_pwrite_all", "floor.pwrite")
    _wrap(chunk_io, "extend", "crc")
    _wrap(chunk_io._FileImage, "fill", "copy")
    _wrap(chunk_io, "write_chunk", "write_chunk")
    _wrap(chunk_io, "_write_own_memory", "own_memory")
    if hasattr(chunk_io, "_sync_and_close"):  # a chunk file's fsync on a side thread
        _wrap(chunk_io, "_sync_and_close", "chunk.sync")
    _wrap(chunk_io.os, "fsync", "fsync")
    _wrap(write, "write_native", "write_native")
    if hasattr(files.LocalArrayFiles, "_wait_synced"):  # the side fsyncs (2026-11-28, later)
        _wrap(files.LocalArrayFiles, "_wait_synced", "names.wait")
        _wrap(files, "fsync_dir", "names.dir")
        _wrap(files, "fsync_file", "names.file")
    _wrap(files.LocalArrayFiles, "finish", "arrays.finish")
    _wrap(store.CheckpointStore, "commit", "commit")
    _wrap(store, "_summarise_and_name", "commit.summaries+names")
    _wrap(posix.PosixStorage, "list_files", "commit.list")
    _wrap(posix.PosixStorage, "create", "commit.marker")


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _breakdown(start: float, stop: float) -> dict[str, float]:
    with _lock:
        events = [e for e in _events if e[2] >= start and e[3] <= stop + 0.002]
    out: dict[str, float] = {}
    by = collections.defaultdict(list)
    cpu: dict[str, float] = collections.defaultdict(float)
    for label, thread, a, b, used in events:
        by[label].append((a, b, thread))
        cpu[label] += used
    chunks = by["write_chunk"]
    out["before first chunk"] = min(a for a, _, _ in chunks) - start
    out["chunks (first start..last end)"] = max(b for _, b, _ in chunks) - min(
        a for a, _, _ in chunks)
    native = by["write_native"]
    out["save() to write_native"] = min(a for a, _, _ in native) - start
    out["write_native to first pwrite"] = min(a for a, _, _ in by["pwrite"]) - min(
        a for a, _, _ in native)
    out["write_native end..commit start"] = min(a for a, _, _ in by["commit"]) - max(
        b for _, b, _ in native)
    out["after last chunk..write_native end"] = max(b for _, b, _ in native) - max(
        b for _, b, _ in chunks)
    out["commit"] = sum(b - a for a, b, _ in by["commit"])
    out["commit CPU (its thread)"] = cpu["commit"]
    for key in ("commit.list", "commit.summaries+names", "commit.marker", "arrays.finish",
                "names.wait"):
        out[key] = sum(b - a for a, b, _ in by[key])
    for key in ("names.dir", "names.file"):  # fsyncs on the side threads, beside the data
        out[f"{key} count"] = len(by[key])
        out[f"{key} last end after last chunk"] = (
            max(b for _, b, _ in by[key]) - max(b for _, b, _ in chunks) if by[key] else 0.0)
    out["after commit"] = stop - max(b for _, b, _ in by["commit"])
    span = (min(a for a, _, _ in chunks), max(b for _, b, _ in chunks))
    busy = [(a, b) for a, b, _ in by["pwrite"] + by["fsync"] if a < span[1] and b > span[0]]
    out["chunks: idle (no pwrite, no fsync)"] = span[1] - span[0] - _union(busy)
    if os.environ.get("PROFILE_GAPS"):  # where the device had nothing, ms from the span start
        gaps, end = [], span[0]
        for a, b in sorted(busy):
            if a - end > 0.0005:
                gaps.append(f"{(end - span[0]) * 1e3:.0f}+{(a - end) * 1e3:.1f}")
            end = max(end, b)
        if span[1] - end > 0.0005:
            gaps.append(f"{(end - span[0]) * 1e3:.0f}+{(span[1] - end) * 1e3:.1f}")
        print("  idle gaps (ms from first chunk + length):", " ".join(gaps))
    io = [(a, b) for a, b, t in by["pwrite"] if t.startswith("jaxckpt") or "io" in t or True]
    out["pwrite busy (union)"] = _union(io)
    out["pwrite sum (thread-s)"] = sum(b - a for a, b in io)
    out["copy sum (thread-s)"] = sum(b - a for a, b, _ in by["copy"])
    out["crc sum (thread-s)"] = sum(b - a for a, b, _ in by["crc"])
    chunk_fsync = [(a, b) for a, b, t in by["fsync"]
                   if any(ca <= a and b <= cb and ct == t for ca, cb, ct in chunks)]
    chunk_fsync += [(a, b) for a, b, _ in by["chunk.sync"]]
    out["chunk fsync sum (thread-s)"] = sum(b - a for a, b in chunk_fsync)
    out["chunk fsync union"] = _union(chunk_fsync)
    out["files finished from jax's memory (count)"] = len(by["own_memory"])
    for key in ("copy", "crc", "pwrite", "fsync", "write_chunk"):  # CPU, not wall
        out[f"CPU {key} (thread-s)"] = cpu[key]
    return out


#: The parts printed for each round's sync save (ms).
_ROUND_PARTS = ("save() to write_native", "write_native to first pwrite",
                "chunks (first start..last end)", "commit", "pwrite busy (union)",
                "chunks: idle (no pwrite, no fsync)", "chunk fsync union",
                "CPU copy (thread-s)", "CPU crc (thread-s)", "CPU pwrite (thread-s)")


def _floor_breakdown(start: float, stop: float) -> dict[str, float]:
    """The floor's own writes and fsyncs in its window: how busy it keeps the device."""
    with _lock:
        events = [e for e in _events if e[2] >= start and e[3] <= stop + 0.002]
    writes = [(a, b) for label, _, a, b, _ in events if label == "floor.pwrite"]
    syncs = [(a, b) for label, _, a, b, _ in events if label == "fsync"]
    if not writes:
        return {}
    return {"floor: first pwrite": min(a for a, _ in writes) - start,
            "floor: pwrite busy (union)": _union(writes),
            "floor: fsync union": _union(syncs),
            "floor: idle (neither)": (stop - start) - _union(writes + syncs)}


def _old_writer(commit: str) -> Any:
    """``_write_direct`` of chunk_io as of ``commit``, in a module of its own (its own
    bounce buffers and checksum threads)."""
    import subprocess
    import types

    source = subprocess.run(["git", "show", f"{commit}:jaxckpt/backends/orbax/chunk_io.py"],
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("chunk_io_before")
    exec(compile(source, "chunk_io_before.py", "exec"), module.__dict__)
    return module._write_direct


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--leaves", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--no-instrument", action="store_true")
    parser.add_argument("--ab", default=None, metavar="COMMIT",
                        help="also save with chunk_io's writer as of COMMIT, taking turns "
                             "with the working tree's (timings only; no breakdown)")
    parser.add_argument("--zero-copy-too", action="store_true",
                        help="also save writing jax's memory without the bounce copy")
    parser.add_argument("--chunk-sync-inline-too", action="store_true",
                        help="also save with each chunk file fsynced by its I/O thread")
    args = parser.parse_args()

    import jaxckpt
    from jaxckpt.storage.buffers import aligned_blocks
    from jaxckpt.tools.bench.floors import _raw_write_direct
    from jaxckpt.tools.bench.states import _jax_state, _leaf_arrays, _random_bytes
    from jaxckpt.tools.bench.timing import _settle

    if not args.no_instrument:
        _instrument()
    if os.environ.get("PROFILE_ZERO_COPY"):  # write jax's memory as it is, no bounce copy
        from jaxckpt.backends.orbax import chunk_io

        bounce = chunk_io._bounce
        chunk_io._bounce = lambda: (bounce()[0], False)
    work = tempfile.mkdtemp(prefix="floor-prof-", dir=args.dir)
    data = _random_bytes(args.mib << 20, seed=0)
    state = _jax_state(_leaf_arrays(data, args.leaves))
    arrays = [np.asarray(leaf["w"]) for leaf in state.values()]
    blocks = [aligned_blocks(a.nbytes) for a in arrays]
    for a, b in zip(arrays, blocks, strict=True):
        b[:a.nbytes] = a.reshape(-1).view(np.uint8)
    nbytes = sum(a.nbytes for a in arrays)
    manager = jaxckpt.CheckpointManager(
        os.path.join(work, "root"), recover=jaxckpt.RecoverConfig(keep_last_n=1),
        mode="async", preemption_signals=())
    step = 0
    cpus: dict[str, list[float]] = collections.defaultdict(list)  # process CPU per save

    def save(mode: str) -> Any:
        nonlocal step
        step += 1
        _settle()
        begun, cpu = time.perf_counter(), os.times()
        report = manager.save(jaxckpt.StepInfo(0, step, step), state, mode=mode)
        report.wait()
        manager.wait()
        after = os.times()
        cpus[mode].append(after.user - cpu.user + after.system - cpu.system)
        return report, begun

    save("async")  # first save: buffers, plan, directories
    rows: dict[str, list[float]] = collections.defaultdict(list)
    parts: dict[str, list[float]] = collections.defaultdict(list)
    from jaxckpt.backends.orbax import chunk_io, files

    # Each variant: the attributes (of chunk_io, or of the class of local files) it
    # replaces while its saves run.
    local = files.LocalArrayFiles
    current = {(chunk_io, "_write_direct"): chunk_io._write_direct,
               (chunk_io, "_bounce"): chunk_io._bounce,
               (local, "sync_chunks_aside"): getattr(local, "sync_chunks_aside", False)}
    variants: dict[str, dict[tuple[Any, str], Any]] = {"": {}}
    if args.ab:
        variants["_before"] = {(chunk_io, "_write_direct"): _old_writer(args.ab)}
        args.no_instrument = True
    if args.zero_copy_too:  # told the bounce buffer has no huge pages: no copy of jax's memory
        bounce = chunk_io._bounce
        variants["_zero"] = {(chunk_io, "_bounce"): lambda: (bounce()[0], False)}
        args.no_instrument = True
    if args.chunk_sync_inline_too:  # each chunk file fsynced by its I/O thread, in turn
        variants["_inline"] = {(local, "sync_chunks_aside"): False}  # the same wrappers
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        for round_ in range(args.rounds):
            directory = os.path.join(work, f"floor-{round_}")
            os.makedirs(directory)
            paths = [os.path.join(directory, str(i)) for i in range(len(blocks))]
            _settle()
            start, cpu = time.perf_counter(), os.times()
            list(pool.map(_raw_write_direct, paths, blocks))
            floor = time.perf_counter() - start
            after = os.times()
            cpus["floor"].append(after.user - cpu.user + after.system - cpu.system)
            if not args.no_instrument:
                found = _floor_breakdown(start, start + floor)
                for key, value in found.items():
                    parts[key].append(value)
                print("  " + "  ".join(f"{key} {value * 1e3:.0f}ms"
                                       for key, value in found.items()), flush=True)
            shutil.rmtree(directory)
            rows["floor"].append(floor)
            order = list(variants.items())
            for suffix, replaced in order[::-1] if round_ % 2 else order:
                for (owner, name), value in {**current, **replaced}.items():
                    setattr(owner, name, value)
                report, start = save("sync")
                sync = report.total_s
                if not args.no_instrument:
                    try:
                        found = _breakdown(start, start + sync)
                    except ValueError:  # a part ended outside the save's window: not counted
                        found = {}
                    for key, value in found.items():
                        parts[f"{key}{suffix}"].append(value)  # the variants apart
                    if found:
                        shown = "  ".join(f"{key.split(' (')[0]} {found[key] * 1e3:.0f}ms"
                                          for key in _ROUND_PARTS)
                        print(f"  {suffix or 'as is'}: {shown}", flush=True)
                report, _ = save("async")
                rows["sync" + suffix].append(sync)
                rows["async" + suffix].append(report.total_s)
                print(f"round {round_}{suffix}: floor {floor:.3f}s  sync {sync:.3f}s "
                      f"({floor / sync:.2f}x)  async total {report.total_s:.3f}s "
                      f"({floor / report.total_s:.2f}x) blocking {report.blocking_s:.3f}s",
                      flush=True)
            for (owner, name), value in current.items():
                setattr(owner, name, value)
    manager.close()
    shutil.rmtree(work, ignore_errors=True)
    gb = nbytes / 1e9
    print(f"\n{args.mib} MiB in {args.leaves} leaves, {args.rounds} rounds, medians:")
    for kind, values in cpus.items():  # the first (untimed) async save is in "async"
        values = values[1:] if kind == "async" else values
        print(f"  process CPU, {kind}: {statistics.median(values):.3f}s "
              f"(user + system, all threads; range {min(values):.3f}-{max(values):.3f})")
    for key, values in rows.items():
        median = statistics.median(values)
        print(f"  {key:6s} {median:.3f}s  {gb / median:.2f} GB/s  "
              f"(range {min(values):.3f}-{max(values):.3f})")
    for suffix in variants:
        for kind in ("sync", "async"):
            ratios = [f / s for f, s in zip(rows["floor"], rows[kind + suffix], strict=True)]
            print(f"  {kind}{suffix}/floor {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")
    if parts:
        print("\nsync save breakdown (medians, s):")
        for key, values in parts.items():
            print(f"  {key:38s} {statistics.median(values):.4f}")


if __name__ == "__main__":
    main()
