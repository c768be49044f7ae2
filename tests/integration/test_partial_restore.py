"""Partial and model-only restore over the Orbax backend: ``restore(like, partial=True)`` and
``recover(like, partial=True)`` read (and checksum) only the arrays of the subtree ``like``,
return exactly its keys, name a path that was never saved, restore into live NNX objects and
onto another sharding. What is read is observed by recording every file Python opens under
the checkpoint (chunk_io's reads and the store's checksums both open files from Python)."""

from __future__ import annotations

import builtins
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxckpt
from jaxckpt.backends.orbax.backend import OrbaxBackend

STEP = jaxckpt.StepInfo(0, 1, 1, None)
BIG = 300_000  # float32 elements: 1.2 MB, above the packing limit (one file per leaf)


def training_state(seed: int = 0) -> dict:
    """Params, optimizer moments and a step counter: the big leaves get files of their own,
    the small ones share packs (the optimizer's small ones with nothing of the model's:
    the model has no small float leaf)."""
    rng = np.random.default_rng(seed)
    return {
        "params": {"w": jnp.asarray(rng.standard_normal(BIG, dtype=np.float32)),
                   "b": jnp.asarray(rng.standard_normal(BIG, dtype=np.float32))},
        "opt_state": {"mu": jnp.asarray(rng.standard_normal(BIG, dtype=np.float32)),
                      "nu": jnp.asarray(rng.standard_normal(BIG, dtype=np.float32)),
                      "scale": jnp.ones((4,), jnp.float32)},
        "step": jnp.int32(7),
    }


def abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def manager(root, **kwargs):
    return jaxckpt.CheckpointManager(str(root), preemption_signals=(), **kwargs)


def save(root, state, **kwargs):
    with manager(root, **kwargs) as mgr:
        mgr.save(STEP, state, mode="sync")
    return os.path.join(str(root), "recover", "step_00000001", "state")


def storage_names(state_dir: str) -> dict[str, str]:
    """tree path -> the directory under arrays/ that holds the leaf (its pack's, if packed)."""
    with open(os.path.join(state_dir, "tree.json")) as stream:
        return {leaf["path"]: leaf["name"] for leaf in json.load(stream)["leaves"]}


@pytest.fixture
def opened(monkeypatch):
    """Every path opened from Python (os.open and open) while the fixture is active."""
    seen: list[str] = []
    real_os_open, real_open = os.open, builtins.open

    def os_open(path, *args, **kwargs):
        seen.append(os.path.realpath(os.fspath(path)))
        return real_os_open(path, *args, **kwargs)

    def py_open(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)):
            seen.append(os.path.realpath(os.fsdecode(file)))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", py_open)
    return seen


def array_dirs_opened(seen: list[str], state_dir: str) -> set[str]:
    """The names of the directories under arrays/ whose data files were opened (not their
    zarr.json: every array's small metadata is checksummed before any restore)."""
    base = os.path.realpath(os.path.join(state_dir, "arrays")) + os.sep
    return {path[len(base):].split(os.sep)[0] for path in seen
            if path.startswith(base) and os.sep in path[len(base):]
            and not path.endswith(".json")}


