"""Saving and restoring many small leaves: packs filled by the writer's I/O threads as it
writes them; packed leaves aligned in their packs, placed on their device the cheap way
(``jaxckpt.backends.orbax.place``), with the same arrays ``jax.device_put`` gives, pack by pack as
the packs are read.

Costs are checked by counting Python calls per leaf, never by timing: the ratios measured
against few leaves are in benchmarks/results/leaves-per-leaf_cpu2core_2026-11-25.md."""

from __future__ import annotations

import functools
import gc
import json
import sys
import threading
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxckpt.backends.orbax import match as orbax_match, read as orbax_read, write as orbax_write
from jaxckpt.backends.orbax.backend import OrbaxBackend
from jaxckpt.backends.orbax.options import DEFAULT_PACK_BYTES, DEFAULT_PACK_LEAF_BYTES
from jaxckpt.backends.orbax.place import owned_on_cpu, place
from jaxckpt.backends.orbax.plan import PACK_ALIGN, build_plan
from jaxckpt.errors import CheckpointCorruptError
from jaxckpt.storage.buffers import aligned_empty


@pytest.fixture
def backend():
    made = OrbaxBackend()
    yield made
    made.close()


def _host_arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    pack = aligned_empty((4096,), np.uint8)
    pack[:] = rng.integers(0, 255, pack.shape, dtype=np.uint8)
    return [
        rng.standard_normal((3, 5)).astype(np.float32),
        rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
        np.array(True),
        np.arange(9, dtype=np.int8).reshape(3, 3),
        (rng.standard_normal(4) + 1j).astype(np.complex64),
        np.arange(5, dtype=np.float64),  # jax (x64 off) converts it: jax.device_put decides
        np.zeros((0, 3), np.float32),
        pack[64:64 + 128].view(np.float32),  # aligned view: adopted without a copy on CPU
        pack[3:3 + 40].view(np.int8),  # unaligned view: copied
    ]


def test_place_gives_the_arrays_device_put_gives():
    arrays = _host_arrays()
    device = jax.devices()[0]
    shardings = [jax.sharding.SingleDeviceSharding(device)] * len(arrays)
    placed = place(arrays, shardings)
    expected = jax.device_put(arrays, shardings)
    for index, (got, want) in enumerate(zip(placed, expected, strict=True)):
        assert isinstance(got, jax.Array), index
        assert got.dtype == want.dtype and got.shape == want.shape, index
        assert got.aval == want.aval and got.weak_type == want.weak_type, index
        assert got.sharding == want.sharding and got.committed == want.committed, index
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # Usable like any other array in a jitted computation.
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: x)(got)), np.asarray(want))


def test_owned_on_cpu_gives_xla_memory_the_caller_fills_and_jax_sees():
    device = jax.devices()[0]
    single = jax.sharding.SingleDeviceSharding(device)
    for dtype in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
        want = np.arange(24).astype(dtype).reshape(4, 6)
        owned = owned_on_cpu(want.shape, dtype, single)
        assert owned is not None
        array, memory = owned
        assert array.sharding == single and array.committed and array.dtype == dtype
        memory[:] = want.reshape(-1).view(np.uint8)
        np.testing.assert_array_equal(np.asarray(array), want)
        assert array.unsafe_buffer_pointer() == memory.ctypes.data
    # Where XLA's memory is not this process's CPU memory, or jax would convert the dtype:
    # the caller reads into a host buffer and places it.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    assert owned_on_cpu((8,), np.dtype(np.float32), named) is None
    assert owned_on_cpu((0,), np.dtype(np.float32), single) is None
    if not jax.config.jax_enable_x64:
        assert owned_on_cpu((8,), np.dtype(np.float64), single) is None


def test_place_takes_other_shardings_through_device_put():
    arrays = [np.arange(8, dtype=np.float32), np.arange(4, dtype=np.int32)]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = place(arrays, [named, single])
    assert placed[0].sharding == named and placed[1].sharding == single
    np.testing.assert_array_equal(np.asarray(placed[0]), arrays[0])
    np.testing.assert_array_equal(np.asarray(placed[1]), arrays[1])


