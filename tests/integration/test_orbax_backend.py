"""OrbaxBackend against real Orbax: save -> restore -> compare, shardings, keys, errors."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import resource
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxckpt.backends.base import Backend, WriteHandle
from jaxckpt.backends.orbax.backend import OrbaxBackend
from jaxckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    TreeMismatchError,
)

from support.harness import repo_env
from support.two_processes import jax_worker, run_two_workers


@pytest.fixture(scope="module")
def backend():
    orbax_backend = OrbaxBackend()
    yield orbax_backend
    orbax_backend.close()


@pytest.fixture(scope="module")
def mesh_4x2():
    return jax.make_mesh((4, 2), ("a", "b"))


def abstract(tree):
    """like leaves without values or shardings (restore onto the default device)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def assert_bitwise_equal(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.tobytes() == expected.tobytes()


def sample(dtype, shape=(4, 3), seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def test_is_a_backend(backend):
    assert isinstance(backend, Backend)
    assert backend.name == "orbax" and backend.supports_async is True
    assert (backend.process_index, backend.process_count) == (0, 1)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32", "int8",
                                   "uint32", "bool"])
def test_roundtrip_is_bitwise_for_every_dtype(backend, tmp_path, dtype, asynchronous):
    host = sample(jnp.dtype(dtype))
    state = {"device": jnp.asarray(host), "host": host.copy(), "scalar": jnp.asarray(host[0, 0])}
    handle = backend.write(str(tmp_path / "ckpt"), state, asynchronous=asynchronous)
    assert isinstance(handle, WriteHandle)
    handle.wait()

    restored = backend.read(str(tmp_path / "ckpt"), abstract(state) | {"host": np.zeros_like(host)})

    assert isinstance(restored["device"], jax.Array)
    assert isinstance(restored["host"], np.ndarray)
    for name in state:
        assert_bitwise_equal(restored[name], state[name])


def test_sync_write_is_complete_on_return(backend, tmp_path):
    handle = backend.write(str(tmp_path / "ckpt"), {"w": jnp.ones(3)}, asynchronous=False)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["arrays", "tree.json"]
    assert handle.done()
    handle.wait()


def test_async_write_is_unaffected_by_mutating_numpy_after_return(backend, tmp_path):
    host = np.arange(1 << 16, dtype=np.float32)
    handle = backend.write(str(tmp_path / "ckpt"), {"h": host}, asynchronous=True)
    host[:] = -1.0  # the training loop reuses its buffer right after staging
    handle.wait()
    restored = backend.read(str(tmp_path / "ckpt"), {"h": np.zeros_like(host)})
    np.testing.assert_array_equal(restored["h"], np.arange(1 << 16, dtype=np.float32))


def test_sharded_array_restores_onto_another_mesh_and_one_device(backend, tmp_path, mesh_4x2):
    values = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    sharded = jax.device_put(values, NamedSharding(mesh_4x2, P("a", "b")))
    backend.write(str(tmp_path / "ckpt"), {"w": sharded}, asynchronous=True).wait()

    other_mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[::-1])
    targets = {
        "other_mesh": NamedSharding(other_mesh, P(None, "a")),
        "one_device": SingleDeviceSharding(jax.devices()[5]),
    }
    for label, sharding in targets.items():
        like = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=sharding)}
        restored = backend.read(str(tmp_path / "ckpt"), like)["w"]
        assert restored.sharding == sharding, label
        assert_bitwise_equal(restored, values)

    # A like leaf without sharding lands on the default device.
    restored = backend.read(str(tmp_path / "ckpt"), abstract({"w": sharded}))["w"]
    assert restored.sharding == SingleDeviceSharding(jax.devices()[0])
    assert_bitwise_equal(restored, values)

    # A concrete like leaf is a template too: its sharding is where the value goes.
    like = {"w": jax.device_put(np.zeros_like(values), targets["other_mesh"])}
    restored = backend.read(str(tmp_path / "ckpt"), like)["w"]
    assert restored.sharding == targets["other_mesh"]
    assert_bitwise_equal(restored, values)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_keys_keep_their_impl_and_bits(backend, tmp_path, mesh_4x2, impl):
    keys = jax.random.split(jax.random.key(7, impl=impl), 8)
    state = {"one": jax.random.key(3, impl=impl),
             "many": jax.device_put(keys, NamedSharding(mesh_4x2, P("a")))}
    backend.write(str(tmp_path / "ckpt"), state, asynchronous=True).wait()

    saved = json.loads((tmp_path / "ckpt" / "tree.json").read_text())
    assert {leaf["impl"] for leaf in saved["leaves"]} == {impl}

    other = NamedSharding(jax.make_mesh((2, 4), ("x", "y")), P("y"))
    like = {"one": jax.ShapeDtypeStruct((), state["one"].dtype),
            "many": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=other)}
    restored = backend.read(str(tmp_path / "ckpt"), like)
    for name in state:
        assert jax.dtypes.issubdtype(restored[name].dtype, jax.dtypes.prng_key)
        assert str(jax.random.key_impl(restored[name])) == impl
        assert_bitwise_equal(jax.random.key_data(restored[name]),
                             jax.random.key_data(state[name]))
    assert restored["many"].sharding == other


