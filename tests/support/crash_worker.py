"""A tiny pure-JAX training worker for the crash-consistency harness
(tests/system/test_crash_harness.py).

Run as ``python tests/support/crash_worker.py --root R --log L --steps N ...`` (R may be an
``s3://`` or ``gs://`` URL; ``--storage-options JSON`` then configures the client and the
lease). It
trains a two-layer MLP with a hand-written Adam on ``jaxckpt.tools.demo.SyntheticLoader``
batches, with dropout drawn from a typed JAX PRNG key and a per-step noise scale drawn from
Python's and NumPy's global RNGs (so an exact resume needs the arrays, the key, the loader
position AND both global RNG states). ``--ballast K`` adds K extra array leaves, updated
every step, that make each save write many more files: the background write, the commit pass
(checksum + fsync per file) and retention deletion then take long enough for a randomly timed
SIGKILL to land inside them.
The ballast changes the state tree, so a reference run must use the same ``--ballast``; the
save mode does not change numerics (a chain may switch it between segments).
``--slow K`` adds K leaves that change once every ``SLOW_EVERY`` steps (loss untouched);
``--incremental`` saves with ``RecoverConfig(incremental=True)``, so those leaves are
referred to by later checkpoints, whose retention then retires and purges their owners.

Stdout protocol, one line each, written with a single ``os.write`` so lines from the
training thread and the manager's background thread never interleave:

    FRESH | RESUMED {"step": S, "tier": T}   at start (S: the checkpoint restored, T: from
                                   which tier, "durable" or "local")
    STEP n                         step n finished; its loss is in the log file (fsynced)
    SAVING n                       maybe_save after step n started a recovery checkpoint
    WRITTEN n                      the backend's write of step n finished: the commit starts
    REPORTED n                     on_report: the save of step n committed (retention follows)
    DONE                           the run finished and its final state .npz is written

With ``--local PATH`` (a fast local tier, ``jaxckpt.LocalTier(PATH, every=Every(steps=
--local-every), keep_last_n=--local-keep-last-n)``) saves to that tier are announced as
``SAVING_LOCAL n`` and ``REPORTED_LOCAL n`` instead.

``--kill-point P --kill-step S`` makes the worker SIGKILL itself at an exact point of the save
of step S, from inside (a kill by the harness at a stdout line lands some time after it):
``uploading`` once the first array object of S is stored (the others are still being
written), ``marker`` when the commit, every file uploaded and checksummed and the manifest
built, is about to create the marker (nothing of it sent). It announces ``DYING P S`` first.
Two points land inside retention of incremental checkpoints, at the first such removal
of the run (``--kill-step`` is not used; S in ``DYING`` is the step removed), with
``--kill-fraction F`` (0 to 1) placing it: ``retire`` while a step that later checkpoints
still refer to is retired (F < 0.2: right after its ``RETIRED`` marker is written, its
``COMMITTED`` still there; else once that fraction of its unreferenced files is deleted),
``purge`` while a retired step is tidied or purged once its referrers went (that fraction
of the files it deletes gone).

Log file: one JSON line per finished step, ``{"step": n, "loss": float.hex(loss)}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import threading
from typing import Any

import numpy as np
from worker_lines import claim_stdout, emit  # a sibling: workers run by path

HIDDEN = 16
IN_DIM = 8
BATCH = 8
STEPS_PER_EPOCH = 7  # small and odd: epochs roll over mid-run and between save steps
SLOW_EVERY = 12  # the --slow leaves change once per this many steps



def seam_backend(incremental: bool = False) -> Any:
    """An Orbax backend that announces ``WRITTEN n`` when the write of step ``n`` is finished
    (the seam between the background write and the commit). Numerics untouched; every
    other member and feature is the Orbax backend's own. Plain: the commit reads every file
    back, as for any backend; ``incremental``: the write's checksums (with the content
    hashes the next save compares) and references go to the commit."""
    from jaxckpt.backends.orbax.backend import OrbaxBackend

    class SeamBackend(OrbaxBackend):
        def __init__(self) -> None:
            # Incremental: every leaf a file of its own (small leaves are packed together
            # otherwise, and a pack holding a changed leaf is written whole).
            super().__init__(**({"pack_leaf_bytes": 0} if incremental else {}))

        def write(self, directory: str, state: Any, *, asynchronous: bool,
                  base: Any = None) -> Any:
            handle = super().write(directory, state, asynchronous=asynchronous, base=base)
            match = re.search(r"step_(\d+)", directory)
            step = int(match.group(1)) if match else -1

            class Announcing:
                checksums = None
                references = None

                def wait(self) -> None:
                    handle.wait()
                    if incremental:
                        self.checksums, self.references = handle.checksums, handle.references
                    emit(f"WRITTEN {step}")

            return Announcing()

    return SeamBackend()


def install_kill(mgr: Any, point: str, step: int) -> None:
    """SIGKILL this process at ``point`` of the save of ``step`` (module docstring), by
    wrapping the root storage's ``write`` or ``create`` (the arrays go through the same
    storage object as the commit)."""
    storage = mgr.store.storage
    step_dir = f"step_{step:08d}"

    def die() -> None:
        emit(f"DYING {point} {step}")
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "uploading":
        write = storage.write

        def dying_write(path: str, data: Any) -> None:
            write(path, data)
            if step_dir in path and "/state/" in path:
                die()

        storage.write = dying_write
    else:
        create = storage.create

        def dying_create(path: str, data: bytes) -> None:
            if step_dir in path and path.rstrip("/").endswith("/COMMITTED"):
                die()
            create(path, data)

        storage.create = dying_create


def install_retention_kill(mgr: Any, point: str, fraction: float) -> None:
    """SIGKILL this process inside retention (``retire`` or ``purge``: module docstring), by
    wrapping ``jaxckpt.commit.retire``'s ``sweep`` (purge) and file deletion, and the root
    storage's ``write`` and ``delete_prefix``."""
    from jaxckpt.commit import retire

    storage = mgr.store.storage
    sweeping = threading.local()

    def in_sweep() -> bool:
        return bool(getattr(sweeping, "on", False))

    def die(path: str) -> None:
        match = re.search(r"step_(\d+)", path)
        emit(f"DYING {point} {int(match.group(1)) if match else -1}")
        os.kill(os.getpid(), signal.SIGKILL)

    sweep, delete_files = retire.sweep, retire._delete_files
    write, delete_prefix = storage.write, storage.delete_prefix

    def watched_sweep(*args: Any, **kwargs: Any) -> Any:
        sweeping.on = True
        try:
            return sweep(*args, **kwargs)
        finally:
            sweeping.on = False

    def dying_delete_files(store: Any, path: str, rels: tuple[str, ...]) -> None:
        if (point == "purge") == in_sweep():
            cut = int(len(rels) * fraction)
            delete_files(store, path, rels[:cut])
            die(path)
        delete_files(store, path, rels)

    def dying_write(path: str, data: Any) -> None:
        write(path, data)
        if point == "retire" and fraction < 0.2 and path.endswith("/RETIRED") \
                and not in_sweep():
            die(path)

    def dying_delete_prefix(path: str) -> Any:
        if point == "purge" and in_sweep():
            files = sorted(storage.list_files(path))
            for rel in files[:int(len(files) * fraction)]:
                storage.delete(os.path.join(path, *rel.split("/")))
            die(path)
        return delete_prefix(path)

    retire.sweep, retire._delete_files = watched_sweep, dying_delete_files
    storage.write, storage.delete_prefix = dying_write, dying_delete_prefix


