"""Preemption beyond tests/system/test_preemption.py, with real processes and real signals:
SIGTERM while an async save is still being written, a second (and third) SIGTERM, SIGTERM to
the ``jaxckpt run`` supervisor (forwarded; the child saves and exits; no retry) or to the
child alone (no retry either, also when the child ends by SIGTERM after its checkpoint, the
default ``on_preemption="exit"``), and SIGINT (not a preemption signal) while a save is in
flight. The loop below stops on ``mgr.preempted`` itself (``on_preemption="continue"``)
unless a test asks for "exit".

The loop below holds the background write of chosen steps for a while (a wrapper backend that
sleeps before waiting for the real write), so a signal lands with certainty while that save is
uncommitted. Every process runs in its own session and is killed as a group on failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxckpt import CheckpointManager
from jaxckpt.core.layout import COMMIT_MARKER

from support.harness import Worker, repo_env
from support.paths import REPO

LOOP = textwrap.dedent("""
    import json, os, signal, sys, time
    import jax.numpy as jnp
    from jaxckpt import CheckpointManager, Every, RecoverConfig, StepInfo
    from jaxckpt.backends.orbax.backend import OrbaxBackend

    # A parent started in the background (nohup, `&`) leaves SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: put Python's own back, as a terminal run has it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    root, opts = sys.argv[1], json.loads(sys.argv[2])
    if opts.get("attempts"):
        with open(opts["attempts"], "a") as log:
            log.write(os.environ.get("JAXCKPT_RETRY_ATTEMPT", "-") + "\\n")

    class Held(OrbaxBackend):
        # Keeps the write of chosen steps in flight longer; numerics untouched.
        step = -1
        def write(self, directory, state, *, asynchronous):
            handle = super().write(directory, state, asynchronous=asynchronous)
            hold = opts.get("hold", {}).get(str(self.step))
            if hold is None:
                return handle
            class Slow:
                checksums = property(lambda self: handle.checksums)
                def wait(self):
                    time.sleep(hold)
                    handle.wait()
            return Slow()

    def say(line):
        os.write(1, (line + "\\n").encode())

    backend = Held()
    mgr = CheckpointManager(root, recover=RecoverConfig(every=Every(steps=opts["every"]),
                                                        keep_last_n=None),
                            mode="async", backend=backend,
                            on_preemption=opts.get("on_preemption", "continue"),
                            on_report=lambda r: say(f"REPORTED {r.step} {r.reason}"))
    with mgr:
        got = mgr.recover({"x": jnp.zeros((), jnp.float32)})
        step = StepInfo(0, 0, 0) if got is None else got.step_info.next()
        x = jnp.zeros((), jnp.float32) if got is None else got.state["x"]
        say(f"START {step.global_step}")
        while step.global_step < opts.get("steps", 10_000):
            x = x + 1.0
            backend.step = step.global_step
            for report in mgr.maybe_save(step, {"x": x}):
                say(f"SAVING {report.step} {report.reason}")
            say(f"STEP {step.global_step}")
            if mgr.preempted:
                say(f"PREEMPTED {step.global_step}")
                break
            time.sleep(opts.get("sleep", 0.02))
            step = step.next()
    say("CLEAN-EXIT")