def test_flax_nnx_model_and_optimizer_roundtrip(backend, tmp_path):
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    from support.models import TinyNet

    def build(seed):
        model = TinyNet(nnx.Rngs(seed, dropout=seed + 1))
        return model, nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)

    model, optimizer = build(0)
    inputs = jnp.arange(6.0).reshape(2, 3)
    grads = nnx.grad(lambda m: jnp.sum(m(inputs) ** 2))(model)
    optimizer.update(model, grads)  # optimizer moments and step become non-trivial
    backend.write(str(tmp_path / "ckpt"), nnx.state((model, optimizer)), asynchronous=True).wait()

    fresh_model, fresh_optimizer = nnx.eval_shape(lambda: build(42))
    like = nnx.state((fresh_model, fresh_optimizer))
    restored = backend.read(str(tmp_path / "ckpt"), like)
    nnx.update((fresh_model, fresh_optimizer), restored)

    np.testing.assert_array_equal(fresh_model(inputs), model(inputs))
    for got, want in zip(jax.tree.leaves(nnx.state((fresh_model, fresh_optimizer))),
                         jax.tree.leaves(nnx.state((model, optimizer))), strict=True):
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        assert_bitwise_equal(got, want)


def test_optax_state_of_plain_dict_roundtrip(backend, tmp_path):
    optax = pytest.importorskip("optax")
    params = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}, "scale": jnp.ones(())}
    transform = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    opt_state = transform.init(params)
    updates, opt_state = transform.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    state = {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": 1}
    backend.write(str(tmp_path / "ckpt"), state, asynchronous=False)

    like = {"params": abstract(params), "opt_state": abstract(transform.init(params)), "step": 0}
    restored = backend.read(str(tmp_path / "ckpt"), like)

    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert restored["step"] == 1 and type(restored["step"]) is int
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert_bitwise_equal(got, want)


def test_numpy_and_python_scalar_leaves_keep_their_types(backend, tmp_path):
    state = {"table": np.arange(6, dtype=np.int16).reshape(2, 3), "np_scalar": np.float32(1.5),
             "steps": 12, "lr": 0.25, "done": True, "tokens": jnp.asarray(7, jnp.int32)}
    backend.write(str(tmp_path / "ckpt"), state, asynchronous=True).wait()

    like = {"table": np.zeros((2, 3), np.int16), "np_scalar": np.float32(0), "steps": 0,
            "lr": 0.0, "done": False, "tokens": 0}  # a 0-d int32 array, a Python int like
    restored = backend.read(str(tmp_path / "ckpt"), like)

    assert type(restored["table"]) is np.ndarray
    np.testing.assert_array_equal(restored["table"], state["table"])
    assert type(restored["np_scalar"]) is np.float32 and restored["np_scalar"] == 1.5
    assert (restored["steps"], restored["lr"], restored["done"], restored["tokens"]) == (
        12, 0.25, True, 7)
    assert [type(restored[k]) for k in ("steps", "lr", "done")] == [int, float, bool]
    # What was saved comes back, not the like's Python type: the int32 array stays one.
    assert isinstance(restored["tokens"], jax.Array)
    assert (restored["tokens"].dtype, restored["tokens"].shape) == (jnp.int32, ())


def test_leaves_of_equal_shape_match_by_path_not_position(backend, tmp_path):
    first, second = jnp.zeros((2, 2)), jnp.ones((2, 2))
    saved = collections.OrderedDict([("first", first), ("second", second)])
    backend.write(str(tmp_path / "ckpt"), saved, asynchronous=True).wait()

    like = collections.OrderedDict([("second", jnp.full((2, 2), 5.0)),
                                    ("first", jnp.full((2, 2), 5.0))])
    # Flattening order differs, so a loader going by position would cross the two leaves.
    assert [float(x[0, 0]) for x in jax.tree.leaves(saved)] == [0.0, 1.0]
    restored = backend.read(str(tmp_path / "ckpt"), like)

    assert list(restored) == ["second", "first"]
    assert_bitwise_equal(restored["first"], first)
    assert_bitwise_equal(restored["second"], second)


def test_mismatch_lists_every_problem_at_once(backend, tmp_path):
    state = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3), "old": jnp.zeros(2), "ok": jnp.zeros(1),
             "rng": jax.random.key(0)}
    backend.write(str(tmp_path / "ckpt"), state, asynchronous=False)

    like = {"w": jax.ShapeDtypeStruct((3, 4), jnp.float32),      # wrong shape
            "b": jax.ShapeDtypeStruct((3,), jnp.bfloat16),       # wrong dtype
            "new": jax.ShapeDtypeStruct((5,), jnp.float32),      # missing from checkpoint
            "ok": jax.ShapeDtypeStruct((1,), jnp.float32),       # fine
            "rng": jax.random.key(0, impl="rbg")}                # other key impl
    # "old" is in the checkpoint but not in like.
    with pytest.raises(TreeMismatchError) as caught:
        backend.read(str(tmp_path / "ckpt"), like)

    message = str(caught.value)
    assert "['w']: expected shape (3, 4) float32, checkpoint has shape (4, 3) float32" in message
    assert "['b']: expected shape (3,) bfloat16, checkpoint has shape (3,) float32" in message
    assert "['new']: missing from checkpoint" in message
    assert "['old']: not in like" in message
    assert "['rng']: expected shape () key<rbg>" in message and "impl threefry2x32" in message
    assert "['ok']" not in message
    assert "Fix:" in message
    assert len(caught.value.problems) == 5


