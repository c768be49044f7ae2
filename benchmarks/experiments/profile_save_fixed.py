"""The fixed cost of a durable sync save: what does not shrink with the bytes.

Saves a small state (``--leaves`` arrays of ``--kib`` KiB each, 1 MiB by default) many
times in one process, sync, and times each save's parts with wrappers around the write
path's functions (this process only): the backend's write (setup, the chunk files, the
rename), and the commit (listing, checksums of the files no writer checksummed plus the
directories' fsyncs, the marker), wall and CPU of the calling thread. With data this small
the save is nearly all fixed cost: the 19 ms per save that a 512 MiB save pays beside its
data (benchmarks/results/save-floor-idle_cpu2core_2026-11-28.md).

    python benchmarks/experiments/profile_save_fixed.py --saves 40

Run it as a script from a checkout: it imports that checkout's jaxckpt. Results:
benchmarks/results/save-floor-fixed_cpu2core_2026-11-28.md.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_spans: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
_lock = threading.Lock()


def _wrap(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            with _lock:
                _spans[label].append((time.perf_counter() - start, time.thread_time() - cpu))

    setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=40)
    parser.add_argument("--leaves", type=int, default=16)
    parser.add_argument("--kib", type=int, default=64)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()

    import jax.numpy as jnp
    import numpy as np

    import jaxckpt
    from jaxckpt.backends.orbax.backend import OrbaxBackend
    from jaxckpt.commit import store
    from jaxckpt.storage import posix

    _wrap(OrbaxBackend, "write", "backend write")
    _wrap(store.CheckpointStore, "commit", "commit")
    _wrap(posix.PosixStorage, "list_files", "commit: list")
    _wrap(store, "_summarise_and_name", "commit: checksums + dir fsyncs")
    _wrap(posix.PosixStorage, "create", "commit: marker")
    rng = np.random.default_rng(0)
    state = {f"w{i}": jnp.asarray(rng.random(args.kib * 256, dtype=np.float32))
             for i in range(args.leaves)}
    work = tempfile.mkdtemp(prefix="fixed-prof-", dir=args.dir)
    totals = []
    with jaxckpt.CheckpointManager(os.path.join(work, "root"), mode="sync",
                                   recover=jaxckpt.RecoverConfig(keep_last_n=2),
                                   preemption_signals=()) as manager:
        for step in range(args.saves + 3):
            if step == 3:  # the first saves: plan, buffers, threads
                _spans.clear()
            report = manager.save(jaxckpt.StepInfo(0, step, step), state)
            if step >= 3:
                totals.append(report.total_s)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{args.saves} sync saves of {args.leaves} x {args.kib} KiB, medians (ms), "
          f"load {os.getloadavg()[0]:.1f}:")
    print(f"  {'save, total':34s} {1e3 * statistics.median(totals):7.2f}")
    for label, spans in _spans.items():
        print(f"  {label:34s} {1e3 * statistics.median(w for w, _ in spans):7.2f}  "
              f"(CPU {1e3 * statistics.median(c for _, c in spans):.2f})")


if __name__ == "__main__":
    main()
