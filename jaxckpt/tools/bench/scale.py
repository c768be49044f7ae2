"""``jaxckpt bench --scale``: how save and restore grow with the state, and whether they stay flat.

Owns the scale run: states from ``start_mb`` doubling up to what memory and disk allow (at
most ``max_mb``; the report says where it stopped), in leaves of ``leaf_mb``; per size and
round a sync save (time per GiB, peak extra host memory), an async save (blocking time), a
cold restore and, taking turns with it, the read floor of the same files (each after as much
new memory was faulted in and freed, ``_prime_new_memory``); then ``saves`` consecutive async
saves, each followed by the raw write floor, following RSS and time. The targets against the
floors give the library's share of any growth (``scale_targets``).

Peak memory is the kernel's high-water mark (VmHWM, reset by ``/proc/self/clear_refs``), else
RSS sampled every 5 ms, minus the resident memory just before the call.

Must not import: torch. jax is imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import gc
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import floors
from .config import _MiB
from .results import _columns, report, target_row
from .states import _abstract
from .timing import _drop_page_cache, _rss, _settle

__all__ = ["ScaleConfig", "format_scale", "run_scale"]

_GiB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScaleConfig:
    """What ``jaxckpt bench --scale`` measures, and how big."""

    directory: str | None = None
    """Where files are written (a fresh subdirectory, removed at the end)."""
    start_mb: int = 128
    """The smallest state, MiB; each next one is twice as large."""
    max_mb: int = 8192
    """The largest state asked for, MiB; the run stops earlier where memory or disk would
    not hold it (the report says which)."""
    leaf_mb: int = 64
    """Leaf size, MiB: the largest array a save writes at once (the memory target's unit)."""
    repeats: int = 5
    """Rounds per size; figures are medians with their spread."""
    saves: int = 50
    """Consecutive async saves whose memory and time must stay flat (0 skips them)."""
    saves_mb: int = 512
    """State size of the consecutive saves, MiB."""

    def __post_init__(self) -> None:
        for name in ("start_mb", "max_mb", "leaf_mb", "repeats", "saves_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ScaleConfig.{name} must be an int >= 1, got {value!r}.")
        if isinstance(self.saves, bool) or not isinstance(self.saves, int) or self.saves < 0:
            raise ValueError(f"ScaleConfig.saves must be an int >= 0, got {self.saves!r}.")
        if self.max_mb < self.start_mb:
            raise ValueError(f"ScaleConfig.max_mb={self.max_mb} is below start_mb="
                             f"{self.start_mb}.")

    @classmethod
    def quick(cls, **changes: Any) -> ScaleConfig:
        """Tiny sizes, one round: what CI runs to keep the scale run working."""
        base: dict[str, Any] = {"start_mb": 4, "max_mb": 8, "leaf_mb": 2, "repeats": 1,
                                "saves": 6, "saves_mb": 4}
        base.update(changes)
        return cls(**base)


# ------------------------------------------------------------------------- measuring


def _mem_available() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def sizes_that_fit(config: ScaleConfig, workdir: str) -> tuple[list[int], str]:
    """The state sizes (MiB) to run, and why the list ends where it does. A size needs
    2.5 times its bytes of available memory (the state, the restored copy, headroom) and
    3 times on disk (two checkpoints while the older one is replaced, headroom)."""
    memory, disk = _mem_available(), shutil.disk_usage(workdir).free
    sizes: list[int] = []
    size = config.start_mb
    while size <= config.max_mb:
        if size * _MiB * 2.5 > memory:
            return sizes, (f"stopped before {size} MiB: {memory / _GiB:.1f} GiB of memory "
                           "available, a run needs 2.5 x the state")
        if size * _MiB * 3 > disk:
            return sizes, (f"stopped before {size} MiB: {disk / _GiB:.1f} GiB free on the "
                           "disk, a run needs 3 x the state")
        sizes.append(size)
        size *= 2
    return sizes, f"stopped at max_mb={config.max_mb}"


class _PeakMemory:
    """The peak resident memory of this process during a ``with`` block (see the module
    docstring): ``extra`` is the peak minus the resident memory at the start."""

    def __init__(self) -> None:
        self.extra = 0
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _PeakMemory:  # noqa: PYI034 - never subclassed
        self.start = _rss()
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # resets VmHWM to the current RSS
        except OSError:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._sampled = max(self._sampled, _rss())

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            peak = max(self._sampled, _rss())
        else:
            peak = _high_water_mark()
        self.extra = max(0, peak - self.start)


def _high_water_mark() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return _rss()


def _state(size_mb: int, leaf_mb: int, seed: int) -> dict[str, Any]:
    """``size_mb`` of random float32 data in leaves of ``leaf_mb`` (jax.Arrays), built one
    leaf at a time so that building never holds two copies of the state."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    leaves = max(1, size_mb // leaf_mb)
    count = size_mb * _MiB // leaves // 4
    return {f"layer_{index:05d}": {"w": jnp.asarray(rng.standard_normal(count, np.float32))}
            for index in range(leaves)}


class _Saver:
    """A manager over one root, and the next step to save."""

    def __init__(self, root: str):
        import jaxckpt

        self.manager = jaxckpt.CheckpointManager(
            root, recover=jaxckpt.RecoverConfig(keep_last_n=1), mode="async",
            preemption_signals=())
        self.step = 0

    def save(self, state: Any, mode: str) -> Any:
        import jaxckpt

        self.step += 1
        _settle()
        report = self.manager.save(jaxckpt.StepInfo(0, self.step, self.step), state,
                                   mode=mode)
        report.wait()
        self.manager.wait()  # retention of the previous checkpoint is not the next row's
        return report


def _read_fresh(path: str, size: int) -> np.ndarray:
    """Read one file with ``O_DIRECT`` (where the filesystem allows it) into memory of the
    kind a restore reads into (``buffers.fresh_blocks``), in the reader's 8 MiB pieces."""
    from jaxckpt.backends.orbax import chunk_io
    from jaxckpt.storage import buffers

    buffer = buffers.fresh_blocks(size)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while offset < size:
            got = os.preadv(fd, [buffer[offset:offset + chunk_io.PIECE].data], offset)
            if got <= 0:
                break
            offset += got
    finally:
        os.close(fd)
    return buffer


def _prime_new_memory(nbytes: int) -> None:
    """Fault in ``nbytes`` of new memory of the kind a restore reads into, one write per
    page, and free it, so that the next row starts right after that much memory was freed.

    Why: of the two rows of a round, the second reads into memory the first freed a moment
    before, while the first meets whatever the saves before it left; on a VM whose host
    takes freed memory back, the first row paid for that alone. Primed, both rows start
    alike (benchmarks/results/scale-4g-restore_cpu2core_2026-11-25.md)."""
    from jaxckpt.storage import buffers

    blocks = buffers.fresh_blocks(nbytes)
    blocks[::mmap.PAGESIZE] = 0
    del blocks  # unmapped here: its pages are free again before the row starts


def _restore_and_floor(saver: _Saver, like: Any, path: str, nbytes: int,
                       found: dict[str, Any], turn: int) -> None:
    """A cold restore and the read floor at this size, taking turns going first: a bare
    read of the checkpoint's own files (8 threads, as the reader) into new memory of the
    kind the restore's arrays live in. What new memory costs per GiB can change from one
    moment to the next (benchmarks/results/scale-drift_cpu2core_2026-11-25.md); the floor
    pays it as the restore does, so restore / floor is the library's share. Each row starts
    from the same memory (``_prime_new_memory``)."""
    import concurrent.futures

    from jaxckpt.core.layout import STATE_DIR

    files = floors._files_under(os.path.join(path, STATE_DIR))

    def restore() -> None:
        with _PeakMemory() as peak:
            started = time.perf_counter()
            restored = saver.manager.restore(like)
            found["restore_s"].append(time.perf_counter() - started)
        found["restore_extra"].append(max(0, peak.extra - nbytes))
        del restored

    def floor() -> None:
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            started = time.perf_counter()
            buffers = list(pool.map(lambda file: _read_fresh(*file), files))
            found["floor_s"].append(time.perf_counter() - started)
        del buffers

    for row in (restore, floor) if turn % 2 == 0 else (floor, restore):
        _drop_page_cache()
        _settle()
        _prime_new_memory(nbytes)
        row()


def measure_size(config: ScaleConfig, size_mb: int, root: str) -> dict[str, Any]:
    """Every round of one size: sync save, async save, cold restore and its read floor
    (see the module docstring); lists of per-round figures by name."""
    state = _state(size_mb, config.leaf_mb, seed=size_mb)
    nbytes = sum(int(leaf["w"].nbytes) for leaf in state.values())
    like = _abstract(state)
    saver = _Saver(root)
    found: dict[str, Any] = {"mib": size_mb, "bytes": nbytes, "save_s": [],
                             "blocking_s": [], "async_s": [], "restore_s": [], "floor_s": [],
                             "save_extra": [], "restore_extra": []}
    try:
        saver.save(state, "sync")  # the first save: plans, buffers, thread pools
        for turn in range(config.repeats):
            with _PeakMemory() as peak:
                report = saver.save(state, "sync")
            found["save_s"].append(report.total_s)
            found["save_extra"].append(peak.extra)
            report = saver.save(state, "async")
            found["blocking_s"].append(report.blocking_s)
            found["async_s"].append(report.total_s)
            _restore_and_floor(saver, like, report.path, nbytes, found, turn)
    finally:
        saver.manager.close()
        del state
        gc.collect()
    return found


class _FloorWriter:
    """The raw write floor of the consecutive saves: the state's bytes, one file per leaf
    (``O_DIRECT`` where the filesystem takes it, else buffered), 4 threads, every file
    and the directory fsynced, from a copy of the state made once (so the consecutive
    saves' RSS includes it, flat), under the manager's pattern: each copy in a new directory,
    the previous one deleted once the new one is written (``keep_last_n=1``). Where a
    write lands on the disk changes what it costs; a floor taken in turns with the saves,
    under the same pattern, tells the disk's drift from the library's
    (benchmarks/results/scale-drift_cpu2core_2026-11-25.md)."""

    def __init__(self, state: dict[str, Any], root: str) -> None:
        import concurrent.futures

        from jaxckpt.storage import buffers

        os.makedirs(root, exist_ok=True)
        self.root, self.count = root, 0
        self.direct = floors._direct_refused(root) == ""
        self.blocks = []
        for leaf in state.values():
            data = np.asarray(leaf["w"]).reshape(-1).view(np.uint8)
            block = buffers.aligned_blocks(data.nbytes)  # whole blocks, zero-padded
            block[:data.nbytes] = data
            block[data.nbytes:] = 0
            self.blocks.append(block)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)

    def write(self) -> float:
        """Write one copy, durably; then delete the one before. Seconds of the write."""
        directory = os.path.join(self.root, f"copy_{self.count:05d}")
        os.makedirs(directory)

        def one(index: int) -> None:
            path = os.path.join(directory, f"leaf_{index:05d}")
            if self.direct:
                floors._raw_write_direct(path, self.blocks[index])
            else:
                floors._raw_write(path, [self.blocks[index]])

        started = time.perf_counter()
        list(self.pool.map(one, range(len(self.blocks))))
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        seconds = time.perf_counter() - started
        if self.count:
            shutil.rmtree(os.path.join(self.root, f"copy_{self.count - 1:05d}"))
        self.count += 1
        return seconds

    def close(self) -> None:
        self.pool.shutdown()
        shutil.rmtree(self.root, ignore_errors=True)


