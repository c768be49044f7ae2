"""A final ``save(mode="sync")`` is on disk when it returns, in a real process: the program
below saves its last step by ``maybe_save`` (async, the write held in flight a while), then
calls ``mgr.save(state=..., mode="sync")`` for that same step, as the README's programs do,
prints, and is SIGKILLed right after the print. The rerun finds that step committed, and
the print already listed it (retention included)."""

from __future__ import annotations

import sys
import textwrap

import jax
import jax.numpy as jnp

from jaxckpt import CheckpointManager

from support.harness import Worker, repo_env
from support.paths import REPO

PROGRAM = textwrap.dedent("""
    import os, sys, time
    import jax.numpy as jnp
    from jaxckpt import CheckpointManager, Every, RecoverConfig, StepInfo
    from jaxckpt.backends.orbax.backend import OrbaxBackend
    from support.held_writes import hold_async_writes

    root = sys.argv[1]
    backend = hold_async_writes(OrbaxBackend(), 1.0)  # async saves stay uncommitted 1 s
    mgr = CheckpointManager(root, recover=RecoverConfig(every=Every(steps=5), keep_last_n=2),
                            mode="async", backend=backend, preemption_signals=())
    step, x = StepInfo(0, 0, 0), jnp.zeros(())
    while step.global_step < 15:
        x = x + 1.0
        mgr.maybe_save(step, {"x": x})              # saves steps 4, 9 and 14
        step = step.next()
    report = mgr.save(state={"x": x}, mode="sync")  # step 14, which maybe_save started
    os.write(1, f"SAVED {report.step} {report.done()} {mgr.committed_steps()}\\n".encode())
    time.sleep(600)                                 # killed here
""")


def test_a_kill_right_after_a_final_sync_save_keeps_that_step(tmp_path):
    root = tmp_path / "root"
    env = repo_env(JAX_PLATFORMS="cpu", XLA_FLAGS="", TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] += f":{REPO / 'tests'}"
    worker = Worker([sys.executable, "-c", PROGRAM, str(root)], env=env, cwd=REPO,
                    timeout_s=120.0)
    code = worker.run(kill_at=lambda line: line.startswith("SAVED"))
    assert worker.killed and code == -9, (code, worker.lines, worker.stderr())
    assert worker.tagged("SAVED") == ["14 True [9, 14]"], worker.lines
    with CheckpointManager(root, preemption_signals=()) as mgr:
        assert mgr.committed_steps() == [9, 14]
        got = mgr.recover({"x": jax.ShapeDtypeStruct((), jnp.float32)})
    assert got.step_info.global_step == 14 and float(got.state["x"]) == 15.0