def test_non_array_leaf_raises_type_error_naming_the_path(backend, tmp_path):
    state = {"params": {"w": jnp.ones(2)}, "config": {"name": "run-1"}}
    with pytest.raises(TypeError, match=r"\['config'\]\['name'\].*Fix:"):
        backend.write(str(tmp_path / "ckpt"), state, asynchronous=True)
    assert not (tmp_path / "ckpt").exists()  # validated before any I/O


def test_missing_directory_raises_not_found_naming_it(backend, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nowhere"):
        backend.read(str(tmp_path / "nowhere"), {"w": jnp.ones(2)})


def test_refuses_to_write_into_a_non_empty_directory(backend, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "stale").write_text("x")
    with pytest.raises(CheckpointWriteError, match="already exists"):
        backend.write(str(tmp_path / "ckpt"), {"w": jnp.ones(2)}, asynchronous=False)


class _FileSizeLimit:
    """Make writes beyond ``limit`` bytes fail with EFBIG (works as root, unlike chmod)."""

    def __init__(self, limit):
        self._limit = limit

    def __enter__(self):
        self._saved_limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        # Without this the kernel kills the process (SIGXFSZ) instead of failing the write.
        self._saved_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self._limit, self._saved_limits[1]))

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_FSIZE, self._saved_limits)
        signal.signal(signal.SIGXFSZ, self._saved_handler)


def test_background_write_failure_surfaces_from_wait_and_is_not_lost(backend, tmp_path):
    big = {"w": np.ones(1 << 20, np.float32)}  # 4 MiB, over the 2 MiB limit
    small = {"w": np.ones(4, np.float32)}
    with _FileSizeLimit(2 << 20):
        failing = backend.write(str(tmp_path / "big"), big, asynchronous=True)  # staged fine
        # A second write starts before anyone waited on the first: the first's error must
        # stay with the first handle, not surface here or vanish.
        succeeding = backend.write(str(tmp_path / "small"), small, asynchronous=True)
        succeeding.wait()
    with pytest.raises(Exception, match="File too large"):
        failing.wait()
    with pytest.raises(Exception, match="File too large"):
        failing.wait()  # waiting again re-raises, never reports success
    assert not (tmp_path / "big" / "arrays").exists()
    np.testing.assert_array_equal(
        backend.read(str(tmp_path / "small"), {"w": np.zeros(4, np.float32)})["w"], small["w"])


def test_sync_write_failure_raises_from_write(backend, tmp_path):
    with _FileSizeLimit(2 << 20), pytest.raises(Exception, match="File too large"):
        backend.write(str(tmp_path / "big"), {"w": np.ones(1 << 20, np.float32)},
                      asynchronous=False)


def test_host_copy_is_numpy_and_survives_changes(backend):
    key = jax.random.key(1, impl="rbg")
    host = np.arange(3.0)
    state = {"w": jnp.arange(4.0), "h": host, "rng": key, "step": 3}
    copied = backend.host_copy(state)
    host[:] = 0.0

    assert type(copied["w"]) is np.ndarray and copied["step"] == 3
    np.testing.assert_array_equal(copied["w"], np.arange(4.0))
    np.testing.assert_array_equal(copied["h"], np.arange(3.0))
    assert str(jax.random.key_impl(copied["rng"])) == "rbg"
    assert_bitwise_equal(jax.random.key_data(copied["rng"]), jax.random.key_data(key))


def test_process_facts_and_rng_of_a_single_process(backend):
    versions = backend.versions()
    assert versions["jax"] == jax.__version__
    assert {"jaxlib", "orbax-checkpoint", "flax"} <= set(versions)
    assert backend.rng_state() is None
    backend.set_rng_state(None)
    backend.barrier("test", timeout_s=1.0)  # one process: nothing to wait for, no error
    assert backend.broadcast_int(41) == 41


_WORKER = jax_worker('''
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxckpt.backends.orbax.backend import OrbaxBackend

    backend = OrbaxBackend()
    assert (backend.process_index, backend.process_count) == (index, 2)
    assert backend.broadcast_int(100 + index) == 100
    assert backend.broadcast_int(200 + index) == 200
    # The manager waits at barriers from its background commit thread.
    waiter = threading.Thread(target=backend.barrier, args=("from-a-thread", 30.0))
    waiter.start()
    waiter.join(60)
    assert not waiter.is_alive()

    values = np.arange(32, dtype=np.float32).reshape(8, 4)
    mesh = jax.make_mesh((4,), ("a",))
    sharded = jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("a")),
                                           lambda index: values[index])
    backend.write(root, {"w": sharded, "step": 5}, asynchronous=True).wait()
    backend.barrier("written", 30.0)
    like = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype,
                                      sharding=NamedSharding(mesh, P(None, "a"))), "step": 0}
    restored = backend.read(root, like)
    assert restored["step"] == 5
    for shard in restored["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), values[shard.index])
    backend.close()
''', init_timeout=30)


