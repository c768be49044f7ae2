"""``python benchmarks/experiments/first_and_back.py --before DIR``: an older jaxckpt against
this one, side by side, on what a fresh process pays: the first save and first restore with
few and many leaves at equal bytes, and the time back to training after a restart.

Owns: the before/after figures of benchmarks/results/first-save-leaves_cpu2core_2026-11-28.md
and back-to-training_cpu2core_2026-11-28.md. ``DIR`` holds an older ``jaxckpt`` package (e.g.
``git archive <commit> jaxckpt | tar -x -C DIR``). Per round, in a rotated order: the bench's
fresh-process worker (``rows_leaves._first_save_worker``: first save, second save, first
restore by a new manager) for each tree and each leaf count; then, page cache dropped and the
libraries warmed, the bench's restarted training script (``rows_back._TRAIN_SCRIPT``) with
each tree's jaxckpt and with Orbax, and the raw read of the checkpoint's files; with
``--parts cpu``, the first save and restore again with their CPU time (``_CPU_CHILD``).
Medians and ranges as JSON lines on stdout, with each restart's CPU seconds and minor page
faults by phase.

Needs root for the cold reads. Must not import: torch.

A one-off experiment, outside the wheel: run it from the repository root.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(tree: str, code: str, job: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="3")
    # Run in ``tree``: ``python -c`` puts its working directory first on sys.path, so a child
    # started in the repository root imported that jaxckpt whatever PYTHONPATH said.
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(job), env=env,
                          capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _first_rounds(trees: dict[str, str], args: argparse.Namespace, workdir: str,
                  found: dict[str, list[float]]) -> None:
    code = ("from jaxckpt.tools.bench.rows_leaves import _first_save_worker; "
            "_first_save_worker()")
    runs = [(name, count) for name in trees for count in (8, args.many)]
    for round_index in range(args.rounds):
        shift = round_index % len(runs)
        for name, count in runs[shift:] + runs[:shift]:
            root = tempfile.mkdtemp(dir=workdir)
            times = _child(trees[name], code, {"size_mb": args.mib, "leaves": count,
                                               "root": root, "cold": True})
            shutil.rmtree(root)
            for key in ("first_save", "second_save", "first_restore"):
                found.setdefault(f"{key} {name} {count}", []).append(times[key])
        print(f"first: round {round_index + 1} done", file=sys.stderr, flush=True)


#: The CPU-time child: the state built before the clock, then a new manager's first sync save
#: and, page cache dropped, a new manager's first restore; wall and CPU seconds of each (the
#: process's, all threads, and the calling thread's: ``*_main``).
_CPU_CHILD = """
import json, os, shutil, sys, time
job = json.load(sys.stdin)
from jaxckpt.tools.bench.states import _random_bytes, _leaf_arrays, _jax_state, _abstract
import numpy as np
arrays = _leaf_arrays(_random_bytes(job["mib"] << 20, 3), job["leaves"])
import jax, jaxckpt
state = _jax_state([np.array(a) for a in arrays])
del arrays
wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
manager = jaxckpt.CheckpointManager(job["root"], preemption_signals=(), mode="sync",
                                    recover=jaxckpt.RecoverConfig(keep_last_n=1))
manager.save(jaxckpt.StepInfo(0, 1, 1), state).wait()
out = {"save_wall": time.perf_counter() - wall, "save_cpu": time.process_time() - cpu,
       "save_main": time.thread_time() - main}
manager.close()
like = _abstract(state)
del state
os.sync()
with open("/proc/sys/vm/drop_caches", "w") as handle:
    handle.write("3\\n")
wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
with jaxckpt.CheckpointManager(job["root"], preemption_signals=()) as reader:
    jax.block_until_ready(reader.restore(like).state)
out.update(restore_wall=time.perf_counter() - wall, restore_cpu=time.process_time() - cpu,
           restore_main=time.thread_time() - main)
