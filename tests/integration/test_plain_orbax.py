"""What plain Orbax (a process that never imports jaxckpt) reads of a jaxckpt checkpoint: the
exact claim made in docs/guarantees.md, "Reading a checkpoint without jaxckpt".

Plain Orbax restores ``state/arrays`` as a flat dict of storage names (``leaf_000001``,
``pack_float32_000``) with every byte and dtype intact; the user's tree (paths, small packed
leaves, typed PRNG keys, Python scalars) comes back only through jaxckpt's ``tree.json``, a
JSON file any program can read. Container types (tuple vs list, NamedTuple, nnx.State) are
not recorded anywhere: they come from the caller's own target."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt

from support.paths import REPO

# Runs in a fresh interpreter without jaxckpt on the path: only numpy, jax, orbax and json.
READER = r'''
import hashlib, json, sys
import ml_dtypes, numpy as np, jax, orbax.checkpoint as ocp

state_dir = sys.argv[1]
user_paths = json.loads(sys.argv[2])
arrays_dir = state_dir + "/arrays"
with open(state_dir + "/tree.json") as handle:
    tree = json.load(handle)

def dtype_of(name):
    return np.dtype(getattr(ml_dtypes, name, None) or name)

def sha(array):
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()

with ocp.StandardCheckpointer() as checkpointer:
    flat = checkpointer.restore(arrays_dir)  # no target
    target = {pack["name"]: jax.ShapeDtypeStruct((pack["size"],), dtype_of(pack["dtype"]))
              for pack in tree.get("packs", [])}
    for leaf in tree["leaves"]:
        if "offset" not in leaf:
            shape = leaf["data_shape"] if leaf["kind"] == "key" else leaf["shape"]
            dtype = leaf["data_dtype"] if leaf["kind"] == "key" else leaf["dtype"]
            target[leaf["name"]] = jax.ShapeDtypeStruct(tuple(shape), dtype_of(dtype))
    flat_from_target = checkpointer.restore(arrays_dir, target)
    try:  # the user's own tree as the target: its paths are not Orbax's names
        checkpointer.restore(arrays_dir, {p: jax.ShapeDtypeStruct((1,), np.float32)
                                          for p in user_paths})
        user_target_error = None
    except Exception as exc:
        user_target_error = type(exc).__name__ + ": " + str(exc)[:200]

leaves = {}
for leaf in tree["leaves"]:
    data = np.asarray(flat[leaf["name"]])
    stored_shape = tuple(leaf["data_shape"] if leaf["kind"] == "key" else leaf["shape"])
    if "offset" in leaf:
        count = int(np.prod(stored_shape, dtype=np.int64))
        data = data[leaf["offset"]:leaf["offset"] + count].reshape(stored_shape)
    if leaf["kind"] == "key":
        key = jax.random.wrap_key_data(data, impl=leaf["impl"])
        leaves[leaf["path"]] = ["key", str(key.dtype), list(key.shape),
                                sha(jax.random.key_data(key))]
    elif leaf["kind"] == "scalar":
        value = {"int": int, "float": float, "bool": bool}[leaf["python_type"]](data[()])
        leaves[leaf["path"]] = [type(value).__name__, str(data.dtype), [], sha(data)]
    else:
        leaves[leaf["path"]] = ["array", str(data.dtype), list(data.shape), sha(data)]

print(json.dumps({
    "jaxckpt_imported": any(m.split(".")[0] == "jaxckpt" for m in sys.modules),
    "names": sorted(flat),
    "flat": {k: [str(np.asarray(v).dtype), list(np.shape(v))] for k, v in flat.items()},
    "target_equal": all(sha(flat[k]) == sha(np.asarray(flat_from_target[k]))
                        and np.asarray(flat[k]).dtype == np.asarray(flat_from_target[k]).dtype
                        for k in flat),
    "user_target_error": user_target_error,
    "leaves": leaves,
}))
'''


def saved_state() -> dict:
    rng = np.random.default_rng(0)
    return {
        "big": rng.standard_normal(400_000).astype(np.float32),   # its own Orbax array
        "dense": {"kernel": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
                  "bias": jnp.asarray(rng.standard_normal(4), jnp.bfloat16)},
        "counts": np.array([1, -2, 3], np.int32),
        "mask": np.array([True, False]),
        "half": np.array([0.5, -1.0], np.float16),
        "layers": [np.ones((2, 2), np.float32), (np.arange(3, dtype=np.int64),)],
        "key": jax.random.key(3),                                 # typed PRNG key
        "raw_key": jax.random.PRNGKey(4),                         # old-style uint32 key
        "step": 7,                                                # Python scalars
        "lr": 0.125,
    }


def digest(state) -> dict:
    def one(leaf):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return ["key", str(leaf.dtype), list(leaf.shape),
                    hashlib.sha256(np.asarray(jax.random.key_data(leaf)).tobytes()).hexdigest()]
        array = np.asarray(leaf)
        kind = type(leaf).__name__ if isinstance(leaf, (int, float, bool)) else "array"
        return [kind, str(array.dtype), [] if kind != "array" else list(array.shape),
                hashlib.sha256(array.tobytes()).hexdigest()]
    return {jax.tree_util.keystr(p): one(leaf)
            for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def read_without_jaxckpt(state_dir: Path, user_paths: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", READER, str(state_dir), json.dumps(user_paths)],
                            cwd=state_dir, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("native_io", [True, False], ids=["jaxckpt_writer", "orbax_writer"])
def test_plain_orbax_reads_every_byte_and_tree_json_rebuilds_the_tree(native_io, tmp_path):
    from jaxckpt.backends.orbax.backend import OrbaxBackend

    state = saved_state()
    with jaxckpt.CheckpointManager(tmp_path / "run", mode="sync",
                                   backend=OrbaxBackend(native_io=native_io)) as manager:
        path = manager.save(jaxckpt.StepInfo(0, 0, 0, 10), state).path
    expected = digest(state)
    got = read_without_jaxckpt(Path(path) / "state", sorted(expected))
    assert got["jaxckpt_imported"] is False
    # Without tree.json: a flat dict of storage names, not the saved tree.
    assert not set(got["names"]) & set(expected)
    assert all(name.startswith(("leaf_", "pack_")) for name in got["names"])
    assert {dtype for dtype, _ in got["flat"].values()} >= {"bfloat16", "float16", "bool",
                                                            "int32", "uint32"}
    assert got["target_equal"] is True  # a target of the stored shapes/dtypes: the same bits
    assert "Structure mismatch" in got["user_target_error"]
    # With tree.json: every leaf, bit for bit, with its dtype, shape, key impl and scalar type.
    assert got["leaves"] == expected
    # ... which is what the guarantees page claims, no more.
    text = (REPO / "docs" / "guarantees.md").read_text()
    section = text.split("## Reading a checkpoint without jaxckpt", 1)[1].split("\n## ", 1)[0]
    for fact in ("tree.json", "pack_", "wrap_key_data", "python_type", "tuple",
                 "tests/integration/test_plain_orbax.py"):
        assert fact in section, fact