def consecutive_saves(config: ScaleConfig, root: str) -> dict[str, Any]:
    """``saves`` async saves of one state, a leaf changed before each as in training:
    RSS after each, each save's total time, and after each save the raw write floor of
    the same bytes under the same pattern (``_FloorWriter``)."""
    state = _state(config.saves_mb, config.leaf_mb, seed=7)
    saver = _Saver(os.path.join(root, "checkpoints"))
    floor = _FloorWriter(state, os.path.join(root, "floor"))
    rss: list[int] = []
    times: list[float] = []
    floor_s: list[float] = []
    try:
        for _ in range(config.saves):
            first = next(iter(state))
            state = {**state, first: {"w": state[first]["w"] + 0}}
            times.append(saver.save(state, "async").total_s)
            _settle()
            floor_s.append(floor.write())
            gc.collect()
            rss.append(_rss())
    finally:
        saver.manager.close()
        floor.close()
    return {"rss": rss, "save_s": times, "floor_s": floor_s}


def run_scale(config: ScaleConfig, *,
              log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole scale run: ``{"config", "sizes": [per size], "stopped", "saves",
    "targets"}`` (what ``format_scale`` prints; JSON-ready)."""
    import sys

    from jaxckpt.core.extras import requires_extra

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with requires_extra("jax", "jaxckpt bench --scale"):
        import jax  # noqa: F401 - fails here, with the extra named, when missing

    parent = config.directory or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="jaxckpt-scale-", dir=parent)
    result: dict[str, Any] = {"config": dataclasses.asdict(config), "directory": workdir,
                              "sizes": [], "load_start": round(os.getloadavg()[0], 2)}
    try:
        sizes, result["stopped"] = sizes_that_fit(config, workdir)
        for size in sizes:
            log(f"jaxckpt bench --scale: {size} MiB")
            result["sizes"].append(measure_size(config, size,
                                                os.path.join(workdir, f"s{size}")))
            shutil.rmtree(os.path.join(workdir, f"s{size}"), ignore_errors=True)
        if config.saves:
            log(f"jaxckpt bench --scale: {config.saves} consecutive saves")
            result["saves"] = consecutive_saves(config, os.path.join(workdir, "saves"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["load_end"] = round(os.getloadavg()[0], 2)
    result["targets"] = scale_targets(config, result)
    return result


# ------------------------------------------------------------------------- targets


def _per_gib(size: dict[str, Any], key: str) -> list[float]:
    return [seconds / (size["bytes"] / _GiB) for seconds in size[key]]


def scale_targets(config: ScaleConfig, result: dict[str, Any]) -> list[dict[str, Any]]:
    """Linear cost (time per GiB of the largest size against the reference size: the
    smallest of at least 1 GiB, else the smallest), peak extra memory against one leaf,
    and flat memory and time over the consecutive saves."""
    targets = []
    sizes = result["sizes"]
    if len(sizes) >= 2:
        reference = next((s for s in sizes if s["bytes"] >= _GiB), sizes[0])
        largest = sizes[-1]
        for key, what in (("save_s", "sync save"), ("restore_s", "restore")):
            ratios = [a / b for a, b in zip(_per_gib(largest, key), _per_gib(reference, key),
                                            strict=False)]
            targets.append(target_row(
                f"{what} time per GiB, {largest['mib']} MiB / {reference['mib']} MiB", ratios,
                "<=", 1.25, "cost linear in bytes (per-round ratios)"))
        if largest.get("floor_s") and reference.get("floor_s"):
            ratios = [(restore_l / floor_l) / (restore_r / floor_r)
                      for restore_l, floor_l, restore_r, floor_r in zip(
                          largest["restore_s"], largest["floor_s"], reference["restore_s"],
                          reference["floor_s"], strict=False)]
            targets.append(target_row(
                f"restore / read floor of the same size, {largest['mib']} MiB / "
                f"{reference['mib']} MiB", ratios, "<=", 1.25,
                "linear relative to the disk and new memory (per-round ratios)"))
    shard = config.leaf_mb * _MiB
    for key, what in (("save_extra", "sync save"), ("restore_extra", "restore")):
        worst = [max(size[key]) / shard for size in sizes if size[key]]
        targets.append(target_row(
            f"{what}: peak extra host memory / one leaf ({config.leaf_mb} MiB)", worst, "<=",
            1.0, "the worst round of the worst size; restore: above the restored state",
            worst=True))
    saves = result.get("saves")
    if saves and len(saves["rss"]) >= 3:
        settle = min(4, len(saves["rss"]) - 1)
        growth = (saves["rss"][-1] - saves["rss"][settle]) / _MiB
        limit = max(16.0, config.saves_mb * 0.02)
        targets.append(target_row(f"RSS growth over {len(saves['rss'])} async saves, MiB",
                               [growth], "<=", limit,
                               f"from save {settle + 1} on; limit max(16 MiB, 2% of state)"))
        times = saves["save_s"]
        early = times[settle:settle + 10]
        late = times[-10:]
        targets.append(target_row("save time, last 10 saves / 10 after the first 5",
                               [statistics.median(late) / statistics.median(early)], "<=",
                               1.2, "flat time over consecutive saves (medians)"))
        if saves.get("floor_s"):
            ratios = [a / b for a, b in zip(times, saves["floor_s"], strict=True)]
            targets.append(target_row(
                "save / raw write floor after it, last 10 saves / 10 after the first 5",
                [statistics.median(ratios[-10:]) / statistics.median(ratios[settle:settle + 10])],
                "<=", 1.2, "the library's drift apart from the disk's (medians of per-save "
                "ratios)"))
    return targets


def format_scale(result: dict[str, Any]) -> str:
    """The human-readable report of ``run_scale``."""
    config = result["config"]
    lines = [(f"jaxckpt bench --scale: states of {config['start_mb']} MiB doubling, leaves "
              f"of {config['leaf_mb']} MiB, {config['repeats']} round(s) per size; "
              f"{result['stopped']}"),
             (f"directory {result['directory']}; load average at start "
              f"{result['load_start']}, end {result['load_end']}"), ""]
    rows = []
    for size in result["sizes"]:
        def cell(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
            values = [v * scale for v in values]
            return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-"
                    f"{max(values):.{digits}f})")

        floor = cell(_per_gib(size, "floor_s")) if size.get("floor_s") else "-"
        rows.append([f"{size['mib']} MiB", cell(_per_gib(size, "save_s")),
                     cell(size["blocking_s"]), cell(_per_gib(size, "restore_s")), floor,
                     cell(size["save_extra"], 1 / _MiB, 0),
                     cell(size["restore_extra"], 1 / _MiB, 0)])
    lines += _columns(rows, ["STATE", "SAVE s/GiB (range)", "ASYNC BLOCKING s",
                             "RESTORE s/GiB", "READ FLOOR s/GiB", "SAVE EXTRA MiB",
                             "RESTORE EXTRA MiB"])
    saves = result.get("saves")
    if saves:
        rss = [round(r / _MiB) for r in saves["rss"]]
        every = max(1, len(rss) // 10)
        lines += ["", (f"{len(rss)} consecutive async saves of {config['saves_mb']} MiB: "
                       f"RSS MiB {rss[::every]}; save s "
                       f"{[round(t, 3) for t in saves['save_s'][::every]]}; raw write "
                       f"floor s {[round(t, 3) for t in saves.get('floor_s', [])[::every]]}")]
    return report(lines, [], result["targets"], target_title="TARGET")
