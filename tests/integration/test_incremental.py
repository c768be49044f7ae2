"""Incremental checkpoints end to end with the Orbax backend (issue 32): a state with a frozen
subtree saved 20 times with ``RecoverConfig(incremental=True)`` writes the frozen data once,
restores bit-exact from every kept checkpoint, verifies, and survives retention deleting the
checkpoint that holds the shared files; a base removed by hand makes the next save write
the data again; a missing referenced file makes its checkpoints corrupt and recovery falls
back past them.

What a save wrote is counted through the storage layer, not from the directory:
``backends.orbax.files.WRITTEN`` (every byte the native writer hands to a chunk file or a
metadata file of ``arrays/``) plus the files the manager writes beside them (driver.json,
tree.json, the commit marker), which are listed from the new checkpoint directory (each of
them is written whole by this save)."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxckpt
from jaxckpt.backends.base import BackendFeatures
from jaxckpt.backends.orbax.backend import OrbaxBackend
from jaxckpt.backends.orbax.files import WRITTEN
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.core.layout import step_dirname
from jaxckpt.errors import CheckpointCorruptError, CheckpointWarning, ConfigError
from jaxckpt.tools import cli

from support.two_processes import jax_worker, run_two_workers


def frozen_tree(leaves: int, mib_each: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    rows = mib_each * (1 << 20) // (4 * 1024)
    return {f"block_{i}": jnp.asarray(rng.standard_normal((rows, 1024), np.float32))
            for i in range(leaves)}


class Run:
    """A model with a frozen subtree and trained params under optax.adam."""

    def __init__(self, frozen: dict, trained_kib: int):
        rows = trained_kib * 1024 // (4 * 256) // 2
        key = jax.random.key(1)
        self.params = {"w_in": jax.random.normal(key, (rows, 256)) * 0.1,
                       "w_out": jax.random.normal(key, (256, rows)) * 0.1}
        self.frozen = frozen
        self.optimizer = optax.adam(1e-3)
        self.opt_state = self.optimizer.init(self.params)

        @jax.jit
        def step(params, opt_state, frozen_block):
            def loss(p):
                hidden = jnp.tanh(frozen_block[:p["w_in"].shape[0], :256] @ p["w_in"].T)
                return jnp.mean((hidden @ p["w_out"].T) ** 2)
            grads = jax.grad(loss)(params)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._step = step

    def train(self) -> None:
        first = next(iter(self.frozen.values()))
        self.params, self.opt_state = self._step(self.params, self.opt_state, first)

    def state(self, step: int) -> dict:
        return {"frozen": self.frozen, "params": self.params, "opt": self.opt_state,
                "step": step}


def nbytes(tree) -> int:
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(tree))


def host(tree):
    return jax.tree.map(lambda leaf: np.array(leaf), tree)


def assert_bitwise(actual, expected) -> None:
    got, want = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def written_by(store: CheckpointStore, step: int, counted: int) -> int:
    """Bytes the save of ``step`` wrote: the native writer's count plus the manager's files
    outside ``arrays/`` (see the module docstring)."""
    path = store.step_path(step)
    beside = sum(size for rel, size in store.storage.list_files(path).items()
                 if not rel.startswith("state/arrays/"))
    return counted + beside


def run_saves(root, run: Run, saves: int, config, *, mode="sync"):
    """Save ``saves`` times (training between saves); per step: (bytes written, host copy)."""
    out = {}
    with jaxckpt.CheckpointManager(root, recover=config, mode=mode) as mgr:
        for step in range(saves):
            run.train()
            before = WRITTEN.total()
            mgr.save(jaxckpt.StepInfo(global_step=step), run.state(step), mode="sync")
            out[step] = (WRITTEN.total() - before, host(run.state(step)))
    return out


def check_twenty_saves(root, frozen: dict, trained_kib: int) -> None:
    run = Run(frozen, trained_kib)
    config = jaxckpt.RecoverConfig(incremental=True, keep_last_n=2,
                                   keep_every=jaxckpt.Every(steps=5))
    saved = run_saves(root, run, 20, config)
    store = CheckpointStore(root)
    changed = nbytes(run.state(0)) - nbytes(frozen)
    for step in range(1, 20):
        if step in store.committed_steps():
            assert written_by(store, step, saved[step][0]) <= 1.05 * changed, step
        else:  # deleted by retention: what the native writer counted alone
            assert saved[step][0] <= 1.05 * changed, step
    kept = store.committed_steps()
    assert kept == [4, 9, 14, 18, 19]
    # Retention deleted step 0, which holds the frozen files every kept checkpoint uses.
    owner = os.path.join(store.recover_dir, step_dirname(0))
    assert all(os.path.getsize(os.path.join(owner, key.split("/", 1)[1])) == entry["size"]
               for step in kept for key, entry in store.read_manifest(
                   store.step_path(step)).refs.items() if key.startswith(step_dirname(0)))
    with jaxckpt.CheckpointManager(root, recover=config) as mgr:
        for step in kept:
            assert store.verify(store.step_path(step)) == []
            manifest = store.read_manifest(store.step_path(step))
            assert manifest.referenced_bytes >= nbytes(frozen)
            restored = mgr.restore(run.state(0), step=step)
            assert_bitwise(restored.state, saved[step][1])


def test_twenty_saves_write_only_what_changed(tmp_path):
    check_twenty_saves(str(tmp_path / "root"), frozen_tree(4, 8), trained_kib=1024)


@pytest.mark.slow
def test_twenty_saves_at_full_size(tmp_path):
    check_twenty_saves(str(tmp_path / "root"), frozen_tree(8, 32), trained_kib=4096)


def test_async_saves_and_a_partial_restore(tmp_path, capsys):
    root = str(tmp_path / "root")
    run = Run(frozen_tree(2, 2), trained_kib=64)
    config = jaxckpt.RecoverConfig(incremental=True, keep_last_n=3)
    with jaxckpt.CheckpointManager(root, recover=config, mode="async") as mgr:
        reports = []
        for step in range(3):
            run.train()
            reports.append(mgr.save(jaxckpt.StepInfo(global_step=step), run.state(step)))
        mgr.wait()
        assert reports[2].bytes < nbytes(run.frozen) // 4
        partial = mgr.restore({"frozen": run.frozen}, partial=True)
        assert_bitwise(partial.state, {"frozen": host(run.frozen)})
        whole = mgr.restore(run.state(0))
        assert_bitwise(whole.state, host(run.state(2)))
    # info --tree says where each array's data lives.
    assert cli.main(["info", os.path.join(root, "recover", step_dirname(2)), "--tree"]) == 0
    table = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()
             if line.startswith("['")}
    assert "referenced from step 0" in table["['frozen']['block_0']"]
    assert table["['params']['w_in']"].rstrip().endswith("stored")


class NotIncremental(OrbaxBackend):
    features = BackendFeatures(supports_async=True, verifies_reads=True, object_storage=True)


def test_a_backend_that_cannot_refer_is_refused(tmp_path):
    backend = NotIncremental()
    with pytest.raises(ConfigError, match="RecoverConfig.incremental"):
        jaxckpt.CheckpointManager(str(tmp_path), backend=backend,
                                  recover=jaxckpt.RecoverConfig(incremental=True))
    backend.close()


def test_a_base_removed_by_hand_is_written_again(tmp_path):
    root = str(tmp_path / "root")
    run = Run(frozen_tree(1, 2), trained_kib=16)
    config = jaxckpt.RecoverConfig(incremental=True, keep_last_n=None)
    run_saves(root, run, 2, config)
    store = CheckpointStore(root)
    # The owner of the frozen file goes to superseded/ by hand: step 1 refers into it, so
    # it is corrupt now, and the next save must not refer to what step 1 listed.
    store.quarantine(store.step_path(0), "test")
    assert store.verify(store.step_path(1))
    with jaxckpt.CheckpointManager(root, recover=config) as mgr:
        run.train()
        before = WRITTEN.total()
        mgr.save(jaxckpt.StepInfo(global_step=2), run.state(2), mode="sync")
        assert WRITTEN.total() - before > nbytes(run.frozen)
        assert_bitwise(mgr.restore(run.state(0), step=2).state, host(run.state(2)))
    assert store.verify(store.step_path(2)) == []
    assert not store.read_manifest(store.step_path(2)).refs


def test_a_missing_shared_file_makes_its_checkpoints_corrupt(tmp_path):
    root = str(tmp_path / "root")
    run = Run(frozen_tree(1, 2, seed=0), trained_kib=16)
    config = jaxckpt.RecoverConfig(incremental=True, keep_last_n=None)
    first = run_saves(root, run, 1, config)[0][1]
    run.frozen = frozen_tree(1, 2, seed=1)  # new frozen data: step 1 holds it, step 2 refers
    with jaxckpt.CheckpointManager(root, recover=config) as mgr:
        for step in (1, 2):
            run.train()
            mgr.save(jaxckpt.StepInfo(global_step=step), run.state(step), mode="sync")
    store = CheckpointStore(root)
    shared = [key for key in store.read_manifest(store.step_path(2)).refs
              if key.startswith(step_dirname(1) + "/state/arrays/leaf_")]
    assert shared
    os.remove(os.path.join(store.recover_dir, shared[0]))
    problems = store.verify(store.step_path(2))
    assert problems and any("step 1" in problem for problem in problems)
    # The same root without step 0: none left that verifies, so recovery fails closed.
    other = str(tmp_path / "other")
    shutil.copytree(root, other)
    shutil.rmtree(os.path.join(other, "recover", step_dirname(0)))
    with jaxckpt.CheckpointManager(other, recover=config) as mgr, \
            pytest.raises(CheckpointCorruptError):
        mgr.recover(run.state(0))
    # Steps 2 and 1 are corrupt: recovery falls back past both, to step 0.
    with jaxckpt.CheckpointManager(root, recover=config) as mgr, \
            pytest.warns(CheckpointWarning, match="referenced from step 1"):
        recovered = mgr.recover(run.state(0))
        assert recovered is not None and recovered.step_info.global_step == 0
        assert_bitwise(recovered.state, first)


_WORKER = jax_worker('''
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxckpt import CheckpointManager, RecoverConfig, StepInfo

    sharding = NamedSharding(jax.make_mesh((4,), ("x",)), P("x"))
    frozen = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)

    def sharded(values):
        return jax.make_array_from_callback(values.shape, sharding, lambda i: values[i])

    mgr = CheckpointManager(root, recover=RecoverConfig(incremental=True, keep_last_n=None),
                            preemption_signals=())
    table = sharded(frozen)
    for step in range(3):
        w = sharded(np.full((8, 4), step, np.float32))
        mgr.save(StepInfo(global_step=step), {"frozen": table, "w": w}, mode="sync")
    mgr.close()
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("jaxckpt-test-end")
''', init_timeout=30)


def test_two_processes_refer_to_the_shards_each_wrote(tmp_path):
    root, _ = run_two_workers(_WORKER, tmp_path, timeout=150)
    store = CheckpointStore(root)
    manifest = store.read_manifest(store.step_path(2))
    # The frozen array's four chunk files, two written by each process at step 0.
    frozen = sorted(key for key in manifest.refs if "/leaf_" in key)
    assert len(frozen) == 4 and all(key.startswith(step_dirname(0)) for key in frozen)
    assert store.verify(store.step_path(2)) == []
    with jaxckpt.CheckpointManager(root, recover=jaxckpt.RecoverConfig(incremental=True)) as mgr, \
            pytest.warns(CheckpointWarning, match="saved by 2 process"):
        restored = mgr.restore({"frozen": jax.ShapeDtypeStruct((256, 256), np.float32),
                                "w": jax.ShapeDtypeStruct((8, 4), np.float32)}).state
    np.testing.assert_array_equal(np.asarray(restored["frozen"]),
                                  np.arange(64 * 1024, dtype=np.float32).reshape(256, 256))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((8, 4), 2, np.float32))


def test_an_object_store_root_refers_instead_of_copying():
    pytest.importorskip("moto")
    from support.s3_server import moto_s3

    run = Run(frozen_tree(1, 2), trained_kib=16)
    config = jaxckpt.RecoverConfig(incremental=True, keep_last_n=2)
    with moto_s3("incremental") as options, jaxckpt.CheckpointManager(
            "s3://incremental/run", recover=config, storage_options=options,
            preemption_signals=()) as mgr:
        for step in range(3):
            run.train()
            before = WRITTEN.total()
            mgr.save(jaxckpt.StepInfo(global_step=step), run.state(step), mode="sync")
            written = WRITTEN.total() - before
        assert written < nbytes(run.frozen) // 4  # no copy on the server either: a reference
        assert mgr.committed_steps() == [1, 2]  # step 0 retired: its frozen file is still used
        assert mgr.store.verify(mgr.store.step_path(2)) == []
        assert_bitwise(mgr.restore(run.state(0)).state, host(run.state(2)))
        partial = mgr.restore({"frozen": run.frozen}, step=1, partial=True)
        assert_bitwise(partial.state, {"frozen": host(run.frozen)})
