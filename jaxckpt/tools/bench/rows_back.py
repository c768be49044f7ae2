"""``jaxckpt bench`` rows of the "back" section: time back to training after a restart.

Owns: ``back_rows`` (one round: a checkpoint of the bench's state written once by jaxckpt's
``CheckpointManager`` and once by Orbax's ``ocp.CheckpointManager``; then, taking turns, a
fresh Python process for each that imports jax, builds the state's shapes, restores and runs
one jitted training step; then the raw read of jaxckpt's files beside them: the floor) and the
child (``_TRAIN_SCRIPT``), which stamps each phase on the system's monotonic clock so the
parent can split the whole time into start, imports, building, restore and first step.

Must not import: torch. jax, jaxckpt's manager and orbax are imported inside the functions
(the child imports them itself, and times it).

Concurrency contract: called from the benchmark's one thread; it waits for every process it
starts and writes only under the bench's directory.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from .config import _READ_THREADS
from .floors import _direct_refused, _files_under, _raw_read, _raw_read_direct, _read_all
from .timing import _quiet, _settle, _timed

__all__ = ["BACK_PHASES", "back_rows"]

#: The phases of a child, in order: (suffix of the row key, what the child did).
BACK_PHASES: tuple[tuple[str, str], ...] = (
    ("start", "interpreter start"), ("imports", "imports"),
    ("build", "building the state's shapes"),
    ("restore", "manager made + restore"), ("step", "compile + first step"))


def back_rows(bench: Any) -> None:
    """One round of the "back" rows (``bench`` is bench._Bench): both checkpoints written
    on the first round, then the two restarts and the read floor in turns (the order flips
    every round)."""
    from jax.tree_util import tree_leaves as jax_leaves

    roots = getattr(bench, "back_roots", None)
    if roots is None:
        roots = bench.back_roots = _write_checkpoints(bench)
    files = _files_under(roots["files"])
    if bench.direct_refused is None:
        bench.direct_refused = _direct_refused(bench.workdir)
    shapes = [[list(leaf.shape), leaf.dtype.name] for leaf in jax_leaves(bench.state)]
    bare = _raw_read_direct if bench.direct_refused == "" else _raw_read
    turns = [("jaxckpt", roots["jaxckpt"]), ("orbax", roots["orbax"]), ("floor", "")]
    bench.back_turn = getattr(bench, "back_turn", -1) + 1
    for who, root in turns[::-1] if bench.back_turn % 2 else turns:
        bench.before_read()
        _warm_libraries()
        if who == "floor":
            with concurrent.futures.ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
                bench.result.add("back_floor", _timed(lambda: _read_all(pool, bare, files)))
            continue
        _settle()
        phases = _restart(who, root, shapes)
        for key, seconds in phases.items():
            bench.result.add(f"back_{who}_{key}", seconds)


def _write_checkpoints(bench: Any) -> dict[str, str]:
    """The bench's state saved by each library, every option at its default; the path of
    jaxckpt's array files (the floor reads them)."""
    import orbax.checkpoint as ocp

    import jaxckpt
    from jaxckpt.core.layout import STATE_DIR

    roots = {"jaxckpt": bench.fresh("back-jaxckpt"), "orbax": bench.fresh("back-orbax")}
    with jaxckpt.CheckpointManager(roots["jaxckpt"], preemption_signals=(),
                                   recover=jaxckpt.RecoverConfig(keep_last_n=1)) as manager:
        report = manager.save(jaxckpt.StepInfo(0, 1, 1), bench.state, mode="sync")
    with _quiet():
        orbax = ocp.CheckpointManager(roots["orbax"])
        try:
            orbax.save(1, args=ocp.args.StandardSave(bench.state))
            orbax.wait_until_finished()
        finally:
            orbax.close()

    def remove() -> None:
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)

    bench.closers.append(remove)
    return {**roots, "files": os.path.join(report.path, STATE_DIR)}