def build_state(seed: int, ballast: int, slow: int = 0) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "w1": jax.random.normal(k1, (IN_DIM, HIDDEN), jnp.float32) * 0.3,
        "b1": jnp.zeros((HIDDEN,), jnp.float32),
        "w2": jax.random.normal(k2, (HIDDEN, 1), jnp.float32) * 0.3,
        "b2": jnp.zeros((1,), jnp.float32),
    }
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {
        "params": params,
        "opt": {"m": zeros, "v": jax.tree.map(jnp.zeros_like, params),
                "count": jnp.zeros((), jnp.int32)},
        "key": jax.random.key(seed + 1),
        "ballast": [jnp.full((2048,), float(i), jnp.float32) for i in range(ballast)],
        **({"slow": [jnp.full((2048,), -float(i), jnp.float32) for i in range(slow)]}
           if slow else {}),
    }


def make_step():
    import jax
    import jax.numpy as jnp

    def loss_fn(params, x, y, key, scale):
        h = jax.nn.gelu(x @ params["w1"] + params["b1"])
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        h = jnp.where(keep, h / 0.9, 0.0)
        pred = h @ params["w2"] + params["b2"]
        return jnp.mean((pred - y) ** 2) * scale

    @jax.jit
    def step(state, x, y, scale):
        key, sub = jax.random.split(state["key"])
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y, sub, scale)
        opt = state["opt"]
        count = opt["count"] + 1
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, opt["m"], grads)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["v"], grads)
        t = count.astype(jnp.float32)
        params = jax.tree.map(
            lambda p, m, v: (p - 0.01 * (m / (1 - 0.9 ** t))
                             / (jnp.sqrt(v / (1 - 0.999 ** t)) + 1e-8)),
            state["params"], m, v)
        ballast = [b * 0.5 + loss * (i + 1) for i, b in enumerate(state["ballast"])]
        out = {"params": params, "opt": {"m": m, "v": v, "count": count}, "key": key,
               "ballast": ballast}
        if "slow" in state:  # unchanged for SLOW_EVERY steps at a time
            bump = jnp.where(count % SLOW_EVERY == 0, 1.0, 0.0).astype(jnp.float32)
            out["slow"] = [s + bump for s in state["slow"]]
        return out, loss

    return step