def test_two_processes_write_one_checkpoint_and_share_barriers(tmp_path):
    directory, _ = run_two_workers(_WORKER, tmp_path, dirname="ckpt", timeout=120)

    # A single process with a different device count reads what the two wrote.
    values = np.arange(32, dtype=np.float32).reshape(8, 4)
    sharding = NamedSharding(jax.make_mesh((2, 4), ("x", "y")), P("y", "x"))
    restored = OrbaxBackend().read(directory, {
        "w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=sharding), "step": 0})
    assert restored["w"].sharding == sharding
    assert_bitwise_equal(restored["w"], values)
    assert restored["step"] == 5


# ------------------------------------------------------------------------ packed small leaves


def tree_json(directory):
    return json.loads((directory / "tree.json").read_text())


def mixed_small_state(step=0):
    """Every kind of small leaf the packer must carry, plus one leaf too large to pack.
    Every ``step`` gives the same layout with other values."""
    seed = 100 * step
    return {
        "params": {f"bias_{i}": jnp.asarray(sample(np.float32, (7,), seed=seed + i))
                   for i in range(5)},
        "half": jnp.asarray(sample(jnp.bfloat16, (3, 5), seed=seed + 9)),
        "counts": jnp.asarray(sample(np.int32, (4,), seed=seed + 10)),
        "mask": sample(np.bool_, (6,), seed=seed + 11),
        "host": sample(np.float32, (2, 2), seed=seed + 12),
        "empty": np.zeros((0, 3), np.float32),
        "np_scalar": np.float32(2.5 + step),
        "rng": jax.random.key(5 + step, impl="rbg"),
        "keys": jax.random.split(jax.random.key(6 + step), 3),
        "step": 41 + step, "lr": 0.125 * (step + 1), "done": step % 2 == 1,
        "big": jnp.asarray(sample(np.float32, (1 << 19,), seed=seed + 13)),  # 2 MiB: not packed
    }


def like_of(state):
    """A like tree: abstract jax leaves, zeroed numpy leaves, same Python/numpy scalar types."""
    def one(leaf):
        if isinstance(leaf, jax.Array):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        if isinstance(leaf, np.ndarray):
            return np.zeros_like(leaf)
        return type(leaf)(0)
    return jax.tree.map(one, state)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_small_leaves_are_packed_by_dtype_and_restore_bitwise(backend, tmp_path, asynchronous):
    state = mixed_small_state()
    backend.write(str(tmp_path / "ckpt"), state, asynchronous=asynchronous).wait()

    document = tree_json(tmp_path / "ckpt")
    assert document["version"] == 2
    entries = {entry["path"]: entry for entry in document["leaves"]}
    assert entries["['big']"]["name"].startswith("leaf_") and "offset" not in entries["['big']"]
    packed = [entry for path, entry in entries.items() if path != "['big']"]
    assert all(entry["name"].startswith("pack_") and "offset" in entry for entry in packed)
    # One pack per stored dtype: float32, bfloat16, int32, bool, uint32 (key data), int64
    # (the Python int), float64 (the Python float) and bool again for the Python bool.
    assert {pack["dtype"] for pack in document["packs"]} == {
        "float32", "bfloat16", "int32", "bool", "uint32", "int64", "float64"}
    assert len(document["packs"]) == 7
    stored = sorted(p.name for p in (tmp_path / "ckpt" / "arrays").iterdir()
                    if p.name.startswith(("leaf_", "pack_")))
    assert stored == sorted([entries["['big']"]["name"]] + [p["name"] for p in document["packs"]])

    restored = backend.read(str(tmp_path / "ckpt"), like_of(state))

    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for name in ("step", "lr", "done"):
        assert restored[name] == state[name] and type(restored[name]) is type(state[name])
    assert type(restored["np_scalar"]) is np.float32 and restored["np_scalar"] == 2.5
    for name in ("mask", "host", "empty"):
        assert type(restored[name]) is np.ndarray
        assert_bitwise_equal(restored[name], state[name])
    for name in ("rng", "keys"):
        assert str(jax.random.key_impl(restored[name])) == str(jax.random.key_impl(state[name]))
        assert_bitwise_equal(jax.random.key_data(restored[name]),
                             jax.random.key_data(state[name]))
    for name in ("half", "counts", "big"):
        assert isinstance(restored[name], jax.Array)
        assert_bitwise_equal(restored[name], state[name])
    for name, value in state["params"].items():
        assert_bitwise_equal(restored["params"][name], value)


def test_packed_leaves_restore_onto_the_like_shardings(backend, tmp_path, mesh_4x2):
    values = sample(np.float32, (8, 4), seed=3)
    keys = jax.random.split(jax.random.key(2), 8)
    backend.write(str(tmp_path / "ckpt"), {"w": jnp.asarray(values), "keys": keys, "n": 1},
                  asynchronous=True).wait()
    assert all("offset" in e for e in tree_json(tmp_path / "ckpt")["leaves"])

    sharded = NamedSharding(mesh_4x2, P("a", "b"))
    one_device = SingleDeviceSharding(jax.devices()[5])
    key_sharding = NamedSharding(mesh_4x2, P("a"))
    like = {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=sharded),
            "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=key_sharding),
            "n": 0}
    restored = backend.read(str(tmp_path / "ckpt"), like)
    assert restored["w"].sharding == sharded
    assert_bitwise_equal(restored["w"], values)
    assert restored["keys"].sharding == key_sharding
    assert_bitwise_equal(jax.random.key_data(restored["keys"]), jax.random.key_data(keys))

    like["w"] = jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=one_device)
    restored = backend.read(str(tmp_path / "ckpt"), like)
    assert restored["w"].sharding == one_device
    assert_bitwise_equal(restored["w"], values)