def flip_byte(path: str) -> None:
    """Change one byte in the middle of a data file (its size stays)."""
    with open(path, "r+b") as stream:
        stream.seek(os.path.getsize(path) // 2)
        byte = stream.read(1)
        stream.seek(-1, os.SEEK_CUR)
        stream.write(bytes([byte[0] ^ 0xFF]))


def chunk_file(state_dir: str, name: str) -> str:
    chunk_dir = os.path.join(state_dir, "arrays", name)
    files = [os.path.join(top, file) for top, _, names in os.walk(chunk_dir) for file in names
             if file != "zarr.json"]
    assert len(files) == 1, files
    return files[0]


# ------------------------------------------------------------------ what is read, verified


@pytest.mark.parametrize("native_io", [True, False], ids=["zarr_io", "orbax"])
def test_partial_restore_reads_and_checksums_only_the_subtree(tmp_path, opened, native_io):
    state = training_state()
    state_dir = save(tmp_path, state)
    names = storage_names(state_dir)
    model_files = {names["['params']['w']"], names["['params']['b']"]}
    optimizer_files = {names[path] for path in names if path.startswith("['opt_state']")}
    assert not model_files & optimizer_files
    opened.clear()
    backend = OrbaxBackend(native_io=native_io)
    with manager(tmp_path, backend=backend) as mgr:
        restored = mgr.restore({"params": abstract(state["params"])}, partial=True)
    backend.close()
    assert list(restored.state) == ["params"]
    assert sorted(restored.state["params"]) == ["b", "w"]
    for key in ("w", "b"):
        np.testing.assert_array_equal(restored.state["params"][key], state["params"][key])
    read = array_dirs_opened(opened, state_dir)
    # chunk_io opens the model's arrays to read them; with Orbax reading (tensorstore opens
    # files outside Python) the model's files are still opened here: to be checksummed.
    assert model_files <= read
    assert not read & optimizer_files, f"optimizer arrays were opened: {read & optimizer_files}"


@pytest.mark.parametrize("native_io", [True, False], ids=["zarr_io", "orbax"])
def test_partial_restore_verifies_what_it_reads_and_only_that(tmp_path, native_io):
    state = training_state()
    state_dir = save(tmp_path, state)
    names = storage_names(state_dir)
    like = {"params": abstract(state["params"])}
    # A damaged optimizer moment is not part of a model-only restore: nothing of it is read.
    flip_byte(chunk_file(state_dir, names["['opt_state']['mu']"]))
    backend = OrbaxBackend(native_io=native_io)
    with manager(tmp_path, backend=backend) as mgr:
        restored = mgr.restore(like, step=1, partial=True)
        np.testing.assert_array_equal(restored.state["params"]["w"], state["params"]["w"])
        # The full restore reads that file too, and refuses it.
        mu = names["['opt_state']['mu']"]
        with pytest.raises(jaxckpt.CheckpointCorruptError, match=f"{mu}.*contents altered"):
            mgr.restore(abstract(state), step=1)
        # A damaged array the partial restore does read fails it, like a full restore.
        flip_byte(chunk_file(state_dir, names["['params']['w']"]))
        w = names["['params']['w']"]
        with pytest.raises(jaxckpt.CheckpointCorruptError, match=f"{w}.*contents altered"):
            mgr.restore(like, step=1, partial=True)
    backend.close()


def test_with_ocdbt_a_partial_restore_checks_every_data_file(tmp_path, opened):
    # OCDBT's data files each hold many arrays: no file can be left out of the checks.
    state = training_state()
    backend = OrbaxBackend(use_ocdbt=True, native_io=False)  # chunk_io writes no OCDBT
    state_dir = save(tmp_path, state, backend=backend)
    data_files = {os.path.realpath(os.path.join(top, name))
                  for top, _, names in os.walk(os.path.join(state_dir, "arrays"))
                  for name in names if os.sep + "d" in top}
    assert data_files
    opened.clear()
    with manager(tmp_path, backend=backend) as mgr:
        restored = mgr.restore({"params": {"w": abstract(state["params"]["w"])}}, partial=True)
    backend.close()
    np.testing.assert_array_equal(restored.state["params"]["w"], state["params"]["w"])
    assert data_files <= set(opened)


def test_a_packed_leaf_is_read_with_its_pack(tmp_path, opened):
    state = {"model": {"bias": jnp.arange(3.0)}, "opt_state": {"count": jnp.ones((2,))},
             "big": jnp.zeros((BIG,))}
    state_dir = save(tmp_path, state)
    names = storage_names(state_dir)
    pack = names["['model']['bias']"]
    assert pack == names["['opt_state']['count']"], "expected the small leaves in one pack"
    opened.clear()
    with manager(tmp_path) as mgr:
        restored = mgr.restore({"model": {"bias": np.zeros(3, np.float32)}}, partial=True)
    np.testing.assert_array_equal(restored.state["model"]["bias"], [0.0, 1.0, 2.0])
    # The whole pack is read (and checksummed): the optimizer's small leaf comes along.
    assert array_dirs_opened(opened, state_dir) == {pack}


# ------------------------------------------------------------------ the shape of the result


def test_a_path_never_saved_raises_tree_mismatch_naming_it(tmp_path):
    state = training_state()
    save(tmp_path, state)
    like = {"params": {"w": abstract(state["params"]["w"]),
                       "head": jax.ShapeDtypeStruct((3,), jnp.float32)},
            "opt_state": {"mu": jax.ShapeDtypeStruct((5,), jnp.float32)}}
    with manager(tmp_path) as mgr, pytest.raises(jaxckpt.TreeMismatchError) as raised:
        mgr.restore(like, partial=True)
    message = str(raised.value)
    assert "['params']['head']: missing from checkpoint" in message
    assert "['opt_state']['mu']: expected shape (5,) float32" in message
    assert "not in like" not in message  # what like leaves out is no mismatch
    assert "2 tree path(s)" in message


def test_a_subtree_without_partial_is_refused_with_the_fix(tmp_path):
    state = training_state()
    save(tmp_path, state)
    with manager(tmp_path) as mgr, pytest.raises(jaxckpt.TreeMismatchError,
                                                 match=r"pass partial=True"):
        mgr.restore({"params": abstract(state["params"])})


def test_recover_partial_resumes_the_step_and_restores_stateful_but_not_global_rngs(tmp_path):
    from support.loaders import Loader

    state = training_state()
    loader = Loader(position=5)
    with manager(tmp_path, recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1))) as mgr:
        mgr.save(STEP, state, stateful={"loader": loader}, mode="sync")
    np.random.seed(1234)
    expected_draw = np.random.random()
    np.random.seed(1234)
    fresh = Loader()
    with manager(tmp_path, recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1))) as mgr:
        recovered = mgr.recover({"step": 0}, stateful={"loader": fresh}, partial=True)
        assert recovered.state == {"step": 7}
        assert recovered.step_info == STEP
        assert fresh.state_dict() == loader.state_dict()
        # The process-global NumPy RNG is the job's own, not the checkpoint's.
        assert np.random.random() == expected_draw
        # A resume point all the same: a final save records the step resumed from.
        assert mgr.save(state={"step": jnp.int32(8)}, mode="sync").path.endswith("00000001")


