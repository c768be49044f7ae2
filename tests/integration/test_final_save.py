"""The step a checkpoint records is the step that just completed, in maybe_save, save and
recover alike: a job that finishes cleanly and is resumed for more steps continues exactly
where it stopped, and the usual slip (a final ``save`` of the step after the last one) is
refused instead of silently skipping a step on resume. A sync save returns only once its step
is committed and retention after it ran, whichever call started that save."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxckpt import CheckpointManager, ConfigError, Every, RecoverConfig, StepInfo
from jaxckpt.backends.orbax.backend import OrbaxBackend
from jaxckpt.models import MLP

from support.held_writes import check_final_sync_save, committed_after_each_sync_save

STEPS_PER_EPOCH = 5
N = 7  # not a multiple of the save cadence nor of the epoch: the final save matters


class Loader:
    """A shuffling loader over a tiny synthetic data set; its position is its state.
    (Not support.loaders.Loader: the final-save tests need the batches it yields.)"""

    def __init__(self, seed: int = 0):
        data = np.random.default_rng(123)
        self.x = data.normal(size=(STEPS_PER_EPOCH * 4, 8)).astype(np.float32)
        self.y = data.normal(size=(STEPS_PER_EPOCH * 4, 2)).astype(np.float32)
        self.seed, self.epoch, self.index = seed, 0, 0

    def __next__(self):
        order = np.random.default_rng(self.seed + self.epoch).permutation(len(self.x))
        take = order[self.index * 4:(self.index + 1) * 4]
        self.index += 1
        if self.index == STEPS_PER_EPOCH:
            self.epoch, self.index = self.epoch + 1, 0
        return self.x[take], self.y[take]

    def state_dict(self):
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state):
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]


@nnx.jit
def train_step(model, optimizer, x, y):
    def loss_fn(model):
        return ((model(x) - y) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def train(root, total_steps: int) -> tuple[list[str], dict]:
    """The README's loop: resume if possible, train to ``total_steps``, one final save."""
    model = MLP([8, 16, 2], rngs=nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    loader = Loader()
    losses = []
    config = RecoverConfig(every=Every(steps=3), keep_last_n=2)
    with CheckpointManager(root, recover=config, preemption_signals=()) as mgr:
        step = StepInfo(0, 0, 0, STEPS_PER_EPOCH)
        recovered = mgr.recover(nnx.state((model, optimizer)), stateful={"loader": loader})
        if recovered is not None:
            nnx.update((model, optimizer), recovered.state)
            step = recovered.step_info.next()
        while step.global_step < total_steps:
            losses.append(float(train_step(model, optimizer, *next(loader))).hex())
            mgr.maybe_save(step, lambda: nnx.state((model, optimizer)))
            step = step.next()
        mgr.save(state=lambda: nnx.state((model, optimizer)), mode="sync")
        final = mgr.committed_steps()[-1]
    arrays = jax.tree.map(lambda a: np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(
        a.dtype, jax.dtypes.prng_key) else a), nnx.to_pure_dict(nnx.state((model, optimizer))))
    return losses, {"arrays": arrays, "loader": loader.state_dict(), "final": final}


def test_a_finished_job_resumed_for_more_steps_matches_one_uninterrupted_run(tmp_path):
    first, _ = train(tmp_path / "resumed", N)
    second, resumed = train(tmp_path / "resumed", 2 * N)
    straight, reference = train(tmp_path / "straight", 2 * N)
    assert len(first) == N and len(second) == N  # no step skipped, none done twice
    assert first + second == straight
    assert resumed["loader"] == reference["loader"]
    assert resumed["final"] == reference["final"] == 2 * N - 1  # the last step that ran
    flat = jax.tree_util.tree_leaves_with_path(resumed["arrays"])
    expected = dict(jax.tree_util.tree_leaves_with_path(reference["arrays"]))
    for path, value in flat:
        np.testing.assert_array_equal(value, expected[path], err_msg=jax.tree_util.keystr(path))
        assert value.tobytes() == expected[path].tobytes()


def tree():
    return {"w": np.arange(4, dtype=np.float32)}


def test_a_final_save_one_past_the_last_completed_step_is_refused(tmp_path):
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=10)),
                           preemption_signals=()) as mgr:
        step = StepInfo(0, 0, 0)
        for _ in range(3):
            mgr.maybe_save(step, tree())
            step = step.next()
        with pytest.raises(ConfigError, match=r"global_step=3, one past .*global_step=2") as info:
            mgr.save(step, tree())
        assert "mgr.save(state=...)" in str(info.value)
        assert mgr.committed_steps() == []  # nothing written for the refused call
        report = mgr.save(state=tree(), mode="sync")
        assert report.step == 2 and mgr.committed_steps() == [2]


def test_after_recover_the_resumed_step_is_the_last_completed_one(tmp_path):
    with CheckpointManager(tmp_path, preemption_signals=()) as mgr:
        mgr.save(StepInfo(0, 4, 4), tree(), mode="sync")
    with CheckpointManager(tmp_path, preemption_signals=()) as mgr:
        recovered = mgr.recover(tree())
        assert recovered.step_info.global_step == 4
        with pytest.raises(ConfigError, match="one past"):
            mgr.save(recovered.step_info.next(), tree())
        # Nothing trained since the resume: the final save is the one already on disk.
        assert mgr.save(state=tree()).step == 4
        assert mgr.committed_steps() == [4]


def test_a_save_without_a_step_before_any_step_says_what_to_pass(tmp_path):
    with CheckpointManager(tmp_path, preemption_signals=()) as mgr:
        with pytest.raises(ConfigError, match=r"mgr.save\(step_info, state\)"):
            mgr.save(state=tree())
        with pytest.raises(ConfigError, match="needs the state"):
            mgr.save(StepInfo())



def test_an_explicit_restore_is_not_a_resume_point(tmp_path):
    # restore() also serves evaluation and inspection: a forced save of the next step after
    # it is the caller's own bookkeeping, not the slip the check catches.
    with CheckpointManager(tmp_path, preemption_signals=()) as mgr:
        mgr.save(StepInfo(0, 4, 4), tree(), mode="sync")
        restored = mgr.restore(tree())
        assert mgr.save(restored.step_info.next(), tree(), mode="sync").step == 5


# ------------------------------------------------ a sync save returns a committed checkpoint


def test_a_sync_save_of_a_step_an_async_save_started_returns_once_it_committed(tmp_path):
    check_final_sync_save(CheckpointManager, OrbaxBackend(), tmp_path, tree())


def test_committed_steps_after_each_sync_save_already_reflect_its_retention(tmp_path):
    seen = committed_after_each_sync_save(CheckpointManager, tmp_path, tree(), 6)
    assert seen == [[0], [0, 1], [1, 2], [2, 3], [3, 4], [4, 5]]