def test_mismatch_in_a_packed_tree_names_the_original_paths(backend, tmp_path):
    state = {"layer": {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}, "count": 3,
             "old": np.zeros(2, np.int32)}
    backend.write(str(tmp_path / "ckpt"), state, asynchronous=False)
    assert all("offset" in e for e in tree_json(tmp_path / "ckpt")["leaves"])

    like = {"layer": {"w": jax.ShapeDtypeStruct((3, 4), jnp.float32),
                      "b": jax.ShapeDtypeStruct((3,), jnp.bfloat16)},
            "count": 0.0, "new": jax.ShapeDtypeStruct((5,), jnp.float32)}
    with pytest.raises(TreeMismatchError) as caught:
        backend.read(str(tmp_path / "ckpt"), like)

    message = str(caught.value)
    assert "['layer']['w']: expected shape (3, 4) float32, checkpoint has shape (4, 3)" in message
    assert "['layer']['b']: expected shape (3,) bfloat16, checkpoint has shape (3,) float32" \
        in message
    assert "['count']: expected python float, checkpoint has python int" in message
    assert "['new']: missing from checkpoint" in message
    assert "['old']: not in like" in message
    assert "pack_" not in message  # storage names are ours, paths are the user's
    assert len(caught.value.problems) == 5


def test_packs_split_at_pack_bytes_and_many_leaves_make_few_arrays(tmp_path):
    backend = OrbaxBackend(pack_leaf_bytes=4096, pack_bytes=64 * 1024)
    try:
        state = {f"p{i:04d}": np.full((256,), i, np.float32) for i in range(2000)}  # 1 KiB each
        backend.write(str(tmp_path / "ckpt"), state, asynchronous=True).wait()

        document = tree_json(tmp_path / "ckpt")
        sizes = [pack["size"] * 4 for pack in document["packs"]]
        assert len(sizes) == 32 and max(sizes) <= 64 * 1024  # 2000 KiB in 64 KiB packs
        arrays = [p for p in (tmp_path / "ckpt" / "arrays").iterdir()
                  if p.name.startswith(("leaf_", "pack_"))]
        assert len(arrays) == 32
        restored = backend.read(str(tmp_path / "ckpt"), like_of(state))
        for name, value in state.items():
            assert_bitwise_equal(restored[name], value)
    finally:
        backend.close()


def test_pack_leaf_bytes_zero_writes_every_leaf_alone_and_either_layout_reads(tmp_path):
    state = {"w": jnp.arange(6.0), "n": 7, "k": jax.random.key(1)}
    unpacked = OrbaxBackend(pack_leaf_bytes=0)
    packing = OrbaxBackend()
    try:
        unpacked.write(str(tmp_path / "v1"), state, asynchronous=False)
        document = tree_json(tmp_path / "v1")
        assert document["version"] == 1 and "packs" not in document
        assert all("offset" not in e and e["name"].startswith("leaf_")
                   for e in document["leaves"])
        packing.write(str(tmp_path / "v2"), state, asynchronous=False)
        for reader, directory in ((packing, "v1"), (unpacked, "v2")):
            restored = reader.read(str(tmp_path / directory), like_of(state))
            assert_bitwise_equal(restored["w"], state["w"])
            assert restored["n"] == 7
            assert_bitwise_equal(jax.random.key_data(restored["k"]),
                                 jax.random.key_data(state["k"]))
    finally:
        unpacked.close()
        packing.close()


@pytest.mark.parametrize("pack_leaf_bytes", [0, 1 << 20], ids=["unpacked", "packed"])
def test_reused_buffers_never_change_an_earlier_checkpoint(tmp_path, pack_leaf_bytes):
    backend = OrbaxBackend(pack_leaf_bytes=pack_leaf_bytes)
    try:
        host = np.zeros(1 << 12, np.float32)
        small = np.zeros(8, np.int32)
        for step in range(3):
            host[:] = step
            small[:] = step
            handle = backend.write(str(tmp_path / f"s{step}"), {"h": host, "s": small},
                                   asynchronous=True)
            host[:] = -1.0  # the loop reuses its buffers right after staging
            small[:] = -1
        handle.wait()
        for step in range(3):
            restored = backend.read(str(tmp_path / f"s{step}"),
                                    {"h": np.zeros_like(host), "s": np.zeros_like(small)})
            assert (restored["h"] == step).all() and (restored["s"] == step).all()
    finally:
        backend.close()


