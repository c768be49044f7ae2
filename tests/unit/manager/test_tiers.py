"""``LocalTier`` validation and the local tier's start-up rules (no backend I/O: a stub
backend). The tier's saves and recovery over the Orbax backend:
tests/integration/test_local_tier.py."""

import os

import pytest

import jaxckpt
from jaxckpt import (
    CheckpointManager,
    CheckpointRootError,
    ConfigError,
    Every,
    LocalTier,
    RecoverConfig,
    RootLockedError,
)
from jaxckpt.backends.base import SingleProcess
from jaxckpt.manager.local_tier import local_rules


class Stub(SingleProcess):
    name = "orbax"


class TwoProcesses(Stub):
    process_count = 2


def test_local_tier_is_exported_with_the_binding_signature(tmp_path):
    tier = jaxckpt.LocalTier(tmp_path, every=jaxckpt.Every(steps=50), keep_last_n=1)
    assert (tier.path, tier.every, tier.keep_last_n) == (tmp_path, Every(steps=50), 1)
    assert LocalTier(tmp_path) == tier  # those are the defaults


@pytest.mark.parametrize("kwargs, match", [
    ({"path": None}, "LocalTier.path must be a directory path"),
    ({"path": ""}, "LocalTier.path must be a directory path"),
    ({"path": "s3://bucket/run"}, "LocalTier.path must be a local filesystem path"),
    ({"every": Every()}, "never fires"),
    ({"every": {"steps": 5}}, "LocalTier.every must be a jaxckpt.Every"),
    ({"keep_last_n": 0}, r"LocalTier.keep_last_n must be an int >= 1 .*got 0"),
    ({"keep_last_n": None}, "LocalTier.keep_last_n must be an int >= 1"),
    ({"keep_last_n": True}, "LocalTier.keep_last_n must be an int >= 1"),
])
def test_a_bad_local_tier_is_refused_naming_the_field(kwargs, match):
    path = kwargs.pop("path", "/tmp/local")
    with pytest.raises(ConfigError, match=match):
        LocalTier(path, **kwargs)


def test_the_local_tier_keeps_the_durable_checks_with_its_own_cadence_and_retention():
    durable = RecoverConfig(every=Every(steps=100), keep_last_n=3, keep_every=Every(steps=1000),
                            keep_best=jaxckpt.KeepBest(metric="loss"), verify="sizes",
                            on_corrupt="start_fresh")
    rules = local_rules(durable, LocalTier("/l", every=Every(steps=5), keep_last_n=2))
    assert (rules.every, rules.keep_last_n, rules.keep_every, rules.keep_best) == (
        Every(steps=5), 2, None, None)
    assert (rules.verify, rules.on_corrupt) == ("sizes", "start_fresh")


def test_a_multi_process_run_is_refused_and_leaves_the_roots_free(tmp_path):
    with pytest.raises(ConfigError, match="single-process runs only"):
        CheckpointManager(tmp_path / "durable", backend=TwoProcesses(), preemption_signals=(),
                          local=LocalTier(tmp_path / "local"))
    CheckpointManager(tmp_path / "durable", backend=Stub(), preemption_signals=(),
                      local=LocalTier(tmp_path / "local")).close()


def test_local_must_be_a_local_tier(tmp_path):
    with pytest.raises(ConfigError, match="local must be a jaxckpt.LocalTier"):
        CheckpointManager(tmp_path, backend=Stub(), local=str(tmp_path / "local"))
    assert not os.listdir(tmp_path)


def test_the_local_root_is_locked_for_the_job(tmp_path):
    first = CheckpointManager(tmp_path / "a", backend=Stub(), preemption_signals=(),
                              local=LocalTier(tmp_path / "local"))
    try:
        with pytest.raises(RootLockedError):
            CheckpointManager(tmp_path / "b", backend=Stub(), preemption_signals=(),
                              local=LocalTier(tmp_path / "local"))
        # The refused manager let go of its own durable root.
        CheckpointManager(tmp_path / "b", backend=Stub(), preemption_signals=()).close()
    finally:
        first.close()


def test_a_local_root_holding_foreign_files_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointRootError, match="notes.txt"):
        CheckpointManager(tmp_path / "durable", backend=Stub(), preemption_signals=(),
                          local=LocalTier(tmp_path / "local"))
    assert sorted(os.listdir(tmp_path / "local")) == ["notes.txt"]
