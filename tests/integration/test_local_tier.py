"""The fast local tier (``CheckpointManager(root, local=LocalTier(...))``) over the Orbax
backend: which tier takes which save, retention per tier, recovery across both tiers (the
newest valid first, local before durable at an equal step), falling back when the local copy
is lost or corrupt, failing closed across both, and a durable root that never depends on the
local one. SIGKILLed training workers: tests/system/test_local_tier_kills.py."""

import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointRootError,
    CheckpointWarning,
    ConfigError,
    Every,
    LocalTier,
    RecoverConfig,
    StepInfo,
)
from jaxckpt.backends.orbax.backend import OrbaxBackend
from jaxckpt.commit.store import CheckpointStore

from support.loaders import Loader

DURABLE_EVERY = 6
LOCAL_EVERY = 2


def tree(value):
    return {"w": jnp.full((8, 4), value, jnp.float32), "n": jnp.asarray(int(value), jnp.int32),
            "key": jax.random.fold_in(jax.random.key(3), int(value))}


def like():
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree(0.0))


def manager(tmp_path, *, local=True, keep_durable=2, keep_local=1, mode="sync", items=None,
            **kwargs):
    tier = (LocalTier(tmp_path / "local", every=Every(steps=LOCAL_EVERY), keep_last_n=keep_local)
            if local else None)
    return CheckpointManager(tmp_path / "durable", local=tier, mode=mode, items=items,
                             recover=RecoverConfig(every=Every(steps=DURABLE_EVERY),
                                                   keep_last_n=keep_durable, **kwargs),
                             preemption_signals=())


