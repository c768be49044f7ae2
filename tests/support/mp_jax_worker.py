"""One process of a small sharded JAX training run, for the multi-process kill trials
(tests/system/test_multiprocess_kill.py) and the restores at another process count.

Run as ``python tests/support/mp_jax_worker.py --index I --count N --port P --root R --log L
--final F --steps S ...``: with ``--count 2`` two such processes join through
``jax.distributed`` on 127.0.0.1 (2 CPU devices each), with ``--count 1`` one process runs
alone on 2 devices. The state is sharded over every device of the run: a weight matrix
(rows split across processes), a replicated bias, a momentum of each, a step counter and a
typed PRNG key (dropout). Each process feeds its own slice of every global batch from its own
loader (a stateful object with a position) plus noise from its own NumPy and Python RNGs, so
an exact resume needs the arrays, the key, each process's loader position and each
process's global RNG states.

Kill points and the audit come from the environment (``kill_points``, installed on the
manager). Stdout, one ``os.write`` per line:

    FRESH | RESUMED {"step": S}    at start
    STEP n                         step n finished (its loss is in the log, fsynced)
    REPORTED n COMMITTED|MISSING   on_report of the save of step n, with whether the
                                   commit marker existed when this process heard of it
    DONE                           the final state is written

``--reference-root`` runs the uninterrupted reference first in the same processes (without
the kill point), logging to ``{log}.reference`` and ``{final}.reference.npz``.
``--root`` may be an ``s3://`` or ``gs://`` URL, its client configured by
``--storage-options`` (JSON); the reference root is a local path.

Log: one JSON line per step, ``{"step": n, "loss": float.hex(loss)}`` (the loss is global:
the same on every process). Final: ``{final}`` (.npz of every leaf, gathered whole, key data
as ``...|key_data``), written by every process.
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import random
import sys
import traceback
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kill_points
from worker_lines import claim_stdout, emit

GLOBAL_BATCH = 8
FEATURES = 4
ROWS = 8
STEPS_PER_EPOCH = 5



class Loader:
    """This process's slice of each global batch; its position is its whole state."""

    def __init__(self, index: int, count: int):
        self.index, self.count, self.position = index, count, 0

    def next_batch(self) -> np.ndarray:
        local = GLOBAL_BATCH // self.count
        ids = self.position * GLOBAL_BATCH + self.index * local + np.arange(local)
        self.position += 1
        rows = np.sin(ids[:, None] * 0.37 + np.arange(FEATURES)[None, :] * 1.3)
        noise = 0.01 * np.random.random() + 0.01 * random.random()  # per-process global RNGs
        return (rows + noise).astype(np.float32)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def build(jax: Any, mesh: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The initial state and the sharding of each of its leaves."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    rows, replicated = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    w = np.linspace(-1.0, 1.0, ROWS * FEATURES, dtype=np.float32).reshape(ROWS, FEATURES)
    shardings = {"params": {"w": rows, "b": replicated}, "momentum": {"w": rows, "b": replicated},
                 "count": replicated, "key": replicated}

    def put(value: np.ndarray, sharding: Any) -> Any:
        return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

    state = {"params": {"w": put(w, rows), "b": put(np.zeros(FEATURES, np.float32), replicated)},
             "momentum": {"w": put(np.zeros_like(w), rows),
                          "b": put(np.zeros(FEATURES, np.float32), replicated)},
             "count": put(np.zeros((), np.int32), replicated),
             "key": jax.random.wrap_key_data(put(np.asarray(jax.random.key_data(
                 jax.random.key(7))), replicated))}
    return state, shardings


def make_step(jax: Any, shardings: dict[str, Any], replicated: Any) -> Any:
    import jax.numpy as jnp

    def loss_fn(params: Any, x: Any, key: Any) -> Any:
        h = x @ params["w"].T + params["b"].sum()
        keep = jax.random.bernoulli(key, 0.8, h.shape)
        return jnp.mean(jnp.where(keep, h - 0.5, 0.0) ** 2)

    def step(state: Any, x: Any) -> Any:
        key, sub = jax.random.split(state["key"])
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, sub)
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, state["momentum"], grads)
        params = jax.tree.map(lambda p, m: p - 0.05 * m, state["params"], momentum)
        return {"params": params, "momentum": momentum, "count": state["count"] + 1,
                "key": key}, loss

    return jax.jit(step, out_shardings=(shardings, replicated))


def final_arrays(jax: Any, state: Any) -> dict[str, np.ndarray]:
    from jax.experimental import multihost_utils

    def whole(array: Any) -> np.ndarray:
        if array.is_fully_addressable:
            return np.asarray(array)
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            out[name + "|key_data"] = whole(jax.random.key_data(leaf))
        else:
            out[name] = whole(leaf)
    return out


