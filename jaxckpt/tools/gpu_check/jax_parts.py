"""The JAX parts of ``make gpu-check``, each run in a child process by the runner.

Owns: (1) a sharded ``jax.Array`` state with optax Adam state and a typed PRNG key, saved
and restored bit-exact through ``CheckpointManager`` (sync and async) onto the same
sharding; (2) an async save's blocking time against ``jax.device_get`` of the same bytes,
and save time against the ``O_DIRECT`` write floor (``bench.floors``); (3) the demo's
training worker SIGKILLed while an async save is in flight and resumed, against an
uninterrupted run, bit for bit.

Must not import at module level: jax, orbax, torch.
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

import numpy as np

from .rows import Row, error_row, median, ratio_row
from .runner import PartContext, child_env

__all__ = ["roundtrip", "speed", "kill_resume"]

_MiB = 1 << 20


def _devices(context: PartContext) -> list[Any]:
    import jax

    return list(jax.devices("cpu" if context.cpu else "gpu"))


def _where(devices: list[Any]) -> str:
    return f"{len(devices)} {devices[0].platform} device(s) ({devices[0].device_kind})"


def _mesh_shardings(devices: list[Any]) -> tuple[Any, Any]:
    """(rows split over every device, replicated), over a 1-d mesh of ``devices``."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    return NamedSharding(mesh, PartitionSpec("data", None)), NamedSharding(mesh, PartitionSpec())


def _train_state(devices: list[Any], nbytes: int) -> dict[str, Any]:
    """Params (float32 rows split over the devices, a bfloat16 bias replicated), the Adam
    state after one update (nonzero moments, count 1), a typed key, and a step counter and
    a bfloat16 array on the first and the last device alone."""
    import jax
    import jax.numpy as jnp
    import optax

    split, replicated = _mesh_shardings(devices)
    rows = 8 * len(devices)
    cols = max(16, nbytes // 4 // rows)
    rng = np.random.default_rng(0)
    params = {
        "w": jax.device_put(rng.standard_normal((rows, cols), np.float32), split),
        "b": jax.device_put(rng.standard_normal((cols,), np.float32).astype(jnp.bfloat16),
                            replicated),
    }
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)
    grads = jax.tree.map(lambda p: (p * 0.5 + 1).astype(p.dtype), params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    key = jax.device_put(jax.random.key(7), replicated)
    # Leaves on one device each: a restore places those by its own direct way (place.py).
    first = jax.sharding.SingleDeviceSharding(devices[0])
    last = jax.sharding.SingleDeviceSharding(devices[-1])
    ema = rng.standard_normal((rows, 64), np.float32).astype(jnp.bfloat16)
    return {"params": params, "opt_state": opt_state, "key": key,
            "step": jax.device_put(np.int32(1), first), "ema": jax.device_put(ema, last)}


def _like(state: Any) -> Any:
    """Shapes, dtypes and shardings only: what a resuming process has."""
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        state)


def _differences(expected: Any, restored: Any) -> list[str]:
    """Every leaf whose bytes, dtype, shape or sharding differ (the tree paths)."""
    import jax

    def raw(array: Any) -> np.ndarray:
        if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
            array = jax.random.key_data(array)
        return np.asarray(jax.device_get(array))

    problems = []
    want = jax.tree_util.tree_flatten_with_path(expected)[0]
    got = jax.tree_util.tree_flatten_with_path(restored)[0]
    if [path for path, _ in want] != [path for path, _ in got]:
        return [f"tree paths differ: {len(want)} saved, {len(got)} restored"]
    for (path, a), (_, b) in zip(want, got, strict=True):
        name = jax.tree_util.keystr(path)
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{name}: {b.dtype}{list(b.shape)} != {a.dtype}{list(a.shape)}")
        elif not b.sharding.is_equivalent_to(a.sharding, a.ndim):
            problems.append(f"{name}: restored on {b.sharding}, saved from {a.sharding}")
        elif raw(a).tobytes() != raw(b).tobytes():
            problems.append(f"{name}: bytes differ")
    return problems