def test_packed_leaves_start_at_aligned_offsets_in_their_packs():
    # Odd sizes and several dtypes, so that contiguous packing would misalign them.
    state = {f"l{i}": np.ones((3 + i,), dtype) for i, dtype in
             enumerate([np.float32, np.int8, ml_dtypes.bfloat16, np.float64] * 4)}
    state["empty"] = np.zeros((0,), np.float32)
    plan = build_plan(state, leaf_limit=1 << 20, pack_limit=1 << 20, local=True)
    document = json.loads(plan.tree_json)
    sizes = {pack["name"]: pack["size"] for pack in document["packs"]}
    packed = [leaf for leaf in document["leaves"] if "offset" in leaf]
    assert len(packed) == len(state)
    for leaf in packed:
        itemsize = np.dtype(getattr(ml_dtypes, leaf["dtype"], leaf["dtype"])).itemsize
        count = int(np.prod(leaf["shape"]))
        if count:
            assert leaf["offset"] * itemsize % PACK_ALIGN == 0, leaf
        assert leaf["offset"] + count <= sizes[leaf["name"]], leaf


def test_packed_leaves_round_trip_with_their_padding(backend, tmp_path):
    state = {f"l{i}": jnp.arange(3 + i, dtype=dtype) + i for i, dtype in
             enumerate([jnp.float32, jnp.int8, jnp.bfloat16, jnp.int32] * 5)}
    state["empty"] = jnp.zeros((0, 2), jnp.float32)
    backend.write(str(tmp_path / "c"), state, asynchronous=False)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    restored = backend.read(str(tmp_path / "c"), like)
    for path, value in state.items():
        assert restored[path].dtype == value.dtype, path
        np.testing.assert_array_equal(np.asarray(restored[path]), np.asarray(value))


def _read_calls(backend: OrbaxBackend, directory: str, like: object) -> int:
    """Python and C calls made by one read (what per-leaf overhead is made of)."""
    return _calls(lambda: backend.read(directory, like))


def test_restore_of_small_leaves_costs_few_calls_per_leaf(backend, tmp_path):
    counts = []
    for leaves in (300, 600):
        state = {f"l{i}": jnp.full((7 + i % 5,), i, jnp.float32) for i in range(leaves)}
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        directory = str(tmp_path / str(leaves))
        backend.write(directory, state, asynchronous=False)
        backend.read(directory, like)  # first read: caches, thread pools
        counts.append(_read_calls(backend, directory, like))
    per_leaf = (counts[1] - counts[0]) / 300
    # jax.device_put per leaf (in one batch) made about 190 calls a leaf; the direct way
    # about 55; tree.json entries and targets as named tuples, pack checks once per pack
    # and the usual packed leaf cut inline about 39; tree.json parsed in one pass, the
    # usual like leaf and comparison spelled out, placement plans found by shape and dtype
    # without hashing the sharding, and nothing done per leaf for the leaves that need no
    # conversion, about 25; item access instead of dict.get and like's paths made
    # without jax's key objects, about 13. Matching, cutting and wrapping are in the rest.
    assert per_leaf < 18, per_leaf


class _HeldFiles:
    """An ArrayFiles for the reader that holds back the read of the files whose path holds
    ``held`` until ``release`` is set (or 20 s passed), recording whether it was set."""

    def __init__(self, files, held: str, release: threading.Event, wait_s: float = 20):
        self.files, self.held, self.release, self.wait_s = files, held, release, wait_s
        self.released: list[bool] = []
        self.started = threading.Event()  # set when any read starts

    def read_small(self, path, limit):
        return self.files.read_small(path, limit)

    def read_chunk(self, path, nbytes, **kwargs):
        self.started.set()
        if self.held in path:
            self.released.append(self.release.wait(self.wait_s))
        return self.files.read_chunk(path, nbytes, **kwargs)


def test_a_packs_leaves_are_placed_while_later_packs_are_still_read(tmp_path, monkeypatch):
    # Cutting and placing thousands of leaves costs microseconds each: done pack by pack
    # as the packs arrive, it overlaps the reading of the rest instead of following it.
    held, _, state, restored = _read_holding(tmp_path, monkeypatch, "/pack_float32_002/",
                                             wait_s=20, read_threads=2)
    assert [files.released for files in held] == [[True]]
    for path, value in state.items():
        np.testing.assert_array_equal(np.asarray(restored[path]), np.asarray(value))


