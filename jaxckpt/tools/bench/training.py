"""The "train" rows of ``jaxckpt bench``: a training loop with and without async saves.

Owns: ``train_rows`` (each variant in a fresh Python process, the variants taking turns),
``_train_loop`` (jaxckpt.tools.demo's loop with no checkpoints, jaxckpt's async saves with
either writer, or a raw write + fsync on a thread: the floor), and the child process's side
(``_train_in_process``, ``_train_worker``: the runs as JSON on stdin, the results on stdout).

Must not import at module level: jax, flax, orbax. Concurrency contract: ``train_rows``
waits for every process it starts.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import BenchConfig
from .floors import _raw_write
from .timing import _in_child, _quiet

if TYPE_CHECKING:
    from .rows import _Bench


def train_rows(bench: _Bench) -> None:
    """Each run in its own fresh process (``_train_in_process``), the variants taking
    turns: a user's training process does not hold this benchmark's other states, and
    in one long-lived process the runs inherited its memory churn (on this VM, freed
    memory goes back to the host and costs faults again when reused). With
    ``train_fresh_process=False`` (``--quick``) a round's runs share one process."""
    config = bench.config
    facts: dict[str, Any] = {"sizes": list(config.train_sizes), "batch": config.train_batch,
                             "steps": config.train_steps, "save_every": config.save_every,
                             "process": "a fresh process per run"}
    variants = [("train_plain", "none"), ("train_raw", "raw"), ("train_ckpt", "jaxckpt"),
                ("train_ckpt_orbax_io", "jaxckpt-orbax-io")]
    blocking = []
    if not config.train_fresh_process:
        facts["process"] = "one process for all runs of a round"
    for round_index in range(config.repeats):
        order = variants[::-1] if round_index % 2 else variants
        jobs = [(saver, bench.fresh("train")) for _, saver in order]
        if config.train_fresh_process:
            results = [_train_in_process(config, [job])[0] for job in jobs]
        else:
            results = _train_in_process(config, jobs)
        runs = {key: result for (key, _), result in zip(order, results, strict=True)}
        for key, _ in order:
            bench.result.add(key, runs[key]["loop_s"])
        ckpt = runs["train_ckpt"]
        blocking.append(sum(ckpt["blocking_s"]) / runs["train_plain"]["loop_s"])
        facts.update(state_bytes=ckpt["state_bytes"], saves_per_run=len(ckpt["blocking_s"]))
    plain_s = bench.result.median("train_plain")
    assert plain_s is not None  # added every round above
    facts["step_ms"] = round(1000 * plain_s / max(1, config.train_steps - 1), 2)
    facts["blocking_share_of_loop"] = round(statistics.median(blocking), 4)
    bench.result.facts["train"] = facts


def _train_manager(saver: str, root: str, every: int) -> tuple[Any, Any]:
    """The manager and backend of a "jaxckpt" / "jaxckpt-orbax-io" training run, async saves
    every ``every`` steps; (None, None) for the other savers."""
    if saver not in ("jaxckpt", "jaxckpt-orbax-io"):
        return None, None
    import jaxckpt
    from jaxckpt.backends.orbax.backend import OrbaxBackend

    os.makedirs(root, exist_ok=True)
    backend = OrbaxBackend(native_io=saver == "jaxckpt")
    manager = jaxckpt.CheckpointManager(
        root, recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=every), keep_last_n=1),
        mode="async", preemption_signals=(), backend=backend)
    return manager, backend


def _host_arrays(state: Any) -> list[np.ndarray]:
    """The leaves of a jax state as host arrays, typed PRNG keys as their key data. jax.Arrays
    are immutable: their host views need no copy on CPU."""
    import jax

    leaves = [jax.random.key_data(leaf)
              if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf
              for leaf in jax.tree.leaves(state)]
    return [np.asarray(leaf) for leaf in leaves]


