"""Launching two cooperating worker processes on localhost, for the multi-process tests.

A worker script gets ``<process index> <port> <directory>`` as arguments, runs in its own
session (support.harness: a hung pair is killed as a group) and prints "worker ok" when it
succeeds.
``jax_worker`` writes the part every JAX worker shares around a test's own body.
"""

from __future__ import annotations

import os
import socket
import sys
import textwrap
from pathlib import Path

from support.harness import Worker, repo_env, run_all

_JAX_WORKER = """\
import json, os, sys, threading, traceback, warnings
sys.path.insert(0, @SUPPORT@)
from worker_lines import claim_stdout
claim_stdout()  # gloo's chatter goes to stderr, where it cannot split a printed line
index, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
try:
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=index,
                               initialization_timeout=@INIT_TIMEOUT@,
                               heartbeat_timeout_seconds=10, shutdown_timeout_seconds=60)
@BODY@
    # Leave together: process 0 hosts the coordination service, and a process still
    # connected to it when process 0 exits aborts (SIGABRT, "the JAX distributed service
    # detected fatal errors") if it lags by more than about 0.1 s. shutdown() waits for
    # both and disconnects each before either exits.
    jax.distributed.shutdown()
    print("worker ok", flush=True)
except BaseException:
    traceback.print_exc()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(1)
sys.stdout.flush()
os._exit(0)  # shut down above; skip the interpreter's own teardown of jax
"""


def jax_worker(body: str, *, init_timeout: int = 60) -> str:
    """A worker script: ``index``, ``port`` and ``root`` from the arguments, jax with 2 CPU
    devices joined to the other process, then ``body`` (any indentation; ``json``, ``os``,
    ``sys``, ``threading`` and ``warnings`` are imported). Any exception prints its
    traceback and exits 1 at once (no shutdown barrier, which would wait for a peer that
    may have failed too); success shuts jax.distributed down in both processes (a process
    still connected when process 0, the service's host, exits would abort), then prints
    "worker ok"."""
    return (_JAX_WORKER.replace("@INIT_TIMEOUT@", str(init_timeout))
            .replace("@SUPPORT@", repr(str(Path(__file__).resolve().parent)))
            .replace("@BODY@", textwrap.indent(textwrap.dedent(body).strip("\n"), "    ")))


def free_port() -> int:
    """A localhost TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_two_workers(source: str, tmp_path: Path, *, dirname: str = "root",
                    timeout: float = 180) -> tuple[str, list[str]]:
    """Run ``source`` as processes 0 and 1 sharing ``tmp_path / dirname``; assert both
    printed "worker ok" and exited 0. Returns that directory and each worker's output.
    XLA_FLAGS is dropped (each worker sets its own device count) and the repository goes on
    PYTHONPATH."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    directory = str(tmp_path / dirname)
    env = repo_env({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    port = free_port()
    workers = [Worker([sys.executable, str(script), str(i), str(port), directory], env=env,
                      timeout_s=timeout) for i in range(2)]
    codes, outputs = run_all(workers)
    for code, output in zip(codes, outputs, strict=True):
        assert code == 0 and "worker ok" in output, output[-4000:]
    return directory, outputs