def _read_holding(tmp_path, monkeypatch, held: str, wait_s: float, read_threads: int = 3,
                  ) -> tuple[list[_HeldFiles], threading.Event, dict, dict]:
    """A checkpoint of 3 packs of 2 leaves written, and a backend of ``read_threads`` read
    threads whose reads of ``held`` wait until a leaf is placed (or ``wait_s``); read and
    return the held files, the placed event, the state and the restored tree."""
    backend = OrbaxBackend(pack_leaf_bytes=4096, pack_bytes=8192, read_threads=read_threads)
    try:
        state = {f"l{i}": jnp.full((1000,), i, jnp.float32) for i in range(6)}
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        directory = str(tmp_path / "c")
        backend.write(directory, state, asynchronous=False)
        placed = threading.Event()
        place_leaves = orbax_read.place

        def place_and_tell(arrays, shardings):
            placed.set()
            return place_leaves(arrays, shardings)

        monkeypatch.setattr(orbax_read, "place", place_and_tell)
        files_for = backend._files_for
        held_files: list[_HeldFiles] = []

        def holding(path):
            held_files.append(_HeldFiles(files_for(path), held, placed, wait_s))
            return held_files[-1]

        monkeypatch.setattr(backend, "_files_for", holding)
        return held_files, placed, state, backend.read(directory, like)
    finally:
        backend.close()


def test_packs_are_unpacked_in_the_order_their_reads_finish(tmp_path, monkeypatch):
    # The first pack queued is held until some leaf has been placed: only a reader that
    # takes packs as they finish (not in the order they were queued) places the other
    # packs' leaves meanwhile. Taken in queue order, the held read would time out.
    held, _, state, restored = _read_holding(tmp_path, monkeypatch, "/pack_float32_000/",
                                             wait_s=10)
    assert [files.released for files in held] == [[True]]
    for path, value in state.items():
        np.testing.assert_array_equal(np.asarray(restored[path]), np.asarray(value))


def test_the_per_leaf_work_that_needs_no_data_runs_while_the_packs_are_read(
        tmp_path, monkeypatch):
    # Unpacker.prepare (each packed leaf's pack and placement) needs nothing read: it
    # runs once the reads are queued, not before them.
    seen: list[bool] = []
    prepare = orbax_read.Unpacker.prepare
    files: list[_HeldFiles] = []

    def prepare_after_a_read_started(self):
        if not seen:
            seen.append(files[-1].started.wait(10))
        prepare(self)

    monkeypatch.setattr(orbax_read.Unpacker, "prepare", prepare_after_a_read_started)
    real = _HeldFiles.__init__

    def remember(self, *args, **kwargs):
        real(self, *args, **kwargs)
        files.append(self)

    monkeypatch.setattr(_HeldFiles, "__init__", remember)
    _, _, state, restored = _read_holding(tmp_path, monkeypatch, "nothing held", wait_s=0)
    assert seen == [True]
    for path, value in state.items():
        np.testing.assert_array_equal(np.asarray(restored[path]), np.asarray(value))


def test_small_leaves_of_a_few_tens_of_mib_fill_several_packs_by_default():
    # More packs than one per read thread's worth: the packs are read in parallel, and
    # the first ones are unpacked while the last are still read.
    state = {f"l{i}": np.zeros((2500,), np.float32) for i in range(3200)}  # 32 MB
    plan = build_plan(state, leaf_limit=DEFAULT_PACK_LEAF_BYTES,
                      pack_limit=DEFAULT_PACK_BYTES, local=True)
    assert len(plan.packs) >= 4, sorted(plan.packs)


def test_a_sync_save_fills_its_packs_on_the_io_threads_that_write_them(tmp_path, monkeypatch):
    # Host views of thousands of small jax.Arrays and the copy into the packs are most of a
    # save's cost per leaf: on the writer's I/O threads, filling one pack overlaps writing
    # the others, and the caller's thread takes no view of a packed leaf.
    backend = OrbaxBackend(pack_leaf_bytes=4096, pack_bytes=8192)
    fill_threads: list[str] = []
    viewed_by_caller: list[int] = []
    fill_pack, host_arrays = orbax_write.fill_pack, orbax_write.host_arrays

    def fill_and_tell(buffer, pack, sources):
        fill_threads.append(threading.current_thread().name)
        fill_pack(buffer, pack, sources)

    def view_and_tell(arrays):
        viewed_by_caller.append(len(arrays))
        return host_arrays(arrays)

    monkeypatch.setattr(orbax_write, "fill_pack", fill_and_tell)
    monkeypatch.setattr(orbax_write, "host_arrays", view_and_tell)
    try:
        state = {f"l{i}": jnp.full((900 + i,), i, jnp.float32) for i in range(6)}
        state["big"] = jnp.arange(5000, dtype=jnp.float32)  # over pack_leaf_bytes: its own
        backend.write(str(tmp_path / "c"), state, asynchronous=False)
        assert len(fill_threads) == 3, fill_threads
        assert all(name.startswith("jaxckpt-io") for name in fill_threads), fill_threads
        assert viewed_by_caller == [1]  # the unpacked leaf only
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        restored = backend.read(str(tmp_path / "c"), like)
        for path, value in state.items():
            np.testing.assert_array_equal(np.asarray(restored[path]), np.asarray(value))
    finally:
        backend.close()