def setup(opts: argparse.Namespace) -> Any:
    """jax on 2 CPU devices, joined to the other processes; returns the jax module."""
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    if opts.count > 1:
        jax.distributed.initialize(f"127.0.0.1:{opts.port}", num_processes=opts.count,
                                   process_id=opts.index, initialization_timeout=60,
                                   heartbeat_timeout_seconds=10, shutdown_timeout_seconds=60)
    return jax


def train(jax: Any, opts: argparse.Namespace, root: str, log_path: str, final: str,
          environ: dict[str, str]) -> None:
    """Train to ``opts.steps`` from the latest checkpoint under ``root`` (or from scratch)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import jaxckpt
    from jaxckpt.core.layout import COMMIT_MARKER

    random.seed(100 + opts.index)
    np.random.seed(200 + opts.index)
    # Auto axes: XLA places the collectives (explicit axes refuse x @ w.T with both sharded).
    mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(AxisType.Auto,))
    replicated = NamedSharding(mesh, P())
    state, shardings = build(jax, mesh)
    like = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        state, shardings)
    train_step = make_step(jax, shardings, replicated)
    batch_sharding = NamedSharding(mesh, P("x"))
    loader = Loader(opts.index, opts.count)

    def reported(report: Any) -> None:
        # Through the root's own storage: the root may be an s3:// or gs:// URL.
        marker = mgr.store.storage.exists(posixpath.join(report.path, COMMIT_MARKER))
        emit(f"REPORTED {report.step} {'COMMITTED' if marker else 'MISSING'}")

    config = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=opts.save_every),
                                   keep_last_n=opts.keep_last_n)
    remote = opts.storage_options if "://" in root else None
    mgr = jaxckpt.CheckpointManager(root, recover=config, mode=opts.mode,
                                    on_report=reported, preemption_signals=(),
                                    commit_timeout_s=120, storage_options=remote)
    kill_points.install(mgr, environ)
    with mgr, open(log_path, "a") as log:
        recovered = mgr.recover(like, stateful={"loader": loader})
        if recovered is None:
            step, last = jaxckpt.StepInfo(0, 0, 0, STEPS_PER_EPOCH), None
            emit("FRESH")
        else:
            state, last = recovered.state, recovered.step_info
            step = last.next()
            emit("RESUMED " + json.dumps({"step": last.global_step}))
        while step.global_step < opts.steps:
            x = jax.make_array_from_process_local_data(batch_sharding, loader.next_batch())
            state, loss = train_step(state, x)
            log.write(json.dumps({"step": step.global_step, "loss": float(loss).hex()}) + "\n")
            log.flush()
            os.fsync(log.fileno())
            emit(f"STEP {step.global_step}")
            mgr.maybe_save(step, state)
            last, step = step, step.next()
        if last is not None:
            mgr.save(last, state)  # no-op when that step was just saved or restored
    arrays = final_arrays(jax, state)
    with open(final + ".partial", "wb") as handle:
        np.savez(handle, **arrays)
    os.replace(final + ".partial", final)


def run(opts: argparse.Namespace) -> None:
    jax = setup(opts)
    if opts.reference_root:  # the uninterrupted run first, in the same processes
        quiet = {k: v for k, v in os.environ.items() if k != "JAXCKPT_KILL_POINT"}
        train(jax, opts, opts.reference_root, opts.log + ".reference",
              opts.final + ".reference.npz", quiet)
        emit("REFERENCE DONE")
    train(jax, opts, opts.root, opts.log, opts.final, dict(os.environ))
    if opts.count > 1:
        # Leave together: process 0 hosts the coordination service, and a process still
        # connected to it when process 0 exits aborts if it lags by more than about 0.1 s.
        # shutdown() waits for every process and disconnects each before any exits.
        jax.distributed.shutdown()
    emit("DONE")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--root", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--keep-last-n", type=int, default=1)
    parser.add_argument("--mode", choices=("sync", "async"), default="async")
    parser.add_argument("--storage-options", type=json.loads, default=None,
                        help="JSON storage_options of an s3:// or gs:// --root")
    parser.add_argument("--reference-root", help="first run uninterrupted under this root "
                        "(no kill point; log and final get a .reference suffix)")
    opts = parser.parse_args(argv)
    try:
        run(opts)
    except BaseException:  # noqa: BLE001 - any failure: report it and leave at once
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # never wait in a collective or jax's shutdown barrier after a failure
    os._exit(0)


if __name__ == "__main__":
    claim_stdout()
    main(sys.argv[1:])
