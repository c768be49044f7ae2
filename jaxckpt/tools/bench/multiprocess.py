"""The 2-process rows of ``jaxckpt bench``: a save's cost per byte when two processes write one
sharded state, against one process writing the same bytes.

Owns: the worker (``python -m jaxckpt.tools.bench.multiprocess``: one process of a
``jax.distributed`` run on 127.0.0.1 with 2 CPU devices, or a lone process with 2) and
``measure``: the lone process (jaxckpt's writer, then Orbax's, ``native_io=False``), then the
pair, each run saving once to warm up and then ``rounds`` timed sync saves (from a barrier
to the commit); rows ``mp_save_1``, ``mp_save_1_orbax``, ``mp_save_2`` of a ``BenchResult``,
round ``i`` of one run paired with round ``i`` of the other (the runs do not overlap).

Must not import: torch. Importing it imports the standard library only; the worker imports
jax and orbax. Concurrency contract: ``measure`` is called from one thread; it waits for the
processes it starts and kills their process groups on failure or timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ROUNDS", "measure"]

#: Timed saves per run (after one warm-up): the figures are medians of this many.
ROUNDS = 5
_LEAVES = 8
_TIMEOUT_S = 600.0


def measure(size_mb: int, workdir: str, result: Any, log: Callable[[str], None]) -> None:
    """Run the 1-process and the 2-process saves of ``size_mb`` MiB under ``workdir`` and
    record them in ``result`` (a ``jaxckpt.tools.bench.BenchResult``)."""
    times: dict[str, list[float]] = {}
    # The middle run, one process through Orbax's writer, is the writer multi-process saves
    # used before jaxckpt's own wrote each process's shards: kept as a reference.
    for key, count, orbax_writer in (("mp_save_1", 1, False), ("mp_save_1_orbax", 1, True),
                                     ("mp_save_2", 2, False)):
        log(f"jaxckpt bench: {count}-process saves{' (Orbax writer)' * orbax_writer} "
            f"({ROUNDS} rounds)")
        report = _run(count, size_mb, os.path.join(workdir, key), orbax_writer=orbax_writer)
        times[key] = report["times_s"]
        result.nbytes["multiprocess"] = report["nbytes"]
        for seconds in report["times_s"]:
            result.add(key, seconds)
    facts: dict[str, Any] = {"rounds": len(times["mp_save_2"]),
                             "note": "sync save time of the same global bytes, per round"}
    for name, one in (("ratio", "mp_save_1"), ("ratio_same_writer", "mp_save_1_orbax")):
        ratios = [two / base for base, two in zip(times[one], times["mp_save_2"], strict=True)]
        facts.update({f"{name}_median": statistics.median(ratios),
                      f"{name}_min": min(ratios), f"{name}_max": max(ratios)})
    result.facts["multiprocess"] = facts


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(count: int, size_mb: int, root: str, *, orbax_writer: bool) -> dict[str, Any]:
    """Start ``count`` worker processes and return process 0's report."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    port = str(_free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxckpt.tools.bench.multiprocess", "--index", str(i),
         "--count", str(count), "--port", port, "--root", root, "--size-mb", str(size_mb),
         *(["--orbax-writer"] if orbax_writer else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
        for i in range(count)]
    outputs: list[tuple[int, str, str]] = []
    try:
        deadline = time.monotonic() + _TIMEOUT_S
        for proc in procs:
            raw_out, raw_err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((proc.returncode, raw_out.decode(), raw_err.decode()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    _, out, err = outputs[0]
    lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
    if any(c != 0 for c, _, _ in outputs) or not lines:
        raise RuntimeError(f"the {count}-process bench run failed (exit codes "
                           f"{[c for c, _, _ in outputs]}): {err[-2000:]}")
    return json.loads(lines[-1][len("REPORT "):])


# ------------------------------------------------------------------------------ worker


def _worker(opts: argparse.Namespace) -> dict[str, Any]:
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    if opts.count > 1:
        jax.distributed.initialize(f"127.0.0.1:{opts.port}", num_processes=opts.count,
                                   process_id=opts.index, initialization_timeout=120,
                                   heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxckpt import CheckpointManager, Every, RecoverConfig, StepInfo
    from jaxckpt.backends.orbax.backend import OrbaxBackend

    devices = jax.device_count()
    rows = max(devices, (opts.size_mb << 20) // _LEAVES // 4096 // devices * devices)
    sharding = NamedSharding(jax.make_mesh((devices,), ("x",)), P("x"))
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((rows, 1024), dtype=np.float32) for _ in range(_LEAVES)]
    state = {f"w{i}": jax.make_array_from_callback(d.shape, sharding, d.__getitem__)
             for i, d in enumerate(data)}
    times = []
    config = RecoverConfig(every=Every(), keep_last_n=1)  # saves only when asked
    backend = OrbaxBackend(native_io=not opts.orbax_writer)
    with CheckpointManager(opts.root, recover=config, mode="sync", backend=backend,
                           preemption_signals=()) as mgr:
        for round_index in range(ROUNDS + 1):
            step = StepInfo(0, round_index, round_index)
            mgr.maybe_save(step, state)  # never due: it records the completed step
            multihost_utils.sync_global_devices(f"bench-round-{round_index}")
            start = time.perf_counter()
            mgr.save(step, state)
            if round_index:  # the first save warms up (compilation, buffers, directories)
                times.append(time.perf_counter() - start)
    if opts.count > 1:
        # Leave together: process 0 hosts the coordination service, and a process still
        # connected to it when process 0 exits aborts if it lags by more than about 0.1 s.
        # shutdown() waits for every process and disconnects each before any exits.
        jax.distributed.shutdown()
    return {"times_s": times, "nbytes": sum(d.nbytes for d in data)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--root", required=True)
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--orbax-writer", action="store_true",
                        help="write through Orbax (native_io=False), as several processes do")
    opts = parser.parse_args(argv)
    try:
        report = _worker(opts)
        print("REPORT " + json.dumps(report), flush=True)
    except BaseException:  # noqa: BLE001 - any failure: report it and leave at once
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # never wait in jax.distributed's shutdown barrier after a failure
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