def final_arrays(state: dict[str, Any]) -> dict[str, np.ndarray]:
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            out[name + "|key_data"] = np.asarray(jax.random.key_data(leaf))
        else:
            out[name] = np.asarray(leaf)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--keep-last-n", type=int, default=2)
    parser.add_argument("--mode", choices=("sync", "async"), default="async")
    parser.add_argument("--ballast", type=int, default=0)
    parser.add_argument("--slow", type=int, default=0)
    parser.add_argument("--incremental", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local", default=None)
    parser.add_argument("--local-every", type=int, default=2)
    parser.add_argument("--local-keep-last-n", type=int, default=1)
    parser.add_argument("--storage-options", type=json.loads, default=None,
                        help="JSON storage_options for a URL root (e.g. a short lease)")
    parser.add_argument("--kill-point", choices=("uploading", "marker", "retire", "purge"),
                        default=None)
    parser.add_argument("--kill-step", type=int, default=None)
    parser.add_argument("--kill-fraction", type=float, default=0.0)
    opts = parser.parse_args(argv)

    import jax

    import jaxckpt
    from jaxckpt.tools.demo import SyntheticLoader

    random.seed(opts.seed)
    np.random.seed(opts.seed)
    loader = SyntheticLoader(seed=opts.seed, batch_size=BATCH, steps_per_epoch=STEPS_PER_EPOCH,
                             in_dim=IN_DIM)
    state = build_state(opts.seed, opts.ballast, opts.slow)
    train_step = make_step()
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)

    local = None if opts.local is None else jaxckpt.LocalTier(
        opts.local, every=jaxckpt.Every(steps=opts.local_every),
        keep_last_n=opts.local_keep_last_n)

    def tag(report: Any) -> str:
        return "_LOCAL" if report.tier == "local" else ""

    mgr = jaxckpt.CheckpointManager(
        opts.root, local=local,
        recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=opts.save_every),
                                      keep_last_n=opts.keep_last_n,
                                      incremental=opts.incremental),
        mode=opts.mode, backend=seam_backend(opts.incremental),
        on_report=lambda report: emit(f"REPORTED{tag(report)} {report.step}"),
        preemption_signals=(), storage_options=opts.storage_options)
    if opts.kill_point in ("retire", "purge"):
        install_retention_kill(mgr, opts.kill_point, opts.kill_fraction)
    elif opts.kill_point is not None:
        install_kill(mgr, opts.kill_point, opts.kill_step)
    with mgr, open(opts.log, "a") as log:
        recovered = mgr.recover(like, stateful={"loader": loader})
        if recovered is None:
            step = jaxckpt.StepInfo(0, 0, 0, STEPS_PER_EPOCH)
            last = None
            emit("FRESH")
        else:
            state = recovered.state
            last = recovered.step_info
            step = last.next()
            emit("RESUMED " + json.dumps({"step": last.global_step, "tier": recovered.tier}))
        while step.global_step < opts.steps:
            x, y = loader.next_batch()
            # Global RNGs feed the numerics: a resume that forgot them would diverge.
            scale = np.float32(1.0 + 0.1 * random.random() + 0.1 * np.random.random())
            state, loss = train_step(state, x, y, scale)
            loss_value = float(loss)
            log.write(json.dumps({"step": step.global_step, "loss": loss_value.hex()}) + "\n")
            log.flush()
            os.fsync(log.fileno())
            emit(f"STEP {step.global_step}")
            reports = mgr.maybe_save(step, state, metrics={"loss": loss_value})
            for report in reports:
                if report.kind == "recover":
                    emit(f"SAVING{tag(report)} {step.global_step}")
            last, step = step, step.next()
        if last is not None:
            mgr.save(last, state)  # no-op when that step was just saved or restored
    arrays = final_arrays(state)
    tmp = opts.final + ".partial"
    with open(tmp, "wb") as handle:
        np.savez(handle, **arrays)
    os.replace(tmp, opts.final)
    emit("DONE")
    return 0


if __name__ == "__main__":
    claim_stdout()
    sys.exit(main())
