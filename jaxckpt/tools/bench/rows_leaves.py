"""``jaxckpt bench`` rows about fixed costs: the leaf-count comparison and the first save.

Owns two groups of rows of ``jaxckpt.tools.bench``:

- "leaves": the same bytes (``BenchConfig.leaves_mb``) in 8, 2,048 and 10,000 leaves
  (``leaf_counts``), a sync save and a cold restore of each per round, in turns (the
  order flips every round), so each ratio to the first count is taken side by side.
  What it shows is the cost per leaf, apart from the bytes.
- "first": the first save in a fresh Python process (importing jax and jaxckpt, making the
  manager, thread pools, buffers, the directory tree, jax's first host transfers), then
  the second save the same way, then the first restore by a new manager; one fresh
  process per round for the main state, and one each for the fewest and the most leaves
  of ``leaf_counts`` at equal bytes (what a fresh process pays per leaf).

Must not import: torch. jax and jaxckpt's backend are imported inside the functions (the
child process imports them itself, and times it).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from typing import Any

from .config import _MiB
from .states import _abstract, _jax_state, _leaf_arrays, _random_bytes
from .timing import _drop_page_cache, _settle, _timed

__all__ = ["first_save_rows", "leaves_rows"]


def leaves_rows(bench: Any, round_index: int) -> None:
    """One round of the "leaves" rows (``bench`` is bench._Bench): a sync save, then a cold
    restore, of each leaf count, the counts taking turns."""
    config = bench.config
    states = getattr(bench, "leaf_states", None)
    if states is None:
        data = _random_bytes(config.leaves_mb * _MiB, seed=2)
        states = bench.leaf_states = [_jax_state(_leaf_arrays(data, count))
                                      for count in config.leaf_counts]
        bench.result.nbytes["leaves"] = sum(
            int(leaf["w"].nbytes) for leaf in states[0].values())
    order = list(range(len(states)))
    if round_index % 2:
        order.reverse()
    likes = [_abstract(state) for state in states]
    for index in order:
        name = f"leaves{index}"
        manager = bench.jaxckpt_manager(name)
        if getattr(bench, f"_step_{name}") == 0:  # first save: plans, buffers, directories
            bench.jaxckpt_save(manager, name, states[index], mode="sync")
        report = bench.jaxckpt_save(manager, name, states[index], mode="sync")
        bench.result.add(f"lv_save_{index}", report.total_s)
    for index in order:
        restore = functools.partial(bench.jaxckpt_manager(f"leaves{index}").restore,
                                    likes[index])
        bench.before_read()
        bench.result.add(f"lv_restore_{index}", _timed(restore))


def first_save_rows(bench: Any, round_index: int) -> None:
    """One round of the "first" rows: a fresh process saves the main state twice and
    restores it once; then, taking turns (the order flips every round), one fresh process
    for the fewest and one for the most leaves of ``leaf_counts`` at ``leaves_mb``, each
    saving twice and restoring once the same way."""
    config = bench.config
    job = {"size_mb": config.size_mb, "leaves": config.leaves,
           "root": bench.fresh("first-save"), "cold": bench.cold}
    _settle()
    found = _in_fresh_process(job)
    for key in ("first_import", "first_save", "second_save", "first_restore"):
        bench.result.add(key, found[key])
    runs = [("few", config.leaf_counts[0]), ("many", config.leaf_counts[2])]
    for name, count in runs[::-1] if round_index % 2 else runs:
        job = {"size_mb": config.leaves_mb, "leaves": count, "root": bench.fresh("first-leaves"),
               "cold": bench.cold}
        _settle()
        found = _in_fresh_process(job)
        bench.result.nbytes["leaves"] = found["nbytes"]
        for key in ("first_save", "second_save", "first_restore"):
            bench.result.add(f"{key}_{name}", found[key])


def _in_fresh_process(job: dict[str, Any]) -> dict[str, float]:
    """``_first_save_worker`` in a new Python process (same interpreter, this jaxckpt);
    its result is the JSON on the last line of its output."""
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    inherited = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=package_parent + (os.pathsep + inherited
                                                         if inherited else ""))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    done = subprocess.run(
        [sys.executable, "-c",
         ("from jaxckpt.tools.bench.rows_leaves import _first_save_worker; "
          "_first_save_worker()")],
        input=json.dumps(job), capture_output=True, text=True, check=False, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the first-save run failed with exit code {done.returncode}:\n"
                           + done.stderr[-4000:])
    return json.loads(lines[-1])


def _first_save_worker() -> None:
    """The child side of ``first_save_rows``: a job as JSON on stdin, the times as one JSON
    line on stdout. The state is built from numpy before the clock starts; the clock
    covers what a training script's first save pays."""
    import warnings

    warnings.simplefilter("ignore")
    job = json.load(sys.stdin)
    import numpy as np

    data = _random_bytes(job["size_mb"] * _MiB, seed=3)
    arrays = _leaf_arrays(data, job["leaves"])
    started = time.perf_counter()
    import jax

    import jaxckpt

    imported = time.perf_counter() - started
    state = _jax_state([np.array(a) for a in arrays])
    jax.block_until_ready(state)
    nbytes = sum(int(a.nbytes) for a in arrays)
    del data, arrays

    def manager() -> Any:
        return jaxckpt.CheckpointManager(job["root"],
                                         recover=jaxckpt.RecoverConfig(keep_last_n=1),
                                         mode="sync", preemption_signals=())

    times = {"first_import": imported, "nbytes": nbytes}
    started = time.perf_counter()
    saver = manager()
    saver.save(jaxckpt.StepInfo(0, 1, 1), state).wait()  # committed
    times["first_save"] = time.perf_counter() - started  # the manager's making included
    saver.wait()
    _settle()
    report = saver.save(jaxckpt.StepInfo(0, 2, 2), state)
    report.wait()
    # Its own time, as every save row reports it (not the deletion of the first one).
    times["second_save"] = report.total_s
    saver.close()
    like = _abstract(state)
    del state
    if job["cold"]:
        _drop_page_cache()
    _settle()
    started = time.perf_counter()
    with manager() as reader:
        reader.restore(like)
        times["first_restore"] = time.perf_counter() - started
    print(json.dumps(times), flush=True)
