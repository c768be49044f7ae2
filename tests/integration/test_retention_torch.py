"""The retention engine and pins through DcpCheckpointManager: the same rules as the Orbax
manager (test_retention_manager.py), since they live in the shared manager, over torch state;
and a sync save returns only once its step committed and its retention ran."""

import pytest

torch = pytest.importorskip("torch")

from jaxckpt import Every, KeepBest, RecoverConfig, StepInfo  # noqa: E402
from torch_bridge import DcpBackend, DcpCheckpointManager  # noqa: E402

from support.held_writes import (  # noqa: E402
    check_final_sync_save,
    committed_after_each_sync_save,
)


def run(mgr, steps, losses):
    model = torch.nn.Linear(3, 2)
    for step in steps:
        mgr.maybe_save(StepInfo(0, step, step), {"model": model},
                       metrics={"accuracy": losses.get(step, 0.0)})
    mgr.wait()


def test_keep_best_and_pins_hold_across_a_restart(tmp_path):
    config = RecoverConfig(every=Every(steps=1), keep_last_n=1,
                           keep_best=KeepBest(metric="accuracy", mode="max", n=1))
    accuracy = {2: 0.9, 5: 0.95}
    with DcpCheckpointManager(tmp_path, recover=config, mode="async") as mgr:
        run(mgr, range(4), accuracy)
        assert mgr.committed_steps() == [2, 3]
        mgr.pin(3)
    with DcpCheckpointManager(tmp_path, recover=config, mode="sync") as mgr:
        run(mgr, range(4, 7), accuracy)
        assert mgr.committed_steps() == [3, 5, 6]  # 3 pinned, 5 best, 6 newest


def test_a_sync_save_of_a_step_an_async_save_started_returns_once_it_committed(tmp_path):
    check_final_sync_save(DcpCheckpointManager, DcpBackend(), tmp_path,
                          {"model": torch.nn.Linear(3, 2)})


def test_committed_steps_after_each_sync_save_already_reflect_its_retention(tmp_path):
    seen = committed_after_each_sync_save(DcpCheckpointManager, tmp_path,
                                          {"model": torch.nn.Linear(3, 2)}, 4)
    assert seen == [[0], [0, 1], [1, 2], [2, 3]]
