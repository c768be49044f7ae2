"""Every dtype and shape numpy / jax can hold, through CheckpointManager save -> restore.

One table: each dtype numpy and ml_dtypes define, at shapes (), (0,), (3, 0), (2, 0, 4) and
a 1-D array of awkward bit patterns (every pattern of a one-byte type; NaNs with payloads,
-0.0 and infinities of wider floats), as numpy leaves and, where jax holds the dtype, as
jax.Array leaves (64-bit types under ``jax.enable_x64``). Restores must be bit-exact, through
the native single-process writer (``backends.orbax.chunk_io``, packed and unpacked leaves) and
through plain Orbax (``native_io=False``). Dtypes Orbax has no type for are stored as their
bytes (tree.json version 3); the others exactly as before.
"""

from __future__ import annotations

import contextlib
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxckpt
from jaxckpt.backends.orbax.backend import OrbaxBackend

STORABLE = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "bfloat16", "complex64", "complex128",
    "int2", "int4", "float4_e2m1fn", "float8_e3m4", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
]
AS_BYTES = ["uint2", "uint4", "float8_e4m3", "float6_e2m3fn", "float6_e3m2fn",
                "int1", "uint1", "complex32", "bcomplex32", "longdouble", "clongdouble",
                "V4"]  # numpy's raw bytes
SUB_BYTE = {"int1", "uint1", "int2", "uint2", "int4", "uint4", "float4_e2m1fn",
            "float6_e2m3fn", "float6_e3m2fn"}
SHAPES = {"scalar": (), "empty": (0,), "empty_2d": (3, 0), "empty_3d": (2, 0, 4)}

BACKENDS = {
    "native-packed": dict(),
    "native-unpacked": dict(pack_leaf_bytes=0),
    "orbax": dict(native_io=False, pack_leaf_bytes=0),
    "orbax-packed": dict(native_io=False),
}


def numpy_dtype(name):
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def patterns(name, seed=0):
    """A 1-D array of ``name`` with the bit patterns that a lossy path would change."""
    dtype = numpy_dtype(name)
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.random(37) < 0.5
    if name in SUB_BYTE:
        # numpy holds one element per byte; only the canonical bytes are values.
        every = np.arange(256, dtype=np.uint8).view(dtype)
        return every.astype(np.float32).astype(dtype)
    if dtype.itemsize == 1:
        return np.arange(256, dtype=np.uint8).view(dtype)  # every bit pattern
    values = np.frombuffer(rng.bytes(64 * dtype.itemsize), dtype=dtype).copy()
    if dtype.kind in "fcV" and dtype.type is not np.void:  # ml_dtypes floats are kind V
        specials = np.array([np.nan, -0.0, np.inf, -np.inf, 0.0]).astype(dtype)
        payload = specials[:1].copy()
        payload.view(np.uint8)[0] ^= 1  # the NaN with another payload
        assert payload.tobytes() != specials[:1].tobytes()
        values = np.concatenate([specials, payload, values])
    return values


def leaves(name):
    """{"values": 1-D patterns, "scalar": 0-d, "empty...": zero-size, "np_scalar": numpy
    scalar} of dtype ``name``."""
    values = patterns(name)
    out = {"values": values, "np_scalar": values[1]}
    for label, shape in SHAPES.items():
        out[label] = values[:int(np.prod(shape))].reshape(shape)
    return out


def jax_holds(dtype):
    try:
        return jnp.asarray(np.zeros((3,), dtype)).dtype == dtype
    except Exception:  # noqa: BLE001 - jax has no such type
        return False


def assert_bit_exact(got, want, where):
    assert isinstance(got, type(want)) or (isinstance(want, jax.Array)
                                           and isinstance(got, jax.Array)), where
    got_np, want_np = np.asarray(got), np.asarray(want)
    assert got_np.dtype == want_np.dtype, where
    assert got_np.shape == want_np.shape, where
    if isinstance(want, np.generic) and want.dtype.kind in "fc" and want.dtype.itemsize > 8 \
            and np.finfo(np.longdouble).nexp == 15:
        # An x87 long double scalar has 6 padding bytes per 16 that numpy does not keep
        # through a scalar conversion (arrays keep them): compare the 10 value bytes.
        got_np, want_np = (np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(-1, 16)
                           [:, :10] for a in (got_np, want_np))
    assert got_np.tobytes() == want_np.tobytes(), where