def train(mgr, steps, loader=None, start=None, with_item=False):
    """Steps ``start.. start+steps-1``: the state of step s holds s (and the item "ref",
    with ``with_item``, the step it was last updated at, every 4 steps); returns the
    reports."""
    info = start or StepInfo(0, 0, 0, None)
    reports = []
    for _ in range(steps):
        if loader is not None:
            loader.position += 1
        items = {"ref": tree(float(info.global_step // 4 * 4))} if with_item else None
        reports += mgr.maybe_save(info, tree(float(info.global_step)), items=items,
                                  stateful={"loader": loader} if loader else None)
        info = info.next()
    mgr.wait()
    return reports


def committed(root):
    return CheckpointStore(root).committed_steps()


def flip_a_byte_of_the_arrays(step_dir):
    """Damage the biggest array file of a checkpoint (its manifest still names it)."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as handle:
        first = handle.read(1)
        handle.seek(0)
        handle.write(bytes([first[0] ^ 0xFF]))


def assert_state_of_step(state, step):
    expected = tree(float(step))
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(expected["w"]))
    assert int(state["n"]) == step
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(state["key"])),
                                  np.asarray(jax.random.key_data(expected["key"])))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_local_tier_takes_the_frequent_saves_and_leaves_the_durable_cadence_alone(
        tmp_path, mode):
    with manager(tmp_path / "plain", local=False, mode=mode) as mgr:
        plain = train(mgr, 20)
    with manager(tmp_path / "tiered", mode=mode) as mgr:
        tiered = train(mgr, 20)
    durable_steps = [s for s in range(20) if (s + 1) % DURABLE_EVERY == 0]
    assert [(r.step, r.tier) for r in plain] == [(s, "durable") for s in durable_steps]
    # Every durable save happens at its own steps, as without the local tier; the local tier
    # takes the steps where only it is due (where both are, the durable root is written).
    assert [r.step for r in tiered if r.tier == "durable"] == durable_steps
    assert [r.step for r in tiered if r.tier == "local"] == [
        s for s in range(20) if (s + 1) % LOCAL_EVERY == 0 and s not in durable_steps]
    for report in tiered:
        assert report.done() and report.error is None and report.bytes > 0
        assert report.path.startswith(str(tmp_path / "tiered" / report.tier))
    # Retention per tier: durable keeps its last 2, the local tier its last 1.
    assert committed(tmp_path / "tiered" / "durable") == durable_steps[-2:]
    assert committed(tmp_path / "tiered" / "local") == [19]


def test_retention_applies_per_tier(tmp_path):
    with manager(tmp_path, keep_durable=1, keep_local=3) as mgr:
        train(mgr, 30)
    assert committed(tmp_path / "durable") == [29]
    assert committed(tmp_path / "local") == [21, 25, 27]  # 23 and 29 went to the durable root


def test_recover_resumes_from_the_newest_valid_checkpoint_of_either_tier(tmp_path):
    loader = Loader()
    with manager(tmp_path) as mgr:
        train(mgr, 10, loader=loader)  # durable: 5; local: 9
    fresh = Loader()
    with manager(tmp_path) as mgr:
        result = mgr.recover(like(), stateful={"loader": fresh})
        assert (result.tier, result.step_info.global_step) == ("local", 9)
        assert_state_of_step(result.state, 9)
        assert fresh.position == 10
        # The next saves go on from step 10, each to its own tier.
        later = train(mgr, 4, start=result.step_info.next())
    assert [(r.step, r.tier) for r in later] == [(11, "durable"), (13, "local")]


def test_at_an_equal_step_the_local_copy_is_restored(tmp_path):
    with manager(tmp_path) as mgr:
        train(mgr, 6)  # step 5: durable only
        mgr.save(StepInfo(0, 0, 5, None), tree(5.0))  # already saved: the same report
    with manager(tmp_path) as mgr:
        shutil.copytree(tmp_path / "durable" / "recover" / "step_00000005",
                        tmp_path / "local" / "recover" / "step_00000005")
        result = mgr.recover(like())
        assert (result.tier, result.step_info.global_step) == ("local", 5)
        assert_state_of_step(result.state, 5)


def test_a_lost_local_tier_falls_back_to_the_durable_root_and_says_so(tmp_path):
    with manager(tmp_path) as mgr:
        train(mgr, 10)
    shutil.rmtree(tmp_path / "local")  # a new machine: the local disk is empty
    with manager(tmp_path) as mgr:
        with pytest.warns(CheckpointWarning, match=r"local tier .*local holds no checkpoint "
                          r"\(a new machine.*resuming from the durable tier at step 5"):
            result = mgr.recover(like())
        assert (result.tier, result.step_info.global_step) == ("durable", 5)
        assert_state_of_step(result.state, 5)


def test_a_corrupt_local_checkpoint_falls_back_and_is_set_aside(tmp_path):
    with manager(tmp_path) as mgr:
        train(mgr, 10)
    flip_a_byte_of_the_arrays(tmp_path / "local" / "recover" / "step_00000009")
    with manager(tmp_path) as mgr:
        with pytest.warns(CheckpointWarning, match=r"resuming from the durable tier at step 5.*"
                          r"local tier: .*step_00000009.*crc32c"):
            result = mgr.recover(like())
        assert (result.tier, result.step_info.global_step) == ("durable", 5)
        assert_state_of_step(result.state, 5)
        assert any("step_00000009" in line for line in result.skipped)
    assert committed(tmp_path / "local") == []
    assert len(os.listdir(tmp_path / "local" / "recover" / "superseded")) == 1


def test_a_corrupt_durable_checkpoint_falls_back_to_an_older_local_one(tmp_path):
    with manager(tmp_path, keep_durable=1) as mgr:
        train(mgr, 12)  # durable: 11 (5 deleted); local: 9
    flip_a_byte_of_the_arrays(tmp_path / "durable" / "recover" / "step_00000011")
    with manager(tmp_path, keep_durable=1) as mgr:
        with pytest.warns(CheckpointWarning, match="resuming from the local tier at step 9"):
            result = mgr.recover(like())
        assert (result.tier, result.step_info.global_step) == ("local", 9)
        assert_state_of_step(result.state, 9)


def test_nothing_valid_in_either_tier_fails_closed_and_touches_nothing(tmp_path):
    with manager(tmp_path) as mgr:
        train(mgr, 10)
    for path in (tmp_path / "durable" / "recover" / "step_00000005",
                 tmp_path / "local" / "recover" / "step_00000009"):
        flip_a_byte_of_the_arrays(path)
    with manager(tmp_path) as mgr, pytest.raises(
            CheckpointCorruptError,
            match=r"(?s)none verifies.*local tier: .*step_00000009.*durable tier: .*step_00000005"):
        mgr.recover(like())
    assert committed(tmp_path / "durable") == [5] and committed(tmp_path / "local") == [9]
    with manager(tmp_path, on_corrupt="start_fresh") as mgr, \
            pytest.warns(CheckpointWarning, match="starting fresh"):
        assert mgr.recover(like()) is None
    assert committed(tmp_path / "durable") == [] and committed(tmp_path / "local") == []


def test_damaged_local_checkpoints_with_an_empty_durable_root_start_fresh_and_say_so(tmp_path):
    with manager(tmp_path) as mgr:
        train(mgr, 4)  # local: 3; durable: none yet
    flip_a_byte_of_the_arrays(tmp_path / "local" / "recover" / "step_00000003")
    with manager(tmp_path) as mgr, pytest.warns(
            CheckpointWarning, match=r"(?s)local tier .* holds no usable checkpoint and the "
                                     r"durable root .* none at all: starting fresh.*step_00000003"):
        assert mgr.recover(like()) is None
    assert committed(tmp_path / "local") == []


def test_restore_of_a_step_prefers_a_valid_local_copy(tmp_path):
    with manager(tmp_path, keep_local=2) as mgr:
        train(mgr, 10)  # local: 7, 9; durable: 5
        assert mgr.restore(like(), step=7).tier == "local"
        assert mgr.restore(like(), step=5).tier == "durable"
        flip_a_byte_of_the_arrays(tmp_path / "local" / "recover" / "step_00000009")
        with pytest.raises(CheckpointCorruptError, match="step_00000009"):
            mgr.restore(like(), step=9)


def test_the_durable_root_never_depends_on_the_local_tier(tmp_path):
    with manager(tmp_path, items={"ref": Every(steps=4)}) as mgr:
        train(mgr, 14, loader=Loader(), with_item=True)
    assert os.listdir(tmp_path / "local" / "recover" / "items" / "ref")  # each tier its own
    shutil.rmtree(tmp_path / "local")
    store = CheckpointStore(tmp_path / "durable")
    for step in store.committed_steps():
        assert store.verify(store.step_path(step)) == []
    # A manager without a local tier resumes from the durable root alone.
    loader = Loader()
    with manager(tmp_path, local=False, items={"ref": Every(steps=4)}) as mgr:
        result = mgr.recover(like(), stateful={"loader": loader}, items={"ref": like()})
    assert (result.tier, result.step_info.global_step) == ("durable", 11)
    assert_state_of_step(result.state, 11)
    assert loader.position == 12
    assert_state_of_step(result.items["ref"], 8)  # the version current at step 11


def test_a_failed_local_write_is_a_warning_and_the_durable_root_goes_on(tmp_path):
    class LocalDiskFails(OrbaxBackend):
        def write(self, directory, state, *, asynchronous):
            if os.sep + "local" + os.sep in directory:
                raise OSError(28, "No space left on device")
            return super().write(directory, state, asynchronous=asynchronous)

    backend = LocalDiskFails()
    try:
        mgr = CheckpointManager(
            tmp_path / "durable", backend=backend, mode="sync", preemption_signals=(),
            recover=RecoverConfig(every=Every(steps=DURABLE_EVERY)),
            local=LocalTier(tmp_path / "local", every=Every(steps=LOCAL_EVERY)))
        with mgr, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reports = train(mgr, 8)
    finally:
        backend.close()
    failed = [r for r in reports if r.tier == "local"]
    assert failed and all(r.error is not None for r in failed)
    assert any("No space left" in str(w.message) for w in caught)
    assert committed(tmp_path / "durable") == [5]


def test_a_local_tier_of_another_durable_root_is_refused(tmp_path):
    with manager(tmp_path / "run1") as mgr:
        train(mgr, 4)
    shutil.move(tmp_path / "run1" / "local", tmp_path / "shared-local")
    other = CheckpointManager(tmp_path / "run2", preemption_signals=(),
                              local=LocalTier(tmp_path / "run1-placeholder"))
    other.close()
    with pytest.raises(CheckpointRootError, match=r"belongs to another durable root .*run1"):
        CheckpointManager(tmp_path / "run2", preemption_signals=(),
                          local=LocalTier(tmp_path / "shared-local"))
    # The refusal left run2's root usable (its lock released).
    CheckpointManager(tmp_path / "run2", preemption_signals=()).close()
    with open(tmp_path / "run1-placeholder" / "tier.json") as handle:
        assert json.load(handle)["durable_root"] == str(tmp_path / "run2")


def test_overlapping_tiers_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="overlap"):
        CheckpointManager(tmp_path, local=LocalTier(tmp_path / "local"), preemption_signals=())
    with pytest.raises(ConfigError, match="overlap"):
        CheckpointManager(tmp_path / "a", local=LocalTier(tmp_path / "a"), preemption_signals=())
    assert list(tmp_path.iterdir()) == []  # refused before anything was created