""")


def env() -> dict[str, str]:
    return repo_env(JAX_PLATFORMS="cpu", XLA_FLAGS="", TF_CPP_MIN_LOG_LEVEL="3")


def start(argv: list[str], timeout: float = 120.0) -> Worker:
    """A process in its own session whose stdout lines are read by a thread
    (support.harness)."""
    return Worker(argv, env=env(), cwd=REPO, timeout_s=timeout)


def loop(root: Path, **opts) -> list[str]:
    return [sys.executable, "-c", LOOP, str(root), json.dumps(opts)]


def committed(root: Path) -> list[int]:
    recover = root / "recover"
    return sorted(int(d.name[5:]) for d in recover.iterdir()
                  if d.name.startswith("step_") and (d / COMMIT_MARKER).exists())


def partial(root: Path) -> list[str]:
    return sorted(d.name for d in (root / "recover").iterdir()
                  if d.name.startswith("step_") and not (d / COMMIT_MARKER).exists())


def restored(root: Path) -> tuple[int, float]:
    with CheckpointManager(root, preemption_signals=()) as mgr:
        got = mgr.recover({"x": jax.ShapeDtypeStruct((), jnp.float32)})
    return got.step_info.global_step, float(got.state["x"])


def test_sigterm_during_an_in_flight_async_save_commits_it_then_saves_and_exits(tmp_path):
    root = tmp_path / "root"
    proc = start(loop(root, every=5, hold={"4": 1.5}))
    try:
        proc.wait_for("SAVING 4 steps")  # step 4's write is held in flight for 1.5 s
        assert not (root / "recover" / "step_00000004" / COMMIT_MARKER).exists()
        os.kill(proc.proc.pid, signal.SIGTERM)
        stopped = int(proc.wait_for("PREEMPTED").split()[1])
        code = proc.finish()
    finally:
        proc.close()
    assert code == 0, proc.stderr()
    assert "CLEAN-EXIT" in proc.lines
    assert stopped in (5, 6), proc.lines  # the next step boundary (6 if the signal was late)
    assert f"SAVING {stopped} preempted" in proc.lines
    # The in-flight save was neither lost nor torn by the signal; the preemption save
    # followed it, and nothing partial is left.
    assert "REPORTED 4 steps" in proc.lines and f"REPORTED {stopped} preempted" in proc.lines
    assert proc.lines.index("REPORTED 4 steps") < proc.lines.index(f"REPORTED {stopped} preempted")
    assert committed(root) == [4, stopped] and partial(root) == []
    assert restored(root) == (stopped, stopped + 1.0)


def test_by_default_sigterm_during_an_in_flight_save_ends_the_process_after_both_commit(
        tmp_path):
    root = tmp_path / "root"
    proc = start(loop(root, every=5, hold={"4": 1.5}, on_preemption="exit"))
    try:
        proc.wait_for("SAVING 4 steps")  # step 4's write is held in flight for 1.5 s
        os.kill(proc.proc.pid, signal.SIGTERM)
        code = proc.finish()
    finally:
        proc.close()
    assert code == -signal.SIGTERM, (code, proc.lines[-5:], proc.stderr())
    reported = [line for line in proc.lines if line.startswith("REPORTED")]
    stopped = int(reported[-1].split()[1])
    assert reported == ["REPORTED 4 steps", f"REPORTED {stopped} preempted"], proc.lines
    assert proc.lines[-1] == f"REPORTED {stopped} preempted"  # nothing ran after it
    assert committed(root) == [4, stopped] and partial(root) == []
    assert restored(root) == (stopped, stopped + 1.0)


def test_repeated_sigterms_save_once_and_still_exit_cleanly(tmp_path):
    root = tmp_path / "root"
    proc = start(loop(root, every=5, hold={"4": 1.0, "5": 1.5, "6": 1.5}))
    try:
        proc.wait_for("SAVING 4 steps")
        os.kill(proc.proc.pid, signal.SIGTERM)
        os.kill(proc.proc.pid, signal.SIGTERM)  # schedulers and users do send it twice
        stopped = int(proc.wait_for("PREEMPTED").split()[1])
        # A third one while close() waits for the held preemption save to commit.
        os.kill(proc.proc.pid, signal.SIGTERM)
        code = proc.finish()
    finally:
        proc.close()
    assert code == 0, f"exit {code}: {proc.lines[-5:]} {proc.stderr()}"
    assert "CLEAN-EXIT" in proc.lines
    preempted = [line for line in proc.lines if line.endswith(" preempted")]
    assert preempted == [f"SAVING {stopped} preempted", f"REPORTED {stopped} preempted"], proc.lines
    assert committed(root) == [4, stopped] and partial(root) == []
    assert restored(root) == (stopped, stopped + 1.0)


def stopped_at(worker: Worker, on_preemption: str) -> int:
    """The step of the preemption checkpoint: the loop says so with "continue"; with "exit"
    the process ends inside that maybe_save, after its report."""
    if on_preemption == "continue":
        return int(worker.wait_for("PREEMPTED").split()[1])
    return int(worker.wait_for("REPORTED").split()[1])


@pytest.mark.parametrize("on_preemption, expected",
                         [("continue", 0), ("exit", 128 + signal.SIGTERM)])
def test_sigterm_to_the_run_supervisor_is_forwarded_and_not_retried(tmp_path, on_preemption,
                                                                    expected):
    root = tmp_path / "root"
    attempts = tmp_path / "attempts.log"
    argv = [sys.executable, "-m", "jaxckpt.tools.cli", "run", "--retries", "3", "--backoff", "0",
            "--", *loop(root, every=1000, attempts=str(attempts), on_preemption=on_preemption)]
    supervisor = start(argv)
    try:
        supervisor.wait_for("STEP 3")
        os.kill(supervisor.proc.pid, signal.SIGTERM)  # only the supervisor, not the group
        stopped = stopped_at(supervisor, on_preemption)
        code = supervisor.finish()
    finally:
        supervisor.close()
    err = supervisor.stderr()
    assert code == expected, f"supervisor exit {code}: {err}"
    assert attempts.read_text().split() == ["0"], "the supervisor restarted a preempted run"
    assert supervisor.lines.count("START 0") == 1
    assert ("CLEAN-EXIT" in supervisor.lines) == (on_preemption == "continue")
    assert committed(root) == [stopped] and partial(root) == []
    assert restored(root) == (stopped, stopped + 1.0)
    if on_preemption == "exit":
        assert "stopping after killed by SIGTERM (supervisor got SIGTERM)" in err, err


@pytest.mark.parametrize("on_preemption, expected",
                         [("continue", 0), ("exit", 128 + signal.SIGTERM)])
def test_sigterm_to_the_child_alone_ends_the_supervised_run_without_a_restart(
        tmp_path, on_preemption, expected):
    root = tmp_path / "root"
    attempts = tmp_path / "attempts.log"
    argv = [sys.executable, "-m", "jaxckpt.tools.cli", "run", "--retries", "3", "--backoff", "0",
            "--", *loop(root, every=1000, attempts=str(attempts), on_preemption=on_preemption)]
    supervisor = start(argv)
    try:
        supervisor.wait_for("STEP 2")
        children = subprocess.run(["pgrep", "-P", str(supervisor.proc.pid)], capture_output=True,
                                  text=True, timeout=10).stdout.split()
        assert len(children) == 1, children
        os.kill(int(children[0]), signal.SIGTERM)  # e.g. a node agent signalling the trainer
        stopped = stopped_at(supervisor, on_preemption)
        code = supervisor.finish()
    finally:
        supervisor.close()
    assert code == expected, supervisor.stderr()
    # Ended by SIGTERM (the manager, after its checkpoint): a stop on request, not a crash.
    assert attempts.read_text().split() == ["0"], supervisor.stderr()
    assert committed(root) == [stopped]


def test_sigint_during_an_in_flight_save_still_commits_it_and_leaves_no_debris(tmp_path):
    root = tmp_path / "root"
    proc = start(loop(root, every=5, hold={"4": 1.0}))
    try:
        proc.wait_for("SAVING 4 steps")
        os.kill(proc.proc.pid, signal.SIGINT)  # not a preemption signal: KeyboardInterrupt
        code = proc.finish()
    finally:
        proc.close()
    assert code != 0 and "CLEAN-EXIT" not in proc.lines
    # Leaving the `with` block on the exception finished the in-flight save.
    assert committed(root) == [4] and partial(root) == []
    assert restored(root) == (4, 5.0)


FAILING_CHILD = textwrap.dedent("""
    import os, sys
    attempt = os.environ.get("JAXCKPT_RETRY_ATTEMPT", "-")
    with open(sys.argv[1], "a") as log:
        log.write(attempt + "\\n")
    print(f"ATTEMPT {attempt}", flush=True)
    sys.exit(1)
""")


def test_sigterm_to_the_supervisor_during_backoff_starts_no_new_attempt(tmp_path):
    attempts = tmp_path / "attempts.log"
    argv = [sys.executable, "-m", "jaxckpt.tools.cli", "run", "--retries", "3", "--backoff", "3",
            "--", sys.executable, "-c", FAILING_CHILD, str(attempts)]
    supervisor = start(argv, timeout=60)
    try:
        supervisor.wait_for("ATTEMPT 0")
        # The child has exited once the supervisor says when it restarts it (3 s later).
        deadline = time.monotonic() + 60
        while "restart 1 of 3 in 3.0 s" not in supervisor.stderr():
            assert time.monotonic() < deadline, supervisor.stderr()
            time.sleep(0.02)
        os.kill(supervisor.proc.pid, signal.SIGTERM)
        supervisor.finish()
    finally:
        supervisor.close()
    assert attempts.read_text().split() == ["0"], "an attempt was started after SIGTERM"
    assert "got SIGTERM while waiting to restart; not restarting" in supervisor.stderr()
