"""Incremental checkpoints (issue 32) where they meet the rest of the library: a bit flip in a
shared file (``jaxckpt verify ROOT`` run as a user runs it names every checkpoint that uses
the file; recovery falls back past all of them, or fails closed), an s3:// and a gs:// root
(the test servers of tests/support: unchanged data is not uploaded again, restores are
bit-exact, retention retires and purges through object deletes), and a local tier (each
tier's checkpoints refer within their own root).

The state is small: a 1.25 MiB frozen table that changes only when a test says so, and 16 KiB
of trained weights that change every save."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt.backends.orbax.files import WRITTEN
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.core.layout import COMMIT_MARKER, RETIRED_MARKER, parse_ref_key, step_dirname
from jaxckpt.errors import CheckpointCorruptError
from jaxckpt.tools import cli

from support.harness import repo_env
from support.object_stores import KINDS, object_store
from support.paths import REPO

FROZEN_SHAPE = (640, 512)  # 1.25 MiB: over the Orbax backend's packing limit, a file alone
FROZEN_BYTES = 640 * 512 * 4
LEASE = {"lease_s": 3.0, "heartbeat_s": 0.5}


def state(step: int, frozen_version: int = 0) -> dict:
    table = np.random.default_rng(frozen_version).standard_normal(FROZEN_SHAPE, np.float32)
    return {"frozen": {"table": jnp.asarray(table)},
            "params": {"w": jnp.full((64, 64), float(step), jnp.float32)},
            "step": step}


def assert_bitwise(actual, expected) -> None:
    got, want = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def save(mgr, step: int, tree: dict) -> int:
    """Save ``tree`` as ``step`` (sync); the bytes the native writer wrote for it."""
    before = WRITTEN.total()
    mgr.save(jaxckpt.StepInfo(global_step=step), tree, mode="sync")
    return WRITTEN.total() - before


def frozen_owner(store: CheckpointStore, step: int) -> int:
    """The step whose directory holds the frozen table checkpoint ``step`` uses."""
    manifest = store.read_manifest(store.step_path(step))
    owners = {parse_ref_key(key)[0] for key in manifest.refs}
    assert len(owners) <= 1, owners
    return owners.pop() if owners else step


# ------------------------------------------------------------------------ a bit flip


def by_checkpoint(out: str) -> dict[str, tuple[str, list[str]]]:
    """``jaxckpt verify ROOT``'s output: step directory name -> (verdict, problem lines)."""
    found: dict[str, tuple[str, list[str]]] = {}
    current: list[str] = []
    for line in out.splitlines():
        if line.startswith(("OK", "CORRUPT", "PARTIAL")):
            current = []
            found[os.path.basename(line.split()[-1])] = (line.split()[0], current)
        elif line.startswith("  "):
            current.append(line.strip())
    return found