def test_tree_json_naming_a_missing_pack_or_outside_offset_is_corrupt(backend, tmp_path):
    state = {"a": jnp.arange(4.0), "b": jnp.arange(3.0)}
    like = like_of(state)
    for case in ("offset", "pack"):
        directory = tmp_path / case
        backend.write(str(directory), state, asynchronous=False)
        document = tree_json(directory)
        entry = next(e for e in document["leaves"] if e["path"] == "['b']")
        if case == "offset":
            size = next(p["size"] for p in document["packs"] if p["name"] == entry["name"])
            entry["offset"] = size - 2  # 3 elements from there overrun the pack
        else:
            entry["name"] = "pack_float32_007"
        (directory / "tree.json").write_text(json.dumps(document))
        with pytest.raises(CheckpointCorruptError, match=r"\['b'\]"):
            backend.read(str(directory), like)


def test_pack_settings_are_validated():
    with pytest.raises(ValueError, match="pack_bytes"):
        OrbaxBackend(pack_leaf_bytes=1 << 20, pack_bytes=1024)
    with pytest.raises(ValueError, match="pack_leaf_bytes"):
        OrbaxBackend(pack_leaf_bytes=-1)


def test_second_async_write_is_staged_while_the_first_still_writes(tmp_path, monkeypatch):
    """A save that writes a changed auxiliary item and then the state: the state's staging
    must not wait for the item's write, nor reuse the buffers that write still reads."""
    import threading

    backend = OrbaxBackend()
    release = threading.Event()
    original = backend._write_local

    def held_write(root, tree_json, save_args):
        release.wait(30)
        original(root, tree_json, save_args)

    monkeypatch.setattr(backend, "_write_local", held_write)
    try:
        small = np.arange(64, dtype=np.float32)
        first = backend.write(str(tmp_path / "item"), {"w": small}, asynchronous=True)
        second = backend.write(str(tmp_path / "state"), {"w": small + 100.0}, asynchronous=True)
        # Had the second write waited for the first, it could only have returned once the
        # held write gave up waiting (30 s) and finished.
        assert not first.done() and not second.done()
        release.set()
        first.wait()
        second.wait()
        for name, expected in (("item", small), ("state", small + 100.0)):
            restored = backend.read(str(tmp_path / name), {"w": np.zeros_like(small)})
            assert_bitwise_equal(restored["w"], expected)
    finally:
        release.set()
        backend.close()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int4"])
def test_packs_of_dtypes_with_underscores_or_sub_byte_sizes_restore(backend, tmp_path, dtype):
    import ml_dtypes

    values = np.arange(-4, 4, dtype=np.float32).astype(getattr(ml_dtypes, dtype))
    state = {"host": values, "device": jnp.asarray(values)}
    backend.write(str(tmp_path / "ckpt"), state, asynchronous=True).wait()
    assert {pack["name"] for pack in tree_json(tmp_path / "ckpt")["packs"]} == {
        f"pack_{dtype}_000"}

    restored = backend.read(str(tmp_path / "ckpt"), like_of(state))
    for name in state:
        assert_bitwise_equal(restored[name], state[name])


# ------------------------------------------------------------- write plans reused across saves


def assert_same_tree(restored, state):
    """Same structure, and every leaf the same type and bits (keys: impl and key data)."""
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        if isinstance(want, jax.Array) and jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(want))
            assert_bitwise_equal(jax.random.key_data(got), jax.random.key_data(want))
        elif isinstance(want, (bool, int, float)):
            assert type(got) is type(want) and got == want
        else:
            assert type(got) is type(want) or (isinstance(got, jax.Array)
                                               and isinstance(want, jax.Array))
            assert_bitwise_equal(got, want)


@pytest.fixture
def plan_builds(monkeypatch):
    """Counts the write plans built from scratch (saves whose layout was not cached)."""
    import jaxckpt.backends.orbax.backend as orbax_backend

    calls = []
    original = orbax_backend._build_plan

    def counting(state, **settings):
        calls.append(settings)
        return original(state, **settings)

    monkeypatch.setattr(orbax_backend, "_build_plan", counting)
    return calls


@pytest.fixture
def fresh_backend():
    """A backend whose plan cache starts empty (the module's ``backend`` is shared)."""
    orbax_backend = OrbaxBackend()
    yield orbax_backend
    orbax_backend.close()


def uncached_tree_json(state, directory):
    """tree.json as a backend that never saw any layout writes it for ``state``."""
    reference = OrbaxBackend()
    try:
        reference.write(str(directory), state, asynchronous=False)
    finally:
        reference.close()
    return (directory / "tree.json").read_bytes()