# ------------------------------------------------------------ live NNX and another sharding


def test_model_only_restore_into_a_live_nnx_model_without_optimizer(tmp_path, opened):
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    from support.models import TinyNet

    model = TinyNet(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.mean(m(jnp.ones((2, 3))) ** 2))(model)
    optimizer.update(model, grads)
    state_dir = save(tmp_path, {"model": model, "optimizer": optimizer})
    names = storage_names(state_dir)
    optimizer_only = ({names[path] for path in names if path.startswith("['optimizer']")}
                      - {names[path] for path in names if path.startswith("['model']")})

    fresh = TinyNet(nnx.Rngs(5, dropout=6))  # for evaluation: no optimizer at all
    assert not np.array_equal(fresh.linear.kernel[...], model.linear.kernel[...])
    opened.clear()
    with manager(tmp_path) as mgr:
        restored = mgr.restore({"model": fresh}, partial=True)
    assert restored.state["model"] is fresh and list(restored.state) == ["model"]
    for mine, theirs in zip(jax.tree.leaves(nnx.state(fresh, nnx.Param)),
                            jax.tree.leaves(nnx.state(model, nnx.Param)), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    np.testing.assert_array_equal(fresh.norm.mean[...], model.norm.mean[...])
    assert not array_dirs_opened(opened, state_dir) & optimizer_only


def on(mesh: Mesh, spec: tuple) -> NamedSharding:
    return NamedSharding(mesh, P(*spec))


def test_model_only_restore_onto_another_sharding(tmp_path):
    devices = np.array(jax.devices())
    if devices.size < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
    train_mesh = Mesh(devices.reshape(8), ("data",))
    eval_mesh = Mesh(devices.reshape(2, 4), ("x", "y"))
    params = {"w": jax.device_put(jnp.arange(64.0 * 32).reshape(64, 32),
                                  on(train_mesh, ("data", None))),
              "b": jax.device_put(jnp.arange(32.0), on(train_mesh, ("data",)))}
    state = {"params": params,
             "opt_state": {"mu": jax.device_put(jnp.ones((64, 32)), on(train_mesh, ("data",)))}}
    save(tmp_path, state)
    like = {"params": {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32,
                                                 sharding=on(eval_mesh, ("y", "x"))),
                       "b": jax.ShapeDtypeStruct((32,), jnp.float32,
                                                 sharding=on(eval_mesh, (None,)))}}
    with manager(tmp_path) as mgr:
        restored = mgr.restore(like, partial=True).state
    assert list(restored) == ["params"]
    for key in ("w", "b"):
        assert restored["params"][key].sharding == like["params"][key].sharding
        np.testing.assert_array_equal(restored["params"][key], params[key])
