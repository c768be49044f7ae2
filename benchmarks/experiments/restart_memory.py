"""``python benchmarks/experiments/restart_memory.py save ROOT`` then
``python benchmarks/experiments/restart_memory.py restart ROOT``: what a restarted
process's restore and first donated step cost in CPU, page faults and peak memory.

Owns: the "Memory and the step" table of
benchmarks/results/back-to-training_cpu2core_2026-11-28.md. ``save`` writes the bench's
state (1 GiB in 64 leaves, ``--mib`` to change) with jaxckpt in ``ROOT/ckpt``; ``restart``,
in a fresh process, restores it (a new ``CheckpointManager``), runs one jitted step that
updates every leaf (donated) and prints one JSON line: wall and CPU seconds and minor page
faults of the restore and of the step, the peak RSS, and how many step outputs lie in the
restored arrays' memory. Run it with ``PYTHONPATH=TREE`` (a checkout's root, or a directory
holding an older ``jaxckpt`` package) to say which jaxckpt it measures; it prints the one
it imported.

Must not import: torch. A one-off experiment, outside the wheel.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import jax
import jax.numpy as jnp

import jaxckpt


def _usage() -> tuple[float, float, int]:
    counts = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), counts.ru_utime + counts.ru_stime, counts.ru_minflt


def _since(start: tuple[float, float, int]) -> list[float]:
    now = _usage()
    return [round(now[0] - start[0], 3), round(now[1] - start[1], 3), now[2] - start[2]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["save", "restart"])
    parser.add_argument("root")
    parser.add_argument("--mib", type=int, default=1024)
    args = parser.parse_args()
    job = os.path.join(args.root, "shapes.json")
    checkpoints = os.path.join(args.root, "ckpt")
    if args.what == "save":
        from jaxckpt.tools.bench.states import _jax_state, _leaf_arrays, _random_bytes

        state = _jax_state(_leaf_arrays(_random_bytes(args.mib << 20, 0), 64))
        with jaxckpt.CheckpointManager(checkpoints, preemption_signals=()) as manager:
            manager.save(jaxckpt.StepInfo(0, 1, 1), state, mode="sync")
        with open(job, "w", encoding="utf-8") as stream:
            json.dump([[list(leaf.shape), leaf.dtype.name] for leaf in jax.tree.leaves(state)],
                      stream)
        return
    with open(job, encoding="utf-8") as stream:
        shapes = json.load(stream)
    like = {f"layer_{index:05d}": {"w": jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))}
            for index, (shape, dtype) in enumerate(shapes)}
    start = _usage()
    with jaxckpt.CheckpointManager(checkpoints, preemption_signals=()) as manager:
        state = jax.block_until_ready(manager.restore(like).state)
    out: dict[str, object] = {"jaxckpt": jaxckpt.__file__, "restore": _since(start)}
    inputs = {leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(state)}
    step = jax.jit(lambda tree: jax.tree.map(lambda w: w - 1e-3 * w, tree), donate_argnums=0)
    start = _usage()
    state = jax.block_until_ready(step(state))
    out["step"] = _since(start)
    out["reused"] = len(inputs & {leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(state)})
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    print(json.dumps(out))


if __name__ == "__main__":
    main()