def test_a_failure_to_place_a_packs_leaves_is_not_taken_for_a_damaged_checkpoint(
        backend, tmp_path, monkeypatch):
    # Packs are unpacked inside the read, where failures mean a damaged checkpoint (which
    # recovery would set aside): a device refusing the leaves must surface as it is.
    state = {f"l{i}": jnp.full((5,), i, jnp.float32) for i in range(4)}
    directory = str(tmp_path / "c")
    backend.write(directory, state, asynchronous=False)

    def out_of_memory(arrays, shardings):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of device memory")

    monkeypatch.setattr(orbax_read, "place", out_of_memory)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED") as raised:
        backend.read(directory, like)
    assert not isinstance(raised.value, CheckpointCorruptError)


def test_the_default_sharding_is_where_device_put_puts_an_array():
    from jaxckpt.backends.orbax.place import default_sharding

    assert default_sharding() == jax.device_put(np.zeros((), np.int8)).sharding
    with jax.default_device(jax.devices()[-1]):
        assert default_sharding() == jax.device_put(np.zeros((), np.int8)).sharding


@pytest.mark.parametrize("asynchronous", [False, True])
def test_bfloat16_leaves_come_to_the_host_without_numpys_detour(tmp_path, monkeypatch,
                                                                asynchronous):
    # np.asarray of a bfloat16 jax.Array finds no buffer format and falls back to
    # jax.Array.__array__, which returns np.asarray(array._value): the same array at a
    # higher cost (1.2 to 2.5 times). The writer asks for it directly.
    state = {f"l{i}": jnp.full((100 + i,), i, jnp.bfloat16) + 0 for i in range(40)}
    state["big"] = jnp.ones((300_000,), jnp.bfloat16) + 0  # a leaf of its own, not packed
    calls = []
    array_type = type(state["big"])
    to_numpy = array_type.__array__

    def counted(self, *args, **kwargs):
        calls.append(self.shape)
        return to_numpy(self, *args, **kwargs)

    monkeypatch.setattr(array_type, "__array__", counted)
    backend = OrbaxBackend(pack_leaf_bytes=4096)
    try:
        backend.write(str(tmp_path / "c"), state, asynchronous=asynchronous).wait()
        monkeypatch.setattr(array_type, "__array__", to_numpy)
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        restored = backend.read(str(tmp_path / "c"), like)
    finally:
        backend.close()
    assert calls == []
    for path, value in state.items():
        np.testing.assert_array_equal(np.asarray(restored[path]), np.asarray(value))


@pytest.mark.parametrize("tree", [
    {"b": [1.0, (np.zeros(2), None)], "a": {"x y": 2, "'q'": [], "z": {}}, "c": None},
    [{"w": 1}, ({"v": 2},)],
    np.zeros(3),
    {"nt": orbax_match.Target("jax", (), np.float32)},  # a named tuple: jax's walk
    {1: 2.0, 3: 4.0},  # keys that are not strings: jax's walk
])
def test_tree_paths_of_plain_trees_are_jaxs(tree):
    with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    leaves = jax.tree_util.tree_leaves(tree)
    found = orbax_match.plain_paths(tree, leaves)
    if found is not None:
        assert found == [jax.tree_util.keystr(path) for path, _ in with_paths]
    plain = not isinstance(tree, dict) or all(type(k) is str for k in tree) and "nt" not in tree
    assert (found is not None) == plain


