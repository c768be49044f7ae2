"""Preemption: SIGTERM becomes a checkpoint at the next step boundary and a clean exit."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from jaxckpt import CheckpointManager, Every, RecoverConfig, StepInfo

LOOP = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    from jaxckpt import CheckpointManager, RecoverConfig, Every, StepInfo
    root, extra = sys.argv[1], sys.argv[2]
    signals = (15, 10) if extra == "usr1" else (15,)
    mgr = CheckpointManager(root, recover=RecoverConfig(every=Every(steps=1000)),
                            preemption_signals=signals)
    like = {"x": jnp.zeros(()), "n": 0}
    r = mgr.recover(like)
    step = StepInfo(0, 0, 0) if r is None else r.step_info.next()
    x = jnp.zeros(()) if r is None else r.state["x"]
    print("START", step.global_step, flush=True)
    while step.global_step < 10_000:
        x = x + 1.0
        mgr.maybe_save(step, {"x": x, "n": step.global_step})
        print("STEP", step.global_step, flush=True)
        if mgr.preempted:
            print("PREEMPTED", step.global_step, flush=True)
            break
        time.sleep(0.05)
        step = step.next()
    mgr.close()
    print("CLEAN-EXIT", flush=True)
""")


def run_until(proc, prefix, timeout=120):
    import time

    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith(prefix):
            return line.strip(), lines
    raise AssertionError(f"never saw {prefix!r}; output: {lines[-20:]}")


@pytest.mark.parametrize("sig, extra", [(signal.SIGTERM, "term"), (signal.SIGUSR1, "usr1")])
def test_signal_saves_at_next_step_and_exits_cleanly(tmp_path, sig, extra):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    root = str(tmp_path / "root")
    proc = subprocess.Popen([sys.executable, str(script), root, extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        run_until(proc, "STEP 3")
        os.kill(proc.pid, sig)
        line, _ = run_until(proc, "PREEMPTED")
        stopped = int(line.split()[1])
        run_until(proc, "CLEAN-EXIT")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with CheckpointManager(root) as mgr:
        assert mgr.committed_steps() == [stopped]
        r = mgr.recover({"x": jax.ShapeDtypeStruct((), jnp.float32), "n": 0})
    assert r.step_info.global_step == stopped and r.state["n"] == stopped
    assert float(r.state["x"]) == stopped + 1


def test_request_preemption_save_without_a_signal(tmp_path):
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=100)),
                           preemption_signals=()) as mgr:
        assert mgr.maybe_save(StepInfo(0, 0, 0), {"x": jnp.ones(())}) == []
        mgr.request_preemption_save()
        (report,) = mgr.maybe_save(StepInfo(0, 1, 1), {"x": jnp.ones(())})
        assert report.reason == "preempted" and mgr.preempted


def test_handlers_are_restored_on_close(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    mgr = CheckpointManager(tmp_path)
    assert signal.getsignal(signal.SIGTERM) is not before
    mgr.close()
    assert signal.getsignal(signal.SIGTERM) is before
