"""OrbaxBackend's incremental writes against real files: what it refers to, what it writes,
and reading a checkpoint back through its references (issue 32; the manager's side is
tests/integration/test_incremental.py, which also runs two processes)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt.backends.base import IncrementalBase
from jaxckpt.backends.orbax.backend import OrbaxBackend
from jaxckpt.backends.orbax.files import WRITTEN
from jaxckpt.core.content_hash import HASH_NAME, is_hash
from jaxckpt.core.layout import STATE_DIR, ref_key, step_dirname

FROZEN = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB


@pytest.fixture(scope="module")
def backend():
    orbax_backend = OrbaxBackend()
    yield orbax_backend
    orbax_backend.close()


def state(step, frozen=None):
    return {"frozen": {"table": jnp.asarray(FROZEN if frozen is None else frozen)},
            "params": {"w": jnp.full((64, 64), float(step), jnp.float32),
                       "b": jnp.full((64,), float(step), jnp.float32)},
            "step": step}


class Checkpoints:
    """Writes state directories the way the manager lays them out (recover/step_N/state)
    and builds each write's base from the previous write's handle."""

    def __init__(self, backend, root):
        self.backend = backend
        self.recover = os.path.join(root, "recover")
        os.makedirs(self.recover)
        self.files: dict[int, dict] = {}  # step -> {key: entry} of what it uses

    def directory(self, step):
        return os.path.join(self.recover, step_dirname(step), STATE_DIR)

    def base(self, step):
        if step is None:
            return IncrementalBase(step=-1, directory="", recover_dir=self.recover, files={})
        return IncrementalBase(step=step, directory=self.directory(step),
                               recover_dir=self.recover, files=self.files[step])

    def write(self, step, tree, *, base_step=None, asynchronous=False):
        before = WRITTEN.total()
        handle = self.backend.write(self.directory(step), tree, asynchronous=asynchronous,
                                    base=self.base(base_step))
        handle.wait()
        own = {ref_key(step, f"{STATE_DIR}/{rel}"): entry
               for rel, entry in handle.checksums.items()}
        self.files[step] = {**own, **handle.references}
        return handle, WRITTEN.total() - before


def assert_same(actual, expected):
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_unchanged_chunk_files_are_referred_to_and_read_back(backend, tmp_path, asynchronous):
    ckpts = Checkpoints(backend, str(tmp_path))
    first, _ = ckpts.write(0, state(0), asynchronous=asynchronous)
    # The first save refers to nothing but records every data file's content hash.
    assert first.references == {}
    data = {rel: entry for rel, entry in first.checksums.items() if "/c/" in rel}
    assert data and all(is_hash(entry[HASH_NAME]) for entry in data.values())

    second, written = ckpts.write(1, state(1), base_step=0, asynchronous=asynchronous)
    table = [key for key in second.references if "leaf_" in key]
    assert len(table) == 1 and table[0].startswith(f"{step_dirname(0)}/{STATE_DIR}/arrays/")
    assert written < FROZEN.nbytes // 4  # the table was not written again
    assert not os.path.exists(os.path.join(ckpts.recover, step_dirname(1), table[0].split(
        "/", 1)[1]))
    # A third save refers to the file's owner, step 0, not to step 1.
    third, _ = ckpts.write(2, state(2), base_step=1, asynchronous=asynchronous)
    assert set(third.references) == set(table)

    restored = backend.read(ckpts.directory(2), state(0), references=third.references)
    assert_same(restored, state(2))
    partial = backend.read(ckpts.directory(2), {"frozen": state(0)["frozen"]}, partial=True,
                           references=third.references)
    assert_same(partial, {"frozen": {"table": FROZEN}})


def test_changed_bytes_layout_or_a_missing_hash_are_written_again(backend, tmp_path):
    ckpts = Checkpoints(backend, str(tmp_path))
    ckpts.write(0, state(0))
    changed = FROZEN.copy()
    changed[-1, -1] += 1
    handle, written = ckpts.write(1, state(1, changed), base_step=0)
    assert handle.references == {} and written > FROZEN.nbytes

    # The same bytes under another tree path (tree.json differs for that storage name).
    renamed = state(2, changed)
    renamed["frozen"] = {"other": renamed["frozen"].pop("table")}
    handle, _ = ckpts.write(2, renamed, base_step=1)
    assert handle.references == {}

    # A base entry without a content hash (written without incremental) is not trusted.
    ckpts.files[2] = {key: {k: v for k, v in entry.items() if k != HASH_NAME}
                      for key, entry in ckpts.files[2].items()}
    handle, _ = ckpts.write(3, renamed, base_step=2)
    assert handle.references == {}


def test_without_a_base_nothing_is_hashed(backend, tmp_path):
    handle = backend.write(str(tmp_path / "plain"), state(0), asynchronous=False)
    assert handle.references is None
    assert all(HASH_NAME not in entry for entry in handle.checksums.values())


@pytest.fixture
def hashed(monkeypatch):
    """Bytes hashed by incremental writes, per call (the real hash, counted)."""
    from jaxckpt.backends.orbax import incremental

    calls: list[int] = []
    real = incremental.content_hash

    def counting(parts):
        calls.append(sum(memoryview(part).nbytes for part in parts))
        return real(parts)

    monkeypatch.setattr(incremental, "content_hash", counting)
    return calls


def test_the_same_arrays_are_referred_to_without_reading_them(tmp_path, hashed):
    backend = OrbaxBackend()  # its own: what it knows of earlier writes is per backend
    try:
        ckpts = Checkpoints(backend, str(tmp_path))
        table = jnp.asarray(FROZEN)  # one object, kept across saves (a frozen subtree)

        def kept(step):
            return {**state(step), "frozen": {"table": table}}

        ckpts.write(0, kept(0))
        assert max(hashed) >= FROZEN.nbytes  # the first save hashes it once
        hashed.clear()
        second, written = ckpts.write(1, kept(1), base_step=0)
        assert written < FROZEN.nbytes // 4
        assert any("leaf_" in key for key in second.references)
        assert max(hashed, default=0) < FROZEN.nbytes  # referred to without hashing it
        hashed.clear()
        # A base without the file (deleted by hand, quarantined): written again, and its
        # hash, known from the object, is not computed again.
        third, written = ckpts.write(2, kept(2), base_step=None)
        assert written >= FROZEN.nbytes and not third.references
        assert max(hashed, default=0) < FROZEN.nbytes
        ours = {rel: entry for rel, entry in third.checksums.items()
                if "leaf_" in rel and "/c/" in rel}
        first = {rel: entry for rel, entry in ckpts.files[0].items()
                 if "leaf_" in rel and "/c/" in rel}
        assert [e[HASH_NAME] for e in ours.values()] == [e[HASH_NAME] for e in first.values()]
        hashed.clear()
        # The same bytes in a new array: not known by identity, so hashed, then referred to.
        fourth, written = ckpts.write(3, state(3), base_step=2)
        assert max(hashed) >= FROZEN.nbytes and written < FROZEN.nbytes // 4
        assert [key.split("/", 1)[0] for key in fourth.references if "leaf_" in key] == [
            step_dirname(2)]
        assert_same(backend.read(ckpts.directory(1), state(0),
                                 references=second.references), kept(1))
        assert_same(backend.read(ckpts.directory(3), state(0),
                                 references=fourth.references), state(3))
    finally:
        backend.close()


def test_a_file_that_changes_at_every_save_is_written_unhashed_then_probed(tmp_path):
    from jaxckpt.backends.orbax.unchanged import HOT_AFTER, PROBE_EVERY

    backend = OrbaxBackend()
    try:
        ckpts = Checkpoints(backend, str(tmp_path))

        def big(step):  # the table changes at every save until step 6, then stays
            return {"table": jnp.asarray(FROZEN + min(step, 6))}

        def table_entry(handle):
            return next(entry for rel, entry in handle.checksums.items() if "/c/" in rel)

        hashes = []
        for step in range(PROBE_EVERY + 3):
            handle, _ = ckpts.write(step, big(step), base_step=step - 1 if step else None)
            refers = bool(handle.references)
            hashes.append("referred" if refers else HASH_NAME in table_entry(handle))
        # Hashed while it might be unchanged; not once it changed HOT_AFTER times in a row;
        # hashed again at the two probing writes (the PROBE_EVERY-th and the next), the
        # second of which finds it unchanged (it stopped changing at step 6): referred to
        # from then on.
        assert hashes[:HOT_AFTER + 1] == [True] * (HOT_AFTER + 1)
        assert hashes[HOT_AFTER + 1:PROBE_EVERY] == [False] * (PROBE_EVERY - HOT_AFTER - 1)
        assert hashes[PROBE_EVERY:] == [True, "referred", "referred"]
        last = PROBE_EVERY + 2
        assert_same(backend.read(ckpts.directory(last), big(0),
                                 references=ckpts.files[last]), big(last))
    finally:
        backend.close()


def test_what_a_write_remembers_does_not_keep_the_arrays_alive(tmp_path):
    import gc
    import weakref

    backend = OrbaxBackend()
    try:
        ckpts = Checkpoints(backend, str(tmp_path))
        ckpts.write(0, state(0))
        trained = jnp.asarray(FROZEN + 1.0)
        alive = weakref.ref(trained)
        ckpts.write(1, {**state(1), "frozen": {"table": trained}}, base_step=0,
                    asynchronous=True)
        del trained
        gc.collect()
        assert alive() is None  # only weak references are kept between saves
    finally:
        backend.close()