def test_a_plain_like_is_matched_without_jaxs_key_paths(backend, tmp_path, monkeypatch):
    # jax's walk with key paths makes an object per key and a string per path (about 2 us
    # a leaf); a like of plain dicts, lists and tuples has its paths made directly.
    state = {"layer": [{"w": jnp.ones((3,)), "b": jnp.zeros((2,))} for _ in range(3)],
             "step": 4}
    backend.write(str(tmp_path / "c"), state, asynchronous=False)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                        if isinstance(x, jax.Array) else x, state)
    calls = []
    with_paths = jax.tree_util.tree_flatten_with_path
    monkeypatch.setattr(jax.tree_util, "tree_flatten_with_path",
                        lambda *args, **kwargs: calls.append(1) or with_paths(*args, **kwargs))
    restored = backend.read(str(tmp_path / "c"), like)
    assert calls == []
    assert restored["step"] == 4
    np.testing.assert_array_equal(np.asarray(restored["layer"][2]["w"]), np.ones(3))


class _Pair(NamedTuple):
    first: Any
    second: Any


def _calls(run) -> int:
    """Python and C calls made by ``run()``."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return count


def test_the_first_save_plans_small_leaves_with_few_calls_per_leaf():
    # A first save builds its plan from scratch (tree paths, classification, packs,
    # tree.json): with thousands of leaves it was half of what a fresh process's first
    # save paid per leaf (benchmarks/results/first-save-leaves_cpu2core_2026-11-28.md).
    counts = []
    for leaves in (300, 600):
        state = {"layers": [{"w": jnp.full((7 + i % 5,), i, jnp.float32)} for i in range(leaves)]}
        flat = jax.tree_util.tree_leaves(state)
        counts.append(_calls(functools.partial(
            build_plan, state, leaf_limit=DEFAULT_PACK_LEAF_BYTES,
            pack_limit=DEFAULT_PACK_BYTES, local=True, leaves=flat)))
    per_leaf = (counts[1] - counts[0]) / 300
    # jax's key paths, classify_leaf, a SavedLeaf and a generator per shape per leaf made
    # about 37 calls a leaf; paths of plain trees made directly (``tree.plain_paths``) and
    # the usual jax.Array leaf spelled out, about 23.
    assert per_leaf < 28, per_leaf


@pytest.mark.parametrize("state", [
    {"b": [jnp.ones(3), (np.zeros(2), None, 3)], "a": {"x y": jnp.zeros((2, 2), jnp.bfloat16),
                                                      "'q'": [], "z": {}, "k": jax.random.key(1)}},
    {"nt": _Pair(jnp.ones(2), 3.0)},  # a named tuple: jax's walk
])
def test_a_plain_state_is_planned_without_jaxs_key_paths(state, monkeypatch):
    from jaxckpt.backends.orbax import plan as orbax_plan

    leaves = jax.tree_util.tree_leaves(state)
    with monkeypatch.context() as patched:  # jax's walk for every tree
        patched.setattr(orbax_plan, "plain_paths", lambda tree, leaves: None)
        jaxs = build_plan(state, leaf_limit=1 << 10, pack_limit=1 << 20, local=True)
    calls = []
    with_paths = jax.tree_util.tree_flatten_with_path
    monkeypatch.setattr(jax.tree_util, "tree_flatten_with_path",
                        lambda *args, **kwargs: calls.append(1) or with_paths(*args, **kwargs))
    plain = build_plan(state, leaf_limit=1 << 10, pack_limit=1 << 20, local=True,
                       leaves=leaves)
    assert len(calls) == (0 if "nt" not in state else 1)
    assert plain.tree_json == jaxs.tree_json


def test_the_gc_comes_back_after_a_reads_own_objects_are_gone(backend, tmp_path):
    # A read pauses the GC; its per-leaf objects (tree.json's entries, like's targets)
    # were still alive when it came back, and its first collection walked them all.
    from jaxckpt.backends.orbax.tree import SavedLeaf

    state = {f"l{i}": jnp.full((3,), i, jnp.float32) for i in range(2000)}
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    backend.write(str(tmp_path / "c"), state, asynchronous=False)
    walked: list[int] = []

    def count(phase, info):
        if phase == "start" and info["generation"] < 2:
            walked.append(sum(type(found) is SavedLeaf
                              for found in gc.get_objects(info["generation"])))

    gc.collect()
    gc.callbacks.append(count)
    try:
        restored = backend.read(str(tmp_path / "c"), like)
        del restored
        gc.collect(0)  # the first collection after the read, if none came yet
    finally:
        gc.callbacks.remove(count)
    assert walked and max(walked) == 0, walked
