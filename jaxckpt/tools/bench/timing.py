"""How a row of ``jaxckpt bench`` is timed: settling before it, cold reads, memory.

Owns: ``_settle`` (collect garbage, hand freed memory back, sync: the previous row's leftovers
are not this row's cost), ``_timed``, ``_drop_page_cache`` (cold reads, root only), host
memory probes (``_rss``, ``_traced_peak``), ``_quiet`` (library warnings are not results),
``_in_child`` (a row measured in a fresh process: a job as JSON in, the result as JSON out),
``_cpu_clock`` (CPU seconds: the process's, the calling thread's) and ``_lowered_threads``
(the CPU seconds of the Python threads started meanwhile, optionally run at a lower CPU
priority: an experiment's switch).

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


def _release_freed_memory() -> None:
    """Hand the memory this process freed back to the system (glibc's ``malloc_trim``;
    nothing elsewhere). Buffers numpy freed stay in malloc's heap, faulted in already
    (often as huge pages, which numpy asks for from 4 MiB on), and the next row's
    ``np.empty`` gets them back without a page fault: a read floor after a row that freed
    as many bytes measured reading into recycled memory, not into new memory, where a
    restore reads into maps of its own (``buffers.fresh_blocks``) and faults every page
    (benchmarks/results/cold-restore-hugepages_cpu2core_2026-11-25.md)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return
    trim(0)


def _settle() -> None:
    """Before a timed row: the previous row's garbage, freed memory, dirty pages and the
    discards of the files it deleted (ext4 -o discard) are not this row's cost."""
    gc.collect()
    _release_freed_memory()
    os.sync()


def _host_copies(arrays: list[Any]) -> list[np.ndarray]:
    return [np.array(a, copy=True) for a in arrays]


def _timed(action: Callable[[], Any], *, settle: bool = True) -> float:
    """Seconds ``action`` takes; first a settle (collect, hand freed memory back) unless
    ``settle`` is false (the object-store rows time without one)."""
    if settle:
        _settle()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _drop_page_cache() -> bool:
    """Write back dirty pages and evict the page cache (root only), so a read comes from
    the disk. False when the kernel refuses (not root, or a container)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _traced_peak(action: Callable[[], Any]) -> int:
    """Peak bytes of Python and numpy allocations made during ``action`` (numpy reports its
    buffers to tracemalloc; RSS cannot show a peak that reuses freed memory)."""
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _status_bytes(field: str) -> int:
    """A size line of /proc/self/status ("VmRSS", "VmHWM"), in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def _rss_peak_growth(action: Callable[[], Any]) -> int | None:
    """Peak growth of this process's resident memory during ``action``, in bytes: after a
    settle (freed memory handed back, so a new buffer must fault in pages), the kernel's
    high-water mark is reset (``clear_refs`` 5) and the peak read back (``VmHWM``) minus the
    resident size before. Counts every allocator (torch's tensors, which tracemalloc does not
    see) and every thread, and the exact peak rather than a sampled one. None where the
    kernel lacks either file."""
    _settle()
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5\n")
        before = _status_bytes("VmRSS")
    except OSError:
        return None
    action()
    return max(0, _status_bytes("VmHWM") - before)



@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Library warnings (DCP's single-process notice, Orbax deprecations) are not results."""
    import logging

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = logging.getLogger("absl").level
        logging.getLogger("absl").setLevel(logging.ERROR)
        try:
            yield
        finally:
            logging.getLogger("absl").setLevel(previous)


def _in_child(entry: str, job: Any, *, what: str,
              env: dict[str, str] | None = None) -> Any:
    """Run ``entry`` ("module:function", a worker reading ``job`` as JSON on stdin and
    printing its result as the last line of stdout) in a fresh Python process of this
    interpreter that imports this very jaxckpt, installed or not; ``env`` adds variables.
    Raises RuntimeError naming ``what`` with the child's stderr when it fails."""
    module, function = entry.split(":")
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    inherited = os.environ.get("PYTHONPATH")
    child_env = dict(os.environ, **(env or {}),
                     PYTHONPATH=package_parent + (os.pathsep + inherited if inherited else ""))
    done = subprocess.run([sys.executable, "-c", f"from {module} import {function}; {function}()"],
                          input=json.dumps(job), capture_output=True, text=True, check=False,
                          env=child_env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed with exit code {done.returncode}:\n"
                           f"{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def _cpu_clock() -> tuple[float, float]:
    """(CPU seconds of the whole process, of the calling thread): all threads together, and
    the training thread alone; the difference is every other thread's (the save's
    background threads, and the framework's own, such as torch's intra-op pool)."""
    return time.process_time(), time.thread_time()


class _ThreadCpu:
    """CPU seconds of the Python threads started under ``_lowered_threads``: the ones that
    ended (their own ``thread_time`` at the end) and the live ones (Linux's per-thread
    ``/proc/self/task/<id>/stat``; elsewhere only the ended ones count)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._ended = 0.0
        self._live: set[int] = set()

    def spent(self) -> float:
        """CPU seconds so far, all of those threads together."""
        with self._lock:
            total, live = self._ended, list(self._live)
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        for native in live:
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/self/task/{native}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        return total

    def run(self, bootstrap: Callable[[], None], native: int) -> None:
        with self._lock:
            self._live.add(native)
        try:
            bootstrap()
        finally:
            with self._lock:
                self._live.discard(native)
                self._ended += time.thread_time()


@contextlib.contextmanager
def _lowered_threads(nice: int | None) -> Iterator[_ThreadCpu]:
    """While open, each Python thread started in this process is counted in the yielded
    ``_ThreadCpu`` and, with ``nice``, first raises its own nice value to it (Linux: per
    thread), so that it runs only where the training thread and its pools leave a core
    idle. Threads of native pools (torch's, XLA's) are neither counted nor changed."""
    import threading

    ledger = _ThreadCpu()
    bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def lowered(self: Any) -> None:
        native = threading.get_native_id()
        if nice is not None and hasattr(os, "setpriority"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, native, nice)
        ledger.run(lambda: bootstrap(self), native)

    threading.Thread._bootstrap_inner = lowered  # type: ignore[attr-defined]
    try:
        yield ledger
    finally:
        threading.Thread._bootstrap_inner = bootstrap  # type: ignore[attr-defined]