def _train_loop(config: BenchConfig, saver: str, root: str) -> dict[str, Any]:
    """jaxckpt.tools.demo's training loop (the reference MLP with Adam on SyntheticLoader
    batches, the loss fetched every step) with a choice of checkpointing:

    - "none": no checkpoints;
    - "jaxckpt": ``CheckpointManager.maybe_save`` after every step with the state as a
      function (built only when a save is due), async saves every ``save_every`` steps
      (what a user writes);
    - "jaxckpt-orbax-io": the same with ``OrbaxBackend(native_io=False)``: Orbax and
      tensorstore write the arrays, the commit reads them back to checksum them;
    - "raw": every ``save_every`` steps a background thread writes the state's bytes to one
      file and fsyncs it (the least any async checkpoint must do: the floor).

    Times the loop from the end of step 0 (compiled) to the end of the last step, so start-up
    and the final wait for the last save are not counted on either side.
    """
    import concurrent.futures

    from flax import nnx

    import jaxckpt

    from ..demo import build_training

    steps, every = config.train_steps, config.save_every
    loader, model, optimizer, train_step = build_training(
        config.train_sizes, seed=0, batch_size=config.train_batch, steps_per_epoch=steps,
        learning_rate=1e-3)

    manager, backend = _train_manager(saver, root, every)
    writer = None
    pending: concurrent.futures.Future[None] | None = None
    blocking: list[float] = []
    state_bytes = 0
    last_report = None
    os.makedirs(root, exist_ok=True)
    if saver == "raw":
        writer = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def raw_save(arrays: list[np.ndarray], index: int) -> None:
        _raw_write(os.path.join(root, f"state-{index % 2}"), arrays)

    start = 0.0
    try:
        for index in range(steps):
            step = jaxckpt.StepInfo(0, index, index, steps)
            x, y = loader.next_batch()
            float(train_step(model, optimizer, x, y))
            if manager is not None:
                for report in manager.maybe_save(step, lambda: nnx.state((model, optimizer)),
                                                 stateful={"loader": loader}):
                    blocking.append(report.blocking_s)
                    last_report = report
            elif writer is not None and (index + 1) % every == 0:
                began = time.perf_counter()
                if pending is not None:
                    pending.result()  # one save in flight, as the manager does
                arrays = _host_arrays(nnx.state((model, optimizer)))
                state_bytes = sum(a.nbytes for a in arrays)
                pending = writer.submit(raw_save, arrays, index)
                blocking.append(time.perf_counter() - began)
            if index == 0:
                start = time.perf_counter()
        loop_s = time.perf_counter() - start
    finally:
        if manager is not None:
            manager.close()
        if backend is not None:
            backend.close()
        if writer is not None:
            writer.shutdown(wait=True)
    if last_report is not None:
        state_bytes = last_report.bytes or 0  # known once closed: every save committed
    return {"loop_s": loop_s, "blocking_s": blocking, "state_bytes": state_bytes}


_TRAIN_FIELDS = ("train_steps", "train_sizes", "train_batch", "save_every")


def _train_in_process(config: BenchConfig, jobs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """``_train_loop`` run for each (saver, root) of ``jobs`` in turn, in one new Python
    process (same interpreter and environment); the results come back as JSON on the last
    line of its output."""
    job = {"runs": [list(job) for job in jobs],
           "config": {name: getattr(config, name) for name in _TRAIN_FIELDS}}
    savers = ", ".join(saver for saver, _ in jobs)
    return _in_child("jaxckpt.tools.bench.training:_train_worker", job,
                     what=f"the training-loop runs ({savers})")


def _train_worker() -> None:
    """The child side of ``_train_in_process``: a job as JSON on stdin, the result as one
    JSON line on stdout."""
    job = json.load(sys.stdin)
    fields = job["config"]
    fields["train_sizes"] = tuple(fields["train_sizes"])
    config = BenchConfig(**fields)
    with _quiet():
        results = [_train_loop(config, saver, root) for saver, root in job["runs"]]
    print(json.dumps(results), flush=True)