def test_saves_of_one_layout_reuse_the_plan_and_keep_their_own_values(
        fresh_backend, plan_builds, tmp_path):
    states = [mixed_small_state(step) for step in range(4)]
    # 0 and 1 overlap (1 is staged while 0 may still write: other pack buffers), 2 and 3
    # come after a wait (they refill the buffers 0 and 1 used).
    first = fresh_backend.write(str(tmp_path / "s0"), states[0], asynchronous=True)
    second = fresh_backend.write(str(tmp_path / "s1"), states[1], asynchronous=True)
    first.wait()
    second.wait()
    fresh_backend.write(str(tmp_path / "s2"), states[2], asynchronous=True).wait()
    fresh_backend.write(str(tmp_path / "s3"), states[3], asynchronous=False)

    assert len(plan_builds) == 1  # one layout, planned once
    for step, state in enumerate(states):
        restored = fresh_backend.read(str(tmp_path / f"s{step}"), like_of(state))
        assert_same_tree(restored, state)
    # Typed keys, numpy leaves and Python scalars of a reused plan hold this save's values.
    last = fresh_backend.read(str(tmp_path / "s3"), like_of(states[3]))
    assert (last["step"], last["lr"], last["done"]) == (44, 0.5, True)
    assert last["np_scalar"] == np.float32(5.5)


def test_tree_json_of_a_reused_plan_is_the_uncached_one_byte_for_byte(
        fresh_backend, plan_builds, tmp_path):
    fresh_backend.write(str(tmp_path / "s0"), mixed_small_state(0), asynchronous=True).wait()
    state = mixed_small_state(1)
    fresh_backend.write(str(tmp_path / "s1"), state, asynchronous=True).wait()
    assert len(plan_builds) == 1

    cached = (tmp_path / "s1" / "tree.json").read_bytes()
    assert cached == uncached_tree_json(state, tmp_path / "reference")
    assert len(plan_builds) == 2  # the reference backend planned from scratch


def test_every_change_of_layout_gets_a_new_plan_and_a_correct_checkpoint(
        fresh_backend, plan_builds, tmp_path):
    base = {"w": jnp.arange(6.0), "h": np.arange(4, dtype=np.int32), "n": 3,
            "k": jax.random.key(0), "big": jnp.arange(1 << 19, dtype=jnp.float32)}
    variants = {
        "base": base,
        "shape": base | {"w": jnp.arange(8.0)},
        "dtype": base | {"w": jnp.arange(6.0, dtype=jnp.bfloat16)},
        "numpy_dtype": base | {"h": np.arange(4, dtype=np.int64)},
        "added_key": base | {"extra": jnp.ones(2)},
        "python_type": base | {"n": 3.5},
        "python_bool": base | {"n": True},
        "key_impl": base | {"k": jax.random.key(0, impl="rbg")},
        "numpy_not_jax": base | {"w": np.arange(6.0, dtype=np.float32)},
        "unpacked": base | {"w": jnp.arange(1 << 19, dtype=jnp.float32) + 1.0},
        # Equal dict keys (equal treedefs) whose tree paths differ: [1], [np.int64(1)], [True].
        "int_key": {1: jnp.ones(2)},
        "numpy_int_key": {np.int64(1): jnp.ones(2)},
        "bool_key": {True: jnp.ones(2)},
        "base_again": base,
    }
    for label, state in variants.items():
        directory = tmp_path / label
        fresh_backend.write(str(directory), state, asynchronous=True).wait()
        assert (directory / "tree.json").read_bytes() == \
            uncached_tree_json(state, tmp_path / f"{label}_reference"), label
        assert_same_tree(fresh_backend.read(str(directory), like_of(state)), state)
    paths = {label: [leaf["path"] for leaf in tree_json(tmp_path / label)["leaves"]]
             for label in ("int_key", "numpy_int_key", "bool_key")}
    assert paths == {"int_key": ["[1]"], "numpy_int_key": ["[np.int64(1)]"],
                     "bool_key": ["[True]"]}
    # Every layout was planned (twice: by the reused backend and by its reference), base
    # again too: more layouts than a backend keeps came in between.
    assert len(plan_builds) == 2 * len(variants)


def test_alternating_layouts_each_keep_their_plan(fresh_backend, plan_builds, tmp_path):
    item = {"count": jnp.zeros((), jnp.int32), "seen": np.zeros(3, np.int64)}
    state = mixed_small_state()
    for step in range(3):
        fresh_backend.write(str(tmp_path / f"item{step}"), item, asynchronous=True)
        fresh_backend.write(str(tmp_path / f"state{step}"), state, asynchronous=True).wait()
    assert len(plan_builds) == 2

    # A backend keeps a few plans: the least recently used one goes first.
    from jaxckpt.backends.orbax.backend import _MAX_PLANS

    for width in range(1, _MAX_PLANS + 1):
        fresh_backend.write(str(tmp_path / f"other{width}"), {"v": np.zeros(width)},
                            asynchronous=False)
    assert len(plan_builds) == 2 + _MAX_PLANS
    fresh_backend.write(str(tmp_path / "other_again"), {"v": np.zeros(_MAX_PLANS)},
                        asynchronous=False)
    assert len(plan_builds) == 2 + _MAX_PLANS  # kept
    fresh_backend.write(str(tmp_path / "item_again"), item, asynchronous=False)
    assert len(plan_builds) == 3 + _MAX_PLANS  # dropped, planned again
    assert_same_tree(fresh_backend.read(str(tmp_path / "item_again"), like_of(item)), item)


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1])
def test_python_int_beyond_int64_raises_even_with_a_reused_plan(
        fresh_backend, plan_builds, tmp_path, value):
    state = {"w": jnp.ones(3), "opt": {"step": 2**63 - 1}}
    fresh_backend.write(str(tmp_path / "ok"), state, asynchronous=True).wait()

    message = r"leaf \['opt'\]\['step'\] is the Python int .*int64.*Fix:"
    with pytest.raises(TypeError, match=message):
        fresh_backend.write(str(tmp_path / "bad"), state | {"opt": {"step": value}},
                            asynchronous=True)
    assert not (tmp_path / "bad").exists()  # checked before any I/O
    assert len(plan_builds) == 1  # the layout's plan was reused, and the value still checked

    state["opt"]["step"] = -(2**63)
    fresh_backend.write(str(tmp_path / "again"), state, asynchronous=True).wait()
    assert fresh_backend.read(str(tmp_path / "again"), like_of(state))["opt"]["step"] == -(2**63)