@pytest.fixture(params=list(BACKENDS), scope="module")
def backend(request):
    created = OrbaxBackend(**BACKENDS[request.param])
    yield created
    created.close()


def save_and_restore(root, backend, state):
    config = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1))
    step = jaxckpt.StepInfo(0, 0, 0, None)
    with jaxckpt.CheckpointManager(str(root), recover=config, backend=backend,
                                   preemption_signals=()) as mgr:
        mgr.save(step, state, mode="sync")
    with jaxckpt.CheckpointManager(str(root), recover=config, backend=backend,
                                   preemption_signals=()) as mgr:
        like = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
                            if isinstance(leaf, jax.Array) else np.zeros_like(leaf)
                            if isinstance(leaf, np.ndarray) else leaf, state)
        return mgr.recover(like).state


@pytest.mark.parametrize("name", STORABLE + AS_BYTES)
def test_every_dtype_and_shape_round_trips_bit_exact(tmp_path, backend, name):
    dtype = numpy_dtype(name)
    x64 = jax.enable_x64(True) if dtype.itemsize == 8 or name == "complex128" \
        else contextlib.nullcontext()
    with x64:
        host = leaves(name)
        state = {"numpy": host}
        if jax_holds(dtype):
            state["jax"] = {label: jnp.asarray(value) for label, value in host.items()
                            if label != "np_scalar"}
            assert state["jax"]["empty_2d"].shape == (3, 0)
        restored = save_and_restore(tmp_path / "all", backend, state)
        assert sorted(restored) == sorted(state)
        for kind, tree in state.items():
            for label, want in tree.items():
                assert_bit_exact(restored[kind][label], want, f"{kind}/{label}")
        assert type(restored["numpy"]["np_scalar"]) is type(host["np_scalar"])
        # A tree whose leaves of this dtype are all empty: nothing to pack them with.
        empty = {kind: {label: tree[label] for label in SHAPES if label.startswith("empty")}
                 for kind, tree in state.items()}
        restored = save_and_restore(tmp_path / "empty", backend, empty)
        for kind, tree in empty.items():
            for label, want in tree.items():
                assert_bit_exact(restored[kind][label], want, f"empty {kind}/{label}")


@pytest.mark.parametrize("name", AS_BYTES)
def test_a_dtype_orbax_has_no_type_for_is_stored_as_its_bytes(tmp_path, name):
    ml_types = {n for n in dir(ml_dtypes) if isinstance(getattr(ml_dtypes, n), type)
                and issubclass(getattr(ml_dtypes, n), np.generic)}
    assert ml_types <= set(STORABLE) | set(AS_BYTES)  # the table misses no type
    backend = OrbaxBackend(pack_leaf_bytes=0)
    values = patterns(name)
    try:
        restored = save_and_restore(tmp_path, backend, {"odd": {"leaf": values}})
    finally:
        backend.close()
    assert_bit_exact(restored["odd"]["leaf"], values, name)
    tree = json.loads(next(tmp_path.rglob("tree.json")).read_text())
    assert tree["version"] == 3
    [leaf] = tree["leaves"]
    assert leaf["dtype"] == values.dtype.name and leaf["data_dtype"] == "uint8"
    assert leaf["data_shape"] == [len(values), values.dtype.itemsize]


def test_zero_size_leaves_beside_others_of_their_dtype_and_alone(tmp_path):
    """Zero-size leaves share a pack with data of their dtype, or make a pack of their
    own; a typed key array of zero keys keeps its impl."""
    state = {"w": np.arange(4, dtype=np.float32), "none": np.zeros((0, 5), np.float32),
             "only": jnp.zeros((0,), jnp.int8), "keys": jax.random.split(jax.random.key(0), 0)}
    backend = OrbaxBackend()
    try:
        restored = save_and_restore(tmp_path, backend, state)
    finally:
        backend.close()
    assert restored["none"].shape == (0, 5) and restored["only"].shape == (0,)
    assert restored["keys"].shape == (0,)
    assert str(jax.random.key_impl(restored["keys"])) == str(jax.random.key_impl(state["keys"]))
    np.testing.assert_array_equal(restored["w"], state["w"])
