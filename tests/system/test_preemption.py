"""Preemption: SIGTERM becomes a checkpoint at the next step boundary; then, by default, the
process ends as SIGTERM would have (status -15) even when the loop never looks at
``mgr.preempted`` (a JAX loop and a DcpCheckpointManager loop); with
``on_preemption="continue"`` the loop stops itself and exits 0."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from jaxckpt import CheckpointManager, Every, RecoverConfig, StepInfo

from support.harness import Worker, repo_env
from support.paths import REPO

LOOP = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    from jaxckpt import CheckpointManager, RecoverConfig, Every, StepInfo
    root, extra = sys.argv[1], sys.argv[2]
    signals = (15, 10) if extra == "usr1" else (15,)
    mgr = CheckpointManager(root, recover=RecoverConfig(every=Every(steps=1000)),
                            preemption_signals=signals, on_preemption="continue")
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
def test_with_continue_a_signal_saves_at_next_step_and_the_loop_exits_cleanly(tmp_path, sig,
                                                                              extra):
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    root = str(tmp_path / "root")
    proc = subprocess.Popen([sys.executable, str(script), root, extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=repo_env(), cwd=REPO)  # this checkout's jaxckpt
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


# The README's loops: they never look at mgr.preempted. ``after`` sends the signal once the
# loop is done, before the final save (no maybe_save comes after it: close() ends the process).
README_LOOP = textwrap.dedent("""
    import os, sys, time
    import jax.numpy as jnp
    from jaxckpt import CheckpointManager, RecoverConfig, Every, StepInfo
    root, signals, after = sys.argv[1], tuple(map(int, sys.argv[2].split(","))), sys.argv[3]
    mgr = CheckpointManager(root, recover=RecoverConfig(every=Every(steps=1000)),
                            preemption_signals=signals,
                            on_report=lambda r: print("COMMITTED", r.step, r.reason, flush=True))
    r = mgr.recover({"x": jnp.zeros(())})
    step = StepInfo(0, 0, 0) if r is None else r.step_info.next()
    x = jnp.zeros(()) if r is None else r.state["x"]
    while step.global_step < (5 if after == "after" else 10_000):
        x = x + 1.0
        mgr.maybe_save(step, {"x": x})
        print("STEP", step.global_step, flush=True)
        time.sleep(0.05)
        step = step.next()
    if after == "after":
        os.kill(os.getpid(), signals[0])
        print("SIGNALLED", flush=True)
    mgr.save(state={"x": x}, mode="sync")
    mgr.close()
    print("AFTER-CLOSE", flush=True)
""")


def start_readme_loop(tmp_path, signals, after=""):
    script = tmp_path / "readme_loop.py"
    script.write_text(README_LOOP)
    return Worker([sys.executable, str(script), str(tmp_path / "root"),
                   ",".join(str(int(s)) for s in signals), after or "-"],
                  env=repo_env(JAX_PLATFORMS="cpu", XLA_FLAGS=""), cwd=REPO, timeout_s=120.0)


def recovered_x(root):
    with CheckpointManager(root, preemption_signals=()) as mgr:
        steps = mgr.committed_steps()
        r = mgr.recover({"x": jax.ShapeDtypeStruct((), jnp.float32)})
    return steps, r.step_info.global_step, float(r.state["x"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_by_default_a_loop_that_never_checks_ends_by_the_signal_once_saved(tmp_path, sig):
    worker = start_readme_loop(tmp_path, (signal.SIGTERM, signal.SIGUSR1))
    try:
        worker.wait_for("STEP 3")
        worker.signal(sig)
        code = worker.finish()
    finally:
        worker.close()
    assert code == -sig, (code, worker.lines[-5:], worker.stderr())
    (saved,) = worker.tagged("COMMITTED")
    stopped = int(saved.split()[0])
    assert saved == f"{stopped} preempted"
    # It ended inside the maybe_save of the step that wrote the checkpoint, after its commit.
    assert worker.lines[-2:] == [f"STEP {stopped - 1}", f"COMMITTED {stopped} preempted"]
    assert f"{signal.Signals(sig).name}: the checkpoint of step {stopped} is committed" in \
        worker.stderr()
    assert recovered_x(tmp_path / "root") == ([stopped], stopped, stopped + 1.0)


def test_by_default_a_signal_after_the_last_maybe_save_ends_the_process_at_close(tmp_path):
    worker = start_readme_loop(tmp_path, (signal.SIGTERM,), after="after")
    try:
        code = worker.finish()
    finally:
        worker.close()
    assert code == -signal.SIGTERM, (code, worker.lines[-5:], worker.stderr())
    assert "SIGNALLED" in worker.lines and "AFTER-CLOSE" not in worker.lines
    assert worker.tagged("COMMITTED") == ["4 forced"]  # the final save still committed
    assert recovered_x(tmp_path / "root") == ([4], 4, 5.0)


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


TORCH_LOOP = textwrap.dedent("""
    import sys, time
    import torch
    import jaxckpt
    from torch_bridge import DcpCheckpointManager
    model = torch.nn.Linear(4, 2)
    config = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1000))
    with DcpCheckpointManager(sys.argv[1], recover=config, mode="async") as mgr:
        step = jaxckpt.StepInfo(0, 0, 0)
        while True:                                   # never looks at mgr.preempted
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.maybe_save(step, {"model": model})
            print("STEP", step.global_step, flush=True)
            time.sleep(0.05)
            step = step.next()
""")


def test_by_default_a_torch_loop_ends_by_sigterm_once_its_checkpoint_committed(tmp_path):
    pytest.importorskip("torch")
    root = tmp_path / "root"
    worker = Worker([sys.executable, "-c", TORCH_LOOP, str(root)], env=repo_env(), cwd=REPO,
                    timeout_s=120.0)
    try:
        worker.wait_for("STEP 2")
        worker.signal(signal.SIGTERM)
        code = worker.finish()
    finally:
        worker.close()
    assert code == -signal.SIGTERM, (code, worker.lines[-5:], worker.stderr())
    stopped = int(worker.lines[-1].split()[1]) + 1  # it ended inside the next maybe_save
    assert f"SIGTERM: the checkpoint of step {stopped} is committed" in worker.stderr()
    assert sorted(p.name for p in (root / "recover").iterdir()) == [f"step_{stopped:08d}"]
    assert (root / "recover" / f"step_{stopped:08d}" / "COMMITTED").exists()