def _child_env(package_parent: str | None = None) -> dict[str, str]:
    """This interpreter's environment with this very jaxckpt (or the one in
    ``package_parent``) first on the path."""
    package_parent = package_parent or os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))))
    inherited = os.environ.get("PYTHONPATH")
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                PYTHONPATH=package_parent + (os.pathsep + inherited if inherited else ""))


def _warm_libraries() -> None:
    """Import what both children import in a throwaway process: after the page cache was
    dropped, the libraries' files come back into it, the checkpoints' files do not. A
    restarted job on the same machine finds its libraries cached; its checkpoint may not be."""
    subprocess.run([sys.executable, "-c", "import jax, jaxckpt, orbax.checkpoint"],
                   env=_child_env(), check=True, capture_output=True)


def _restart(who: str, root: str, shapes: list[list[Any]],
             package_parent: str | None = None,
             usage: dict[str, tuple[float, int]] | None = None) -> dict[str, float]:
    """A fresh process restoring from ``root`` with ``who``'s manager to its first step
    done (``_TRAIN_SCRIPT``): the seconds of each phase (``BACK_PHASES``) and "total", from
    the moment before the process is started. ``package_parent``: where the child imports
    jaxckpt from (None: this one; benchmarks/experiments/first_and_back.py compares).
    ``usage``, where given, gets each phase after "start" as (CPU seconds of all the
    child's threads, minor page faults): figures that the machine's load changes little."""
    job = {"who": who, "root": root, "shapes": shapes}
    started = time.monotonic()
    # Run in ``package_parent``: ``python -c`` puts the working directory ahead of
    # PYTHONPATH, so a jaxckpt there (a checkout's root) would be imported instead.
    done = subprocess.run([sys.executable, "-c", _TRAIN_SCRIPT], input=json.dumps(job),
                          capture_output=True, text=True, check=False,
                          env=_child_env(package_parent), cwd=package_parent)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {who} restart failed with exit code {done.returncode}:\n"
                           + done.stderr[-4000:])
    stamps = json.loads(lines[-1])
    marks = [started] + [stamps[key] for key, _ in BACK_PHASES]
    phases = {key: marks[index + 1] - marks[index]
              for index, (key, _) in enumerate(BACK_PHASES)}
    phases["total"] = marks[-1] - started
    if usage is not None:
        counts = stamps["usage"]
        for (before, _), (key, _) in zip(BACK_PHASES, BACK_PHASES[1:], strict=False):
            usage[key] = (counts[key][0] - counts[before][0], counts[key][1] - counts[before][1])
    return phases


#: The restarted training script, run with ``python -c``: it imports only what a user's
#: script would (jax and one of the two libraries, not this bench), reads its job (which
#: library, the root, the state's shapes as the model code would give them) as JSON on
#: stdin, and prints the monotonic time at the end of each phase as one JSON line.
_TRAIN_SCRIPT = """
import json, resource, sys, time
stamps = {"start": time.monotonic(), "usage": {}}
def used(phase):
    counts = resource.getrusage(resource.RUSAGE_SELF)
    stamps["usage"][phase] = [counts.ru_utime + counts.ru_stime, counts.ru_minflt]
used("start")
job = json.load(sys.stdin)
import jax
import jax.numpy as jnp
if job["who"] == "orbax":
    import orbax.checkpoint as ocp
else:
    import jaxckpt
stamps["imports"] = time.monotonic()
used("imports")
like = {f"layer_{i:05d}": {"w": jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))}
        for i, (shape, dtype) in enumerate(job["shapes"])}
stamps["build"] = time.monotonic()
used("build")
if job["who"] == "orbax":
    manager = ocp.CheckpointManager(job["root"])
    state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(like))
else:
    manager = jaxckpt.CheckpointManager(job["root"], preemption_signals=())
    state = manager.restore(like).state
jax.block_until_ready(state)
stamps["restore"] = time.monotonic()
used("restore")
step = jax.jit(lambda s: jax.tree.map(lambda w: w - 1e-3 * w, s), donate_argnums=0)
jax.block_until_ready(step(state))
stamps["step"] = time.monotonic()
used("step")
print(json.dumps(stamps), flush=True)
manager.close()
"""
