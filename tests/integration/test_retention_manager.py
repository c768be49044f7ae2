"""The retention engine and pins through a real CheckpointManager (Orbax backend, numpy state):
keep-every, keep-best across a restart, pins that survive restarts, pin errors."""

import json

import numpy as np
import pytest

from jaxckpt import (
    CheckpointManager,
    CheckpointNotFoundError,
    Every,
    KeepBest,
    RecoverConfig,
    StepInfo,
)


def state(value: float) -> dict:
    return {"w": np.full((4, 4), value, np.float32)}


def run(mgr, steps, loss=lambda step: 1.0):
    for step in steps:
        mgr.maybe_save(StepInfo(0, step, step), state(step), metrics={"loss": loss(step)})
    mgr.wait()


LOSSES = {1: 0.9, 3: 0.2, 5: 0.5, 7: 0.4, 9: 0.6, 11: 0.7}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_keep_best_and_keep_every_survive_a_restart(tmp_path, mode):
    config = RecoverConfig(every=Every(steps=2), keep_last_n=1, keep_every=Every(steps=4),
                           keep_best=KeepBest(metric="loss", mode="min", n=1))
    with CheckpointManager(tmp_path, recover=config, mode=mode) as mgr:
        run(mgr, range(6), loss=lambda step: LOSSES.get(step, 1.0))
        # 1 (loss 0.9) gone; 3: best and every-4; 5: newest
        assert mgr.committed_steps() == [3, 5]
    # A new manager reads the metrics back from the checkpoints it did not write.
    with CheckpointManager(tmp_path, recover=config, mode=mode) as mgr:
        run(mgr, range(6, 12), loss=lambda step: LOSSES.get(step, 1.0))
        assert mgr.committed_steps() == [3, 7, 11]  # 3 best, 7 every-4, 11 newest and every-4


def test_default_retention_records_its_rules_in_driver_json(tmp_path):
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1)),
                           mode="sync") as mgr:
        run(mgr, range(3))
        assert mgr.committed_steps() == [2]
    driver = json.loads((tmp_path / "recover" / "step_00000002" / "driver.json").read_text())
    assert driver["retention"] == {"keep_last_n": 1, "keep_every": None, "keep_best": None}
    assert driver["metrics"] == {"loss": 1.0}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_pinned_checkpoint_survives_retention_and_restarts(tmp_path, mode):
    config = RecoverConfig(every=Every(steps=1), keep_last_n=1)
    with CheckpointManager(tmp_path, recover=config, mode=mode) as mgr:
        run(mgr, range(2))
        mgr.pin(1)
        run(mgr, range(2, 4))
        assert mgr.committed_steps() == [1, 3]
    assert json.loads((tmp_path / "pins.json").read_text())["steps"] == [1]
    with CheckpointManager(tmp_path, recover=config, mode=mode) as mgr:  # a restart
        run(mgr, range(4, 6))
        assert mgr.committed_steps() == [1, 5]
        mgr.unpin(1)
    with CheckpointManager(tmp_path, recover=config, mode=mode) as mgr:
        run(mgr, range(6, 7))
        assert mgr.committed_steps() == [6]


def test_pin_right_after_an_async_save_waits_for_it(tmp_path):
    config = RecoverConfig(every=Every(steps=1), keep_last_n=1)
    with CheckpointManager(tmp_path, recover=config, mode="async") as mgr:
        mgr.maybe_save(StepInfo(0, 0, 0), state(0))
        mgr.pin(0)
        run(mgr, range(1, 3))
        assert mgr.committed_steps() == [0, 2]


def test_pinning_a_step_without_a_checkpoint_lists_the_committed_ones(tmp_path):
    config = RecoverConfig(every=Every(steps=1), keep_last_n=2)
    with CheckpointManager(tmp_path, recover=config, mode="sync") as mgr:
        run(mgr, range(3))
        with pytest.raises(CheckpointNotFoundError, match=r"step 0.*committed steps: \[1, 2\]"):
            mgr.pin(0)
        mgr.unpin(0)  # never pinned: nothing to do
    assert not (tmp_path / "pins.json").exists()


def test_an_unreadable_pins_file_makes_retention_delete_nothing(tmp_path):
    config = RecoverConfig(every=Every(steps=1), keep_last_n=1)
    with CheckpointManager(tmp_path, recover=config, mode="sync") as mgr:
        run(mgr, range(1))
        (tmp_path / "pins.json").write_text("{not json")
        with pytest.warns(UserWarning, match="retention deleted nothing"):
            run(mgr, range(1, 3))
        assert mgr.committed_steps() == [0, 1, 2]