def roundtrip(context: PartContext) -> list[Row]:
    """Part 1: save and restore the sharded state, sync and async, each into a fresh
    manager (as a resumed process does), and compare every leaf."""
    import jax

    import jaxckpt

    devices = _devices(context)
    state = _train_state(devices, (2 if context.cpu else 64) * _MiB)
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state) if hasattr(leaf, "nbytes"))
    rows = []
    for mode in ("sync", "async"):
        what = (f"{mode} save, restore onto the same NamedSharding, bit-exact (params, "
                f"optax Adam state, typed key, single-device leaves)")
        root = os.path.join(context.workdir, mode)
        recover = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=1)
        try:
            with jaxckpt.CheckpointManager(root, recover=recover, mode=mode) as manager:
                report = manager.save(jaxckpt.StepInfo(0, 1, 1, None), state)
                manager.wait()
            with jaxckpt.CheckpointManager(root, recover=recover, mode=mode) as manager:
                recovered = manager.recover(_like(state))
        except Exception as error:  # noqa: BLE001 - recorded; the other mode still runs
            rows.append(error_row(context.label, what, error))
            continue
        problems = (["nothing recovered"] if recovered is None
                    else _differences(state, recovered.state))
        rows.append(Row(part=context.label, status="FAIL" if problems else "pass", what=what,
                        result="; ".join(problems[:4]) or
                        f"{nbytes / _MiB:.0f} MiB on {_where(devices)}: identical",
                        figure=f"blocking {report.blocking_s * 1e3:.0f} ms, "
                               f"total {report.total_s:.2f} s"))
    return rows


def _leaf_maker(devices: list[Any], nbytes: int, count: int = 16) -> Any:
    """A jitted function of a seed that makes ``count`` float32 leaves of ``nbytes`` in
    all, rows split over the devices, on the devices: fresh arrays for every timing (jax
    keeps the host copy of an array once made, so a second device_get would copy nothing)."""
    import jax
    import jax.numpy as jnp

    split, _ = _mesh_shardings(devices)
    rows = 8 * len(devices)
    cols = max(16, nbytes // count // 4 // rows)
    make = jax.jit(lambda seed: [jnp.full((rows, cols), seed + index, jnp.float32)
                                 for index in range(count)], out_shardings=[split] * count)
    return make


def _write_floor(directory: str, host: list[np.ndarray]) -> float:
    """Seconds of the 4-thread write of the same bytes, one file per leaf, fsynced: with
    ``O_DIRECT`` from aligned blocks where the filesystem takes it (what the native writer
    does), else buffered."""
    from jaxckpt.storage.buffers import aligned_blocks
    from jaxckpt.tools.bench.floors import _direct_refused, _raw_write, _raw_write_direct

    os.makedirs(directory, exist_ok=True)
    direct = not _direct_refused(directory)
    blocks = []
    for array in host:
        block = aligned_blocks(array.nbytes)
        block[:array.nbytes] = array.reshape(-1).view(np.uint8)
        blocks.append(block)
    paths = [os.path.join(directory, str(index)) for index in range(len(host))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        start = time.perf_counter()
        if direct:
            list(pool.map(_raw_write_direct, paths, blocks))
        else:
            list(pool.map(lambda path, array: _raw_write(path, [array]), paths, host))
        seconds = time.perf_counter() - start
    shutil.rmtree(directory)
    return seconds


def _speed_round(manager: Any, make: Any, round_index: int, workdir: str) -> dict[str, float]:
    """One interleaved round: device_get, an async save, a sync save, the floor; each on
    freshly made arrays."""
    import jax

    import jaxckpt

    times: dict[str, float] = {}
    fresh = jax.block_until_ready(make(float(4 * round_index)))
    start = time.perf_counter()
    host = jax.device_get(fresh)
    times["device_get"] = time.perf_counter() - start
    for offset, mode in ((1, "async"), (2, "sync")):
        fresh = jax.block_until_ready(make(float(4 * round_index + offset)))
        step = 2 * round_index + offset
        report = manager.save(jaxckpt.StepInfo(0, step, step, None), {"leaves": fresh},
                              mode=mode)
        manager.wait()
        times[f"{mode}_blocking"] = report.blocking_s
        times[f"{mode}_total"] = report.total_s
        del fresh
    times["floor"] = _write_floor(os.path.join(workdir, "floor"), host)
    return times


def speed(context: PartContext) -> list[Row]:
    """Part 2: 3 interleaved rounds, medians: blocking of an async save / device_get of the
    same bytes; the write floor / sync and async save times (a ratio of speeds)."""
    import jaxckpt

    devices = _devices(context)
    make = _leaf_maker(devices, context.mib * _MiB)
    recover = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=1)
    rounds = []
    with jaxckpt.CheckpointManager(os.path.join(context.workdir, "root"), recover=recover,
                                   mode="async") as manager:
        make(0.0)  # compile outside the rounds
        for index in range(3):
            rounds.append(_speed_round(manager, make, index, context.workdir))
    nbytes = sum(leaf.nbytes for leaf in make(0.0))
    got = {key: median([r[key] for r in rounds]) for key in rounds[0]}
    gib_s = nbytes / (1 << 30)
    detail = (f"{nbytes / _MiB:.0f} MiB in 16 leaves on {_where(devices)}, median of 3; "
              f"device_get {got['device_get'] * 1e3:.0f} ms, async blocking "
              f"{got['async_blocking'] * 1e3:.0f} ms")
    label = context.label
    return [
        ratio_row(label, "async save blocking / jax.device_get of the same bytes",
                  got["async_blocking"] / got["device_get"], at_most=1.5, detail=detail),
        ratio_row(label, "sync save speed / write floor (4 threads, fsync)",
                  got["floor"] / got["sync_total"], at_least=0.8,
                  detail=f"save {gib_s / got['sync_total']:.2f} GiB/s, floor "
                         f"{gib_s / got['floor']:.2f} GiB/s"),
        ratio_row(label, "async save total speed / write floor",
                  got["floor"] / got["async_total"], at_least=0.8,
                  detail=f"save {gib_s / got['async_total']:.2f} GiB/s (device to host "
                         f"included), floor {gib_s / got['floor']:.2f} GiB/s"),
    ]


def _worker(context: PartContext, name: str, *extra: str, kill_at: str = "") -> dict[str, Any]:
    """Run the demo's training worker (``jaxckpt.tools.demo``: a Flax NNX MLP, Adam,
    dropout keys, a stateful loader) on this part's root ``name``; SIGKILL it at the stdout
    line ``kill_at``. Returns its lines, exit status and log path."""
    root = os.path.join(context.workdir, name)
    log = os.path.join(context.workdir, f"{name}.losses")
    argv = [sys.executable, "-m", "jaxckpt.tools.demo", "worker", "--root", root,
            "--steps", "30", "--save-every", "10", "--steps-per-epoch", "7", "--mode", "async",
            "--log", log, "--final", os.path.join(context.workdir, f"{name}.npz"), *extra]
    env = child_env(context.cpu)
    if not context.cpu:
        # The same numbers from two processes need the same kernels: XLA's autotuner and
        # atomics may otherwise differ between runs, which is not the checkpoint's doing.
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true"
    with open(os.path.join(context.workdir, f"{name}.stderr"), "ab") as errors:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, env=env)
        assert proc.stdout is not None
        lines = []
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            lines.append(line)
            if kill_at and line == kill_at:
                proc.kill()  # SIGKILL
                break
        code = proc.wait()
    return {"lines": lines, "code": code, "log": log,
            "final": os.path.join(context.workdir, f"{name}.npz")}


