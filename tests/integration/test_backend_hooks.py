"""The tools' backend hooks behave as backends: a held write still commits, with the real
write's checksums, and a timed write records its duration."""

from __future__ import annotations

import numpy as np

from jaxckpt import CheckpointManager, RecoverConfig, StepInfo
from jaxckpt.tools.backend_hooks import HeldBackend, TimedBackend


def test_a_held_write_commits_once_the_hold_is_over(tmp_path):
    backend = HeldBackend(hold_s=0.05, at_step=1)
    state = {"w": np.arange(1000, dtype=np.float32)}
    with CheckpointManager(tmp_path, recover=RecoverConfig(keep_last_n=None), backend=backend,
                           preemption_signals=()) as mgr:
        for step in range(3):
            backend.current_step = step
            mgr.save(StepInfo(0, step, step), state, mode="async").wait()
        assert mgr.committed_steps() == [0, 1, 2]
        restored = mgr.restore({"w": np.zeros(1000, np.float32)}, step=1)
    np.testing.assert_array_equal(restored.state["w"], state["w"])


def test_a_timed_write_records_each_call(tmp_path):
    backend = TimedBackend()
    with CheckpointManager(tmp_path, backend=backend, preemption_signals=()) as mgr:
        mgr.save(StepInfo(), {"w": np.ones(8, np.float32)}, mode="sync")
    assert len(backend.write_s) == 1 and backend.write_s[0] > 0
