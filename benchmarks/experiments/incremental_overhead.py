"""``python benchmarks/experiments/incremental_overhead.py [--mib 256] [--rounds 3]
[--mode sync]``: what ``RecoverConfig(incremental=True)`` costs a save when nothing is
frozen (issue 32's target: <= 1.05x a plain save).

Owns: one experiment. Two managers in one process, one plain and one incremental, each with
its own root, save the same state (8 float32 leaves of ``--mib`` MiB in all, every leaf
changed before every save, so the incremental one hashes everything and refers to nothing);
the two alternate within each round (the order flips every round), after one warm-up round
that also gives the incremental manager its base. Per save: wall time of ``save`` until
committed (``mode``: "sync" or "async" then ``wait``), the loop's blocking time, and the
process's CPU time over the save (the extra work itself, less sensitive to a shared
machine's load than wall time). Prints each row and the medians' ratios.

Must not import: torch. A one-off experiment, outside the wheel: run it from a checkout's
root against the installed package.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxckpt

NAMES = ("plain", "incremental")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync")
    parser.add_argument("--dir", default=None, help="where the two roots go (a temp dir)")
    opts = parser.parse_args()
    leaves = 8
    rows = opts.mib * (1 << 20) // leaves // (4 * 1024)
    state = {f"w{i}": jnp.asarray(np.random.default_rng(i).standard_normal((rows, 1024),
                                                                            np.float32))
             for i in range(leaves)}
    bump = jax.jit(lambda tree: jax.tree.map(lambda x: x + 1.0, tree))
    root = tempfile.mkdtemp(dir=opts.dir)
    managers = {name: jaxckpt.CheckpointManager(
        os.path.join(root, name), mode=opts.mode,
        recover=jaxckpt.RecoverConfig(keep_last_n=1, incremental=name == "incremental"))
        for name in NAMES}
    rows_of: dict[str, list[tuple[float, float, float]]] = {name: [] for name in NAMES}
    step = 0
    for round_ in range(opts.rounds + 1):  # round 0 warms up
        for name in NAMES if round_ % 2 == 0 else NAMES[::-1]:
            state = bump(state)
            jax.block_until_ready(state)
            start, cpu_start = time.perf_counter(), time.process_time()
            report = managers[name].save(jaxckpt.StepInfo(global_step=step), state)
            managers[name].wait()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            if round_:
                rows_of[name].append((wall, report.blocking_s, cpu))
            step += 1
    for manager in managers.values():
        manager.close()
    shutil.rmtree(root, ignore_errors=True)
    medians = {}
    for name in NAMES:
        walls, blocks, cpus = zip(*rows_of[name], strict=True)
        medians[name] = (statistics.median(walls), statistics.median(cpus))
        print(f"{name:12} wall s {[round(w, 3) for w in walls]} median {medians[name][0]:.3f}"
              f" | blocking ms {[round(b * 1e3, 1) for b in blocks]}"
              f" | cpu s {[round(c, 3) for c in cpus]} median {medians[name][1]:.3f}")
    walls_ratio = [i[0] / p[0] for i, p in zip(rows_of["incremental"], rows_of["plain"],
                                                 strict=True)]
    print(f"wall ratio per round {[round(r, 3) for r in walls_ratio]}, of medians "
          f"{medians['incremental'][0] / medians['plain'][0]:.3f}; cpu ratio of medians "
          f"{medians['incremental'][1] / medians['plain'][1]:.3f} (+"
          f"{(medians['incremental'][1] - medians['plain'][1]) * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