def test_a_flipped_bit_in_a_shared_file_is_named_under_every_user(tmp_path, capsys):
    root = str(tmp_path / "root")
    config = jaxckpt.RecoverConfig(incremental=True, keep_last_n=None)
    with jaxckpt.CheckpointManager(root, recover=config) as mgr:
        save(mgr, 0, state(0, frozen_version=0))
        for step in (1, 2, 3):  # step 1 holds the new table, 2 and 3 refer to it
            save(mgr, step, state(step, frozen_version=1))
    store = CheckpointStore(root)
    assert [frozen_owner(store, s) for s in (0, 1, 2, 3)] == [0, 1, 1, 1]
    shared = [key for key in store.read_manifest(store.step_path(3)).refs
              if store.read_manifest(store.step_path(3)).refs[key]["size"] >= FROZEN_BYTES]
    assert len(shared) == 1
    path = os.path.join(store.recover_dir, shared[0])
    with open(path, "r+b") as handle:
        handle.seek(FROZEN_BYTES // 2)
        byte = handle.read(1)
        handle.seek(FROZEN_BYTES // 2)
        handle.write(bytes([byte[0] ^ 0x10]))

    # `jaxckpt verify ROOT`, the console command a user runs.
    command = os.path.join(os.path.dirname(sys.executable), "jaxckpt")
    done = subprocess.run([command, "verify", root], capture_output=True, text=True, timeout=120,
                          env=repo_env(), cwd=REPO)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    verdicts = by_checkpoint(out)
    assert verdicts[step_dirname(0)] == ("OK", [])
    rel = shared[0].split("/", 1)[1]
    for step in (1, 2, 3):
        status, problems = verdicts[step_dirname(step)]
        assert status == "CORRUPT" and len(problems) == 1, (step, out)
        assert rel in problems[0] and "contents altered" in problems[0], (step, out)
        assert step == 1 or "referenced from step 1" in problems[0], (step, out)
    # One checkpoint given: its refs resolve among its siblings, as in a root.
    assert cli.main(["verify", os.path.join(store.recover_dir, step_dirname(2))]) == 1
    one = by_checkpoint(capsys.readouterr().out)
    assert one == {step_dirname(2): verdicts[step_dirname(2)]}

    # A copy without step 0: none is left that verifies, so recovery fails closed.
    other = str(tmp_path / "other")
    shutil.copytree(root, other)
    shutil.rmtree(os.path.join(other, "recover", step_dirname(0)))
    with jaxckpt.CheckpointManager(other, recover=config) as mgr, \
            pytest.raises(CheckpointCorruptError):
        mgr.recover(state(0))
    # Recovery falls back past steps 3, 2 and 1 to step 0, bit-exact.
    with jaxckpt.CheckpointManager(root, recover=config) as mgr, \
            pytest.warns(jaxckpt.CheckpointWarning, match="skipping newer unusable"):
        recovered = mgr.recover(state(0))
        assert recovered is not None and recovered.step_info.global_step == 0
        assert_bitwise(recovered.state, state(0, frozen_version=0))


# --------------------------------------------------------------------- object storage


@pytest.fixture(scope="module", params=KINDS)
def objects(request):
    with object_store(request.param, "jaxckpt-incremental") as running:
        yield running


@pytest.mark.skipif(not KINDS, reason="no object-store client and server installed")
def test_incremental_saves_on_object_storage(objects):
    root = objects.url(f"runs/{uuid.uuid4().hex}")
    config = jaxckpt.RecoverConfig(incremental=True, keep_last_n=2)
    saved, written = {}, {}
    with jaxckpt.CheckpointManager(root, recover=config, preemption_signals=(),
                                   storage_options={**objects.storage_options,
                                                    **LEASE}) as mgr:
        store, storage = mgr.store, mgr.store.storage
        for step in range(6):  # the table changes at step 4: step 0 is purged after 5
            saved[step] = state(step, frozen_version=0 if step < 4 else 1)
            written[step] = save(mgr, step, saved[step])
            if step == 2:
                # Step 0 retired: its commit marker and its own trained weights deleted,
                # the table steps 1 and 2 refer to kept.
                names = storage.list_files(store.step_path(0))
                assert RETIRED_MARKER in names and COMMIT_MARKER not in names
                assert sum(names.values()) < FROZEN_BYTES + 8192, names
            if step == 4:
                assert storage.is_prefix(store.step_path(0))  # step 3 still refers to it
        assert store.committed_steps() == [4, 5]
        for step in (4, 5):
            assert store.verify(store.step_path(step)) == []
            assert_bitwise(mgr.restore(state(0), step=step).state, saved[step])
        # No referrer left: step 0 purged, object by object.
        assert not storage.is_prefix(store.step_path(0))
        assert storage.list_files(store.recover_dir + "/" + step_dirname(0)) == {}
        # What a save sent: the table only when it changed (the trained weights are 16 KiB).
        assert all(written[s] > FROZEN_BYTES for s in (0, 4)), written
        assert all(written[s] < FROZEN_BYTES // 8 for s in (1, 2, 3, 5)), written
        assert frozen_owner(store, 5) == 4
        in_five = storage.list_files(store.step_path(5))
        assert sum(in_five.values()) < FROZEN_BYTES // 8, in_five


# ------------------------------------------------------------------------ local tier


def test_incremental_saves_with_a_local_tier(tmp_path):
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    config = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=3), incremental=True,
                                   keep_last_n=2)
    tier = jaxckpt.LocalTier(local, every=jaxckpt.Every(steps=1), keep_last_n=2)
    saved = {}
    with jaxckpt.CheckpointManager(root, recover=config, local=tier,
                                   preemption_signals=()) as mgr:
        for step in range(9):
            saved[step] = state(step)
            mgr.maybe_save(jaxckpt.StepInfo(global_step=step), saved[step])
        mgr.wait()
    durable, fast = CheckpointStore(root), CheckpointStore(local)
    assert durable.committed_steps() == [5, 8]
    assert fast.committed_steps() == [6, 7]
    for store in (durable, fast):
        for step in store.committed_steps():
            assert store.verify(store.step_path(step)) == []
            manifest = store.read_manifest(store.step_path(step))
            # Each tier refers within its own root only (keys are relative to its recover/).
            assert manifest.refs and all(
                os.path.exists(os.path.join(store.recover_dir, key)) for key in manifest.refs)
    with jaxckpt.CheckpointManager(root, recover=config, local=tier,
                                   preemption_signals=()) as mgr:
        recovered = mgr.recover(state(0))
        assert recovered.step_info.global_step == 8 and recovered.tier == "durable"
        assert_bitwise(recovered.state, saved[8])
        assert_bitwise(mgr.restore(state(0), step=5).state, saved[5])
    # The durable root gone: the local tier's newest restores through its own refs.
    shutil.rmtree(os.path.join(root, "recover", step_dirname(8)))
    shutil.rmtree(os.path.join(root, "recover", step_dirname(5)))
    with jaxckpt.CheckpointManager(root, recover=config, local=tier,
                                   preemption_signals=()) as mgr:
        recovered = mgr.recover(state(0))
        assert recovered.step_info.global_step == 7 and recovered.tier == "local"
        assert_bitwise(recovered.state, saved[7])