print(json.dumps(out))
"""


def _cpu_rounds(trees: dict[str, str], args: argparse.Namespace, workdir: str,
                found: dict[str, list[float]]) -> None:
    runs = [(name, count) for name in trees for count in (8, args.many)]
    for round_index in range(args.rounds):
        shift = round_index % len(runs)
        for name, count in runs[shift:] + runs[:shift]:
            root = tempfile.mkdtemp(dir=workdir)
            times = _child(trees[name], _CPU_CHILD, {"mib": args.mib, "leaves": count,
                                                     "root": root})
            shutil.rmtree(root)
            for key, seconds in times.items():
                found.setdefault(f"{key} {name} {count}", []).append(seconds)
        for name in trees:  # this round's ratios, many leaves / 8
            for key in ("save_wall", "save_cpu", "save_main", "restore_wall", "restore_cpu",
                        "restore_main"):
                found.setdefault(f"{key} {name} ratio", []).append(
                    found[f"{key} {name} {args.many}"][-1] / found[f"{key} {name} 8"][-1])
        found.setdefault("load", []).append(os.getloadavg()[0])
        print(f"cpu: round {round_index + 1} done", file=sys.stderr, flush=True)


def _back_rounds(trees: dict[str, str], args: argparse.Namespace, workdir: str,
                 found: dict[str, list[float]]) -> None:
    sys.path.insert(0, HERE)
    from jaxckpt.tools.bench import rows_back
    from jaxckpt.tools.bench.floors import _files_under, _raw_read_direct, _read_all
    from jaxckpt.tools.bench.timing import _drop_page_cache, _settle, _timed

    class Bench:  # what rows_back._write_checkpoints needs of the bench
        def __init__(self) -> None:
            from jaxckpt.tools.bench.states import _jax_state, _leaf_arrays, _random_bytes

            self.state = _jax_state(_leaf_arrays(_random_bytes(args.back_mib << 20, 0), 64))
            self.closers: list[Any] = []
            self.count = 0

        def fresh(self, name: str) -> str:
            self.count += 1
            return os.path.join(workdir, f"{name}-{self.count}")

    bench = Bench()
    roots = rows_back._write_checkpoints(bench)
    shapes = [[list(leaf.shape), leaf.dtype.name] for leaf in
              __import__("jax").tree.leaves(bench.state)]
    del bench.state
    files = _files_under(roots["files"])
    runs = [*trees, "orbax", "floor"]
    for round_index in range(args.rounds):
        shift = round_index % len(runs)
        for name in runs[shift:] + runs[:shift]:
            _drop_page_cache()
            subprocess.run([sys.executable, "-c", "import jax, jaxckpt, orbax.checkpoint"],
                           env=dict(os.environ, PYTHONPATH=HERE), check=True,
                           capture_output=True)
            _settle()
            if name == "floor":
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    found.setdefault("back floor", []).append(
                        _timed(lambda: _read_all(pool, _raw_read_direct, files)))
                continue
            who = "orbax" if name == "orbax" else "jaxckpt"
            root = roots["orbax"] if who == "orbax" else roots["jaxckpt"]
            usage: dict[str, tuple[float, int]] = {}
            phases = rows_back._restart(who, root, shapes, trees.get(name), usage)
            for key, seconds in phases.items():
                found.setdefault(f"back {name} {key}", []).append(seconds)
            for key, (cpu, faults) in usage.items():
                found.setdefault(f"back {name} {key} cpu", []).append(cpu)
                found.setdefault(f"back {name} {key} faults", []).append(faults)
        print(f"back: round {round_index + 1} done", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a directory holding an older jaxckpt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=128, help="bytes of the leaf-count states")
    parser.add_argument("--many", type=int, default=10_000)
    parser.add_argument("--back-mib", type=int, default=1024)
    parser.add_argument("--parts", default="first,back",
                        help="of first (the bench's worker), cpu (wall and CPU time), back")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": HERE}
    workdir = os.path.abspath(tempfile.mkdtemp(prefix="first-and-back-", dir=args.dir))
    found: dict[str, list[float]] = {}
    load = [round(os.getloadavg()[0], 2)]
    try:
        if "first" in args.parts:
            _first_rounds(trees, args, workdir, found)
        if "cpu" in args.parts:
            _cpu_rounds(trees, args, workdir, found)
        if "back" in args.parts:
            _back_rounds(trees, args, workdir, found)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    load.append(round(os.getloadavg()[0], 2))
    print(json.dumps({"load_start_end": load}))
    for key, values in found.items():
        print(json.dumps({"row": key, "median": round(statistics.median(values), 3),
                          "range": [round(min(values), 3), round(max(values), 3)],
                          "samples": [round(v, 3) for v in values]}))

if __name__ == "__main__":
    main()