def test_bad_leaves_raise_as_before_whatever_was_cached(fresh_backend, plan_builds, tmp_path):
    fresh_backend.write(str(tmp_path / "ok"), {"w": jnp.ones(3), "h": np.ones(2)},
                        asynchronous=True).wait()
    bad = {
        "text": ({"w": "run-1", "h": np.ones(2)}, r"\['w'\] is a builtins.str"),
        "abstract": ({"w": jax.ShapeDtypeStruct((3,), jnp.float32), "h": np.ones(2)},
                     r"\['w'\] is a jax.*ShapeDtypeStruct"),
        "objects": ({"w": jnp.ones(3), "h": np.array([None, 1], dtype=object)},
                    r"\['h'\] is a numpy array of dtype object"),
    }
    for label, (state, message) in bad.items():
        for _ in range(2):  # a layout that failed was not cached either
            with pytest.raises(TypeError, match=message):
                fresh_backend.write(str(tmp_path / label), state, asynchronous=True)
        assert not (tmp_path / label).exists()
    assert len(plan_builds) == 1 + 2 * len(bad)


#: A fresh process: an incremental native save of two steps (``argv[2] == "save"``) or a
#: restore by a new manager; prints whether Orbax or TensorStore was imported, and the state.
_FRESH_PROCESS = """
import json, sys
import jax, jax.numpy as jnp, jaxckpt
state = {"w": jnp.arange(8.0), "b": {"x": jnp.ones((3, 4), jnp.bfloat16)}}
config = jaxckpt.RecoverConfig(incremental=True)
with jaxckpt.CheckpointManager(sys.argv[1], preemption_signals=(), mode="sync",
                               recover=config) as manager:
    if sys.argv[2] == "save":
        manager.save(jaxckpt.StepInfo(0, 1, 1), state).wait()
        state["w"] = state["w"] + 1
        manager.save(jaxckpt.StepInfo(0, 2, 2), state).wait()
    else:
        state = manager.restore(like=jax.tree.map(jnp.zeros_like, state)).state
print(json.dumps({"imported": sorted(name for name in ("orbax.checkpoint", "tensorstore")
                                     if name in sys.modules),
                  "w": state["w"].tolist(), "x": state["b"]["x"].astype(float).tolist()}))
"""


def test_native_save_and_restore_never_import_orbax(tmp_path: pathlib.Path) -> None:
    """A restarted process that saves (incrementally) or restores natively imports neither
    orbax.checkpoint nor TensorStore: importing them is a large share of its time back to
    training."""
    found = []
    for action in ("save", "restore"):
        done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(tmp_path), action],
                              env=repo_env(), capture_output=True, text=True, check=True)
        found.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert [f["imported"] for f in found] == [[], []]
    assert found[1]["w"] == [float(i + 1) for i in range(8)]
    assert found[1]["x"] == [[1.0] * 4] * 3


def test_tree_json_lines_are_json_dumps_of_each_entry() -> None:
    """tree.json's lines for plain arrays are put together by hand (fast with many leaves):
    the text is json.dumps' own, escapes, offsets and empty shapes included."""
    from jaxckpt.backends.orbax.tree import SavedLeaf, tree_json_text

    entries = [
        SavedLeaf(path="['a']['é\"\\\n\u2028']", name="pack_000000", kind="array", shape=(),
                  dtype="float32", offset=0),
        SavedLeaf(path="['w']", name="leaf_000001", kind="array", shape=(3, 4),
                  dtype="bfloat16"),
        SavedLeaf(path="['k']", name="leaf_000002", kind="key", shape=(2,), dtype="key<fry>",
                  impl="threefry2x32", data_shape=(2, 2), data_dtype="uint32"),
        SavedLeaf(path="['s']", name="pack_000000", kind="scalar", shape=(), dtype="int64",
                  python_type="int", offset=7)]
    text = tree_json_text(entries, [{"name": "pack_000000", "dtype": "float32", "size": 8}])
    lines = text.split("\n")
    start = lines.index(' "leaves": [') + 1
    assert [line.strip().rstrip(",") for line in lines[start:start + len(entries)]] == \
        [json.dumps(entry.to_json()) for entry in entries]
    assert [SavedLeaf.from_json(e) for e in json.loads(text)["leaves"]] == entries