def _losses(path: str) -> dict[int, str]:
    with open(path) as handle:
        return {item["step"]: item["loss"] for item in map(json.loads, handle)}


def kill_resume(context: PartContext) -> list[Row]:
    """Part 3: an uninterrupted run of 30 steps (saves every 10) against a run SIGKILLed
    right after the save of step 19 started (held uncommitted: in flight for sure), then
    resumed (from step 9) to the end: final params and Adam state, and every step's loss,
    bit for bit."""
    import jax

    from jaxckpt.tools.demo import compare_npz

    reference = _worker(context, "reference")
    killed = _worker(context, "killed", "--hold-save-at", "19", "--hold-save-s", "120",
                     kill_at="SAVING 19")
    resumed = _worker(context, "killed")
    problems = []
    if reference["code"] != 0 or resumed["code"] != 0:
        problems.append(f"worker exit statuses {reference['code']}, {resumed['code']} "
                        f"(see {context.workdir})")
    if killed["code"] != -9:
        problems.append(f"the killed run ended with {killed['code']}, not SIGKILL")
    started = next((line for line in resumed["lines"] if line.startswith(("RESUMED", "FRESH"))),
                   "no start line")
    if not started.startswith('RESUMED {"step": 9'):
        problems.append(f"expected a resume from step 9 (19 was in flight), got {started!r}")
    if not problems:
        problems += compare_npz(reference["final"], resumed["final"])
        want, got = _losses(reference["log"]), _losses(resumed["log"])
        differing = [step for step in want if got.get(step) != want[step]]
        if differing:
            problems.append(f"losses differ at steps {differing[:5]}")
    platform = jax.default_backend()
    flags = "" if context.cpu else " (--xla_gpu_deterministic_ops=true)"
    return [Row(part=context.label, status="FAIL" if problems else "pass",
                what="training child (Flax MLP, Adam, dropout) SIGKILLed while the async save "
                     "of step 19 was in flight, rerun; vs an uninterrupted run",
                result="; ".join(problems[:4]) or
                f"resumed from step 9 on jax's {platform} backend{flags}; final "
                f"params, optimizer state and all 30 losses bit-identical",
                figure=f"{len(killed['lines'])} lines before the kill")]
