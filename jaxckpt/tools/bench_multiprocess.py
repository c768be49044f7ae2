"""The 2-process rows of ``jaxckpt bench``: what a save costs per byte when two processes
write one sharded state, against one process writing the same bytes.

Owns: the bench worker (``python -m jaxckpt.tools.bench_multiprocess``, one process of a
``jax.distributed`` run on 127.0.0.1 with 2 CPU devices, or a lone process with 2 devices)
and ``measure``, which runs the lone process, then the pair, and adds their save times to a
``BenchResult`` (rows ``mp_save_1`` and ``mp_save_2``, state ``"multiprocess"``) with the
per-round ratio and its spread in ``facts["multiprocess"]``.

How: each run builds the same global state (``leaves`` float32 arrays, rows sharded over every
device of the run), saves it once to warm up, then ``rounds`` times, each sync save timed on
process 0 from a common start (a barrier) to the commit. Round ``i`` of one run is paired with
round ``i`` of the other: the two runs do not overlap (they would share the CPUs), so the
ratio is of runs taken one after the other, each under whatever load there was.

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
from typing import Any, Callable

__all__ = ["measure", "ROUNDS"]

#: Timed saves per run (after one warm-up): the figures are medians of this many.
ROUNDS = 5
_LEAVES = 8
_TIMEOUT_S = 600.0


def measure(size_mb: int, workdir: str, result: Any, log: Callable[[str], None]) -> None:
    """Run the 1-process and the 2-process saves of ``size_mb`` MiB under ``workdir`` and
    record them in ``result`` (a ``jaxckpt.tools.bench.BenchResult``)."""
    times: dict[int, list[float]] = {}
    for count in (1, 2):
        log(f"jaxckpt bench: {count}-process saves ({ROUNDS} rounds)")
        report = _run(count, size_mb, os.path.join(workdir, f"mp{count}"))
        times[count] = report["times_s"]
        result.nbytes["multiprocess"] = report["nbytes"]
    for one, two in zip(times[1], times[2]):
        result.add("mp_save_1", one)
        result.add("mp_save_2", two)
    ratios = [two / one for one, two in zip(times[1], times[2])]
    result.facts["multiprocess"] = {
        "rounds": len(ratios), "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios), "ratio_max": max(ratios),
        "note": "2-process sync save time / 1-process, same global bytes, per round"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(count: int, size_mb: int, root: str) -> dict[str, Any]:
    """Start ``count`` worker processes and return process 0's report."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    port = str(_free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxckpt.tools.bench_multiprocess", "--index", str(i),
         "--count", str(count), "--port", port, "--root", root, "--size-mb", str(size_mb)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
        for i in range(count)]
    outputs = []
    try:
        deadline = time.monotonic() + _TIMEOUT_S
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((proc.returncode, out.decode(), err.decode()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    code, out, err = outputs[0]
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

    devices = jax.device_count()
    rows = max(devices, (opts.size_mb << 20) // _LEAVES // 4096 // devices * devices)
    sharding = NamedSharding(jax.make_mesh((devices,), ("x",)), P("x"))
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((rows, 1024), dtype=np.float32) for _ in range(_LEAVES)]
    state = {f"w{i}": jax.make_array_from_callback(d.shape, sharding, lambda idx, d=d: d[idx])
             for i, d in enumerate(data)}
    times = []
    config = RecoverConfig(every=Every(), keep_last_n=1)  # saves only when asked
    with CheckpointManager(opts.root, recover=config, mode="sync", preemption_signals=()) as mgr:
        for round_index in range(ROUNDS + 1):
            step = StepInfo(0, round_index, round_index)
            mgr.maybe_save(step, state)  # never due: it records the completed step
            multihost_utils.sync_global_devices(f"bench-round-{round_index}")
            start = time.perf_counter()
            mgr.save(step, state)
            if round_index:  # the first save warms up (compilation, buffers, directories)
                times.append(time.perf_counter() - start)
    if opts.count > 1:
        multihost_utils.sync_global_devices("bench-end")  # process 0 serves the others
    return {"times_s": times, "nbytes": sum(d.nbytes for d in data)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--root", required=True)
    parser.add_argument("--size-mb", type=int, default=64)
    opts = parser.parse_args(argv)
    try:
        report = _worker(opts)
        print("REPORT " + json.dumps(report), flush=True)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # never wait in jax.distributed's shutdown barrier after a failure
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
