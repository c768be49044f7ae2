"""Integrity: damaged files in the newest checkpoint are found by ``jaxckpt verify`` and skipped
by recovery, which falls back to the previous valid checkpoint and says what it skipped and why.

Every case builds a root with two committed checkpoints (steps 0 and 1, different values),
damages step 1 (one file, several files, or its COMMITTED manifest), then checks:
- ``jaxckpt verify STEP_DIR`` exits 1 and names each damaged file;
- ``recover`` restores step 0 bit for bit, with a ``CheckpointWarning`` naming step 1's
  directory, the file and the reason; the damaged checkpoint is kept in ``superseded/``.

The last section covers large array data files, whose checksums are checked alongside the
backend's read rather than before it: the values read are dropped and the same fallback (or
error, for an explicit step) follows, while metadata is still checked before any read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt import (
    CheckpointCorruptError,
    CheckpointManager,
    CheckpointWarning,
    Every,
    RecoverConfig,
    StepInfo,
    Versioned,
)
from jaxckpt.backends.orbax.backend import OrbaxBackend
from jaxckpt.core.layout import COMMIT_MARKER
from jaxckpt.core.manifest import DEFER_CHECKSUMS_OVER
from jaxckpt.tools.cli import main as cli

from support.loaders import Loader


def state(value: float) -> dict:
    return {"w": jnp.full((64, 64), value, jnp.float32),
            "opt": {"mu": jnp.arange(32, dtype=jnp.float32) * value, "count": jnp.int32(value)},
            "key": jax.random.key(int(value))}


LIKE = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state(0.0))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    loader = Loader()
    with CheckpointManager(tmp_path, recover=RecoverConfig(keep_last_n=None), mode="sync",
                           preemption_signals=()) as mgr:
        for step in (0, 1):
            loader.position = 10 + step
            mgr.save(StepInfo(0, step, step), state(float(step + 1)), stateful={"loader": loader})
    return tmp_path


def step_dir(root: Path, step: int) -> Path:
    return root / "recover" / f"step_{step:08d}"


def leaf_name(ckpt: Path, tree_path: str) -> str:
    tree = json.loads((ckpt / "state" / "tree.json").read_text())
    return next(e["name"] for e in tree["leaves"] if e["path"] == tree_path)


def target_file(ckpt: Path, target: str) -> str:
    """The relative path (manifest spelling) of one file of each kind."""
    if target == "array-data":
        chunks = ckpt / "state" / "arrays" / leaf_name(ckpt, "['w']") / "c"
        found = [p for p in chunks.rglob("*") if p.is_file()]
        assert len(found) == 1, found
        return found[0].relative_to(ckpt).as_posix()
    w_leaf = leaf_name(ckpt, "['w']")
    return {
        "array-metadata": f"state/arrays/{w_leaf}/zarr.json",
        "orbax-metadata": "state/arrays/_METADATA",
        "driver.json": "driver.json",
        "tree.json": "state/tree.json",
    }[target]


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "bitflip":
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(flipped))
    elif how == "delete":
        path.unlink()
    elif how == "garbage":
        path.write_bytes(data + b"\x00GARBAGE\xff")
    else:
        raise AssertionError(how)


REASON = {"truncate": "size", "bitflip": "crc32", "delete": "missing", "garbage": "size"}


def verify_output(path: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli(["verify", str(path)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def recover_with_warnings(root: Path):
    loader = Loader()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(root, preemption_signals=()) as mgr:
            recovered = mgr.recover(LIKE, stateful={"loader": loader})
    messages = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    return recovered, loader, messages


def assert_fell_back_to_step_0(root: Path, recovered, loader, messages, *must_name: str) -> None:
    assert recovered is not None and recovered.step_info.global_step == 0
    assert recovered.path == str(step_dir(root, 0))
    expected = state(1.0)
    for path, leaf in jax.tree_util.tree_flatten_with_path(recovered.state)[0]:
        want = jax.tree_util.tree_flatten_with_path(expected)[0]
        want = dict((jax.tree_util.keystr(p), v) for p, v in want)[jax.tree_util.keystr(path)]
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf, want = jax.random.key_data(leaf), jax.random.key_data(want)
        assert np.asarray(leaf).tobytes() == np.asarray(want).tobytes(), path
    assert loader.position == 10
    skipped = [m for m in messages if str(step_dir(root, 1)) in m]
    assert skipped, f"no CheckpointWarning names the skipped checkpoint: {messages}"
    for word in must_name:
        assert any(word in m for m in skipped), f"{word!r} not in warning {skipped}"
    # Kept for inspection, never deleted silently; out of the way of the redone step.
    superseded = list((root / "recover" / "superseded").iterdir())
    assert [p.name.split(".")[0] for p in superseded] == ["step_00000001"]
    assert not step_dir(root, 1).exists()


# --------------------------------------------------------------------- damaged files


@pytest.mark.parametrize("how", ["truncate", "bitflip", "delete", "garbage"])
@pytest.mark.parametrize("target", ["array-data", "array-metadata", "orbax-metadata",
                                    "driver.json", "tree.json"])
def test_damaged_file_is_named_by_verify_and_recovery_falls_back(root, capsys, target, how):
    ckpt = step_dir(root, 1)
    rel = target_file(ckpt, target)
    damage(ckpt / rel, how)

    code, out = verify_output(ckpt, capsys)
    assert code == 1, out
    assert f"CORRUPT {ckpt}" in out and rel in out and REASON[how] in out, out
    code, out = verify_output(step_dir(root, 0), capsys)
    assert code == 0 and "OK" in out, out

    recovered, loader, messages = recover_with_warnings(root)
    assert_fell_back_to_step_0(root, recovered, loader, messages, rel, REASON[how])


def test_verify_names_every_damaged_file_at_once(root, capsys):
    ckpt = step_dir(root, 1)
    damaged = {target_file(ckpt, "array-data"): "bitflip", "driver.json": "truncate",
               "state/tree.json": "delete", "state/arrays/_METADATA": "garbage"}
    for rel, how in damaged.items():
        damage(ckpt / rel, how)
    code, out = verify_output(ckpt, capsys)
    assert code == 1
    for rel, how in damaged.items():
        assert any(rel in line and REASON[how] in line for line in out.splitlines()), (rel, out)


def test_verify_of_a_root_flags_only_the_damaged_checkpoint(root, capsys):
    damage(step_dir(root, 1) / "driver.json", "bitflip")
    code, out = verify_output(root, capsys)
    assert code == 1
    assert f"OK      {step_dir(root, 0)}" in out and f"CORRUPT {step_dir(root, 1)}" in out, out


def test_training_resumes_and_saves_the_redone_step_after_a_fallback(root):
    damage(step_dir(root, 1) / "state" / "tree.json", "bitflip")
    recovered, _, _ = recover_with_warnings(root)
    assert recovered.step_info.global_step == 0
    with CheckpointManager(root, mode="sync", recover=RecoverConfig(keep_last_n=None),
                           preemption_signals=()) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            mgr.recover(LIKE)
        mgr.maybe_save(StepInfo(0, 1, 1), state(5.0))  # step 1 trained again (no trigger)
        mgr.save(StepInfo(0, 1, 1), state(5.0))
        again = mgr.restore(LIKE)
    assert again.step_info.global_step == 1
    assert float(again.state["w"][0, 0]) == 5.0


def _tree_listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".lock")


def test_every_checkpoint_damaged_fails_closed_naming_each_and_touching_nothing(root):
    damage(step_dir(root, 1) / "driver.json", "truncate")
    damage(step_dir(root, 0) / "state" / "tree.json", "bitflip")
    before = _tree_listing(root)
    for call in ("recover", "restore"):
        with pytest.raises(CheckpointCorruptError, match="none verifies") as info:
            with CheckpointManager(root, preemption_signals=()) as mgr:
                getattr(mgr, call)(LIKE)
        text = str(info.value)
        assert "step_00000000" in text and "step_00000001" in text
        assert "driver.json" in text and "state/tree.json" in text
        assert 'on_corrupt="start_fresh"' in text
        assert _tree_listing(root) == before  # the evidence stays where it was


def test_starting_fresh_over_a_corrupt_root_is_an_explicit_opt_in(root):
    damage(step_dir(root, 1) / "driver.json", "truncate")
    damage(step_dir(root, 0) / "state" / "tree.json", "bitflip")
    config = RecoverConfig(every=Every(steps=1), keep_last_n=1, on_corrupt="start_fresh")
    with pytest.warns(CheckpointWarning, match="no valid checkpoint to resume from") as caught:
        with CheckpointManager(root, mode="sync", recover=config, preemption_signals=()) as mgr:
            assert mgr.recover(LIKE) is None
            # The damaged ones were set aside: retention, which counts commit markers, must
            # not keep them over the new run's checkpoint (and delete the new one instead).
            mgr.maybe_save(StepInfo(0, 0, 0), state(7.0))
            assert mgr.committed_steps() == [0]
    text = " ".join(str(w.message) for w in caught)
    assert "step_00000000" in text and "step_00000001" in text
    kept = os.listdir(root / "recover" / "superseded")
    assert sorted(name.split(".")[0] for name in kept) == ["step_00000000", "step_00000001"]
    with CheckpointManager(root, preemption_signals=()) as mgr:
        assert float(mgr.recover(LIKE).state["w"][0, 0]) == 7.0


def test_a_root_with_only_an_interrupted_save_starts_fresh_without_raising(root):
    for step in (0, 1):
        os.unlink(step_dir(root, step) / "COMMITTED")
    with CheckpointManager(root, preemption_signals=()) as mgr:
        assert mgr.recover(LIKE) is None


# ------------------------------------------------------------------ damaged manifest


def _rewrite(path: Path, **changes) -> None:
    body = json.loads(path.read_text())
    body.update(changes)
    path.write_text(json.dumps(body))


def _marker_is_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


MANIFEST_DAMAGE = {
    "invalid-json": lambda p: p.write_text('{"format": "jaxckpt.commit/1", "files": {'),
    "empty-file": lambda p: p.write_bytes(b""),
    "binary-garbage": lambda p: p.write_bytes(b"\xff\xfe\x00\x80garbage"),
    "not-an-object": lambda p: p.write_text("[1, 2, 3]"),
    "wrong-format": lambda p: _rewrite(p, format="jaxckpt.commit/99"),
    "no-file-list": lambda p: _rewrite(p, files=None),
    "malformed-entry": lambda p: _rewrite(p, files={"driver.json": {"size": "12"}}),
    "parent-path": lambda p: _rewrite(p, files={"../step_00000000/driver.json":
                                                 {"size": 1, "crc32": "00000000"}}),
    "absolute-path": lambda p: _rewrite(p, files={"/etc/hostname": {"size": 1, "crc32": "0"}}),
    "step-not-a-number": lambda p: _rewrite(p, step="one"),
    "created-not-a-number": lambda p: _rewrite(p, created=["yesterday"]),
    "marker-unreadable": _marker_is_directory,
}
MANIFEST_BUGS: dict[str, str] = {}  # damage kinds that still need a fix: none


@pytest.mark.parametrize("case", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=MANIFEST_BUGS[name]))
    if name in MANIFEST_BUGS else name for name in MANIFEST_DAMAGE])
def test_damaged_manifest_is_reported_and_recovery_falls_back(root, capsys, case):
    ckpt = step_dir(root, 1)
    MANIFEST_DAMAGE[case](ckpt / COMMIT_MARKER)
    code, out = verify_output(ckpt, capsys)
    assert code == 1 and f"CORRUPT {ckpt}" in out, out
    assert "commit marker" in out or "manifest" in out, out
    recovered, loader, messages = recover_with_warnings(root)
    assert_fell_back_to_step_0(root, recovered, loader, messages, "corrupt")


# ------------------------------------------------------------- files the manifest omits


def test_verify_names_a_file_that_is_not_in_the_manifest(root, capsys):
    ckpt = step_dir(root, 1)
    (ckpt / "state" / "arrays" / "leaf_999999").mkdir()
    (ckpt / "state" / "arrays" / "leaf_999999" / "zarr.json").write_text("{}")
    (ckpt / "extra.bin").write_bytes(b"garbage")
    code, out = verify_output(ckpt, capsys)
    assert code == 1, out
    assert "extra.bin" in out and "state/arrays/leaf_999999/zarr.json" in out, out


def test_manifest_that_lists_no_files_is_not_trusted(root):
    ckpt = step_dir(root, 1)
    _rewrite(ckpt / COMMIT_MARKER, files={})
    damage(ckpt / target_file(ckpt, "array-data"), "bitflip")
    recovered, loader, messages = recover_with_warnings(root)
    assert_fell_back_to_step_0(root, recovered, loader, messages, "corrupt")


def test_the_installed_jaxckpt_command_reports_the_damage(root):
    ckpt = step_dir(root, 1)
    rel = target_file(ckpt, "array-data")
    damage(ckpt / rel, "bitflip")
    damage(ckpt / "driver.json", "delete")
    command = Path(sys.executable).with_name("jaxckpt")
    argv = [str(command)] if command.exists() else [sys.executable, "-m", "jaxckpt.tools.cli"]
    done = subprocess.run([*argv, "verify", str(ckpt)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{rel}: crc32" in done.stdout and "driver.json: missing" in done.stdout, done.stdout


def test_restoring_a_damaged_step_by_number_names_the_file_and_the_fix(root):
    damage(step_dir(root, 1) / "state" / "tree.json", "garbage")
    with pytest.raises(CheckpointCorruptError) as info:
        with CheckpointManager(root, preemption_signals=()) as mgr:
            mgr.restore(LIKE, step=1)
    message = str(info.value)
    assert str(step_dir(root, 1)) in message and "state/tree.json: size" in message, message
    assert "step=None picks the latest valid one" in message
    assert step_dir(root, 1).exists(), "an explicit restore must not move the checkpoint away"


# ------------------------------------------------- bulk checksums checked alongside the read
#
# With verify="checksums", the crc32 of large array data files is checked while the backend
# reads them (manifest.DEFER_CHECKSUMS_OVER); everything else is checked before. A counting
# subclass of the real Orbax backend shows which directories were read, i.e. whether a
# damaged file was caught before the read or alongside it.

BIG_SHAPE = (1024, 512)  # 2 MiB of float32: an unpacked leaf over the threshold
BIG_PATH = "['big']"


def big_state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"big": jnp.asarray(rng.standard_normal(BIG_SHAPE, dtype=np.float32)),
            "w": jnp.full((64, 64), float(step + 1), jnp.float32),
            "key": jax.random.key(step)}


BIG_LIKE = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), big_state(0))


class ReadCounting(OrbaxBackend):
    """The real Orbax backend, recording the directory of every read."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def read(self, directory, like, **options):
        self.reads.append(directory)
        return super().read(directory, like, **options)


class RecordingLoader(Loader):
    """A loader that remembers every state it was given."""

    def __init__(self):
        super().__init__()
        self.loaded: list[dict] = []

    def load_state_dict(self, saved):
        self.loaded.append(dict(saved))
        super().load_state_dict(saved)


@pytest.fixture
def big_root(tmp_path: Path) -> Path:
    loader = Loader()
    with CheckpointManager(tmp_path, recover=RecoverConfig(keep_last_n=None), mode="sync",
                           preemption_signals=()) as mgr:
        for step in (0, 1):
            loader.position = 10 + step
            mgr.save(StepInfo(0, step, step), big_state(step), stateful={"loader": loader})
    return tmp_path


def big_data_file(ckpt: Path) -> str:
    """The manifest path of the big leaf's data file (one chunk), checked to be deferred."""
    chunks = ckpt / "state" / "arrays" / leaf_name(ckpt, BIG_PATH) / "c"
    (found,) = [p for p in chunks.rglob("*") if p.is_file()]
    assert found.stat().st_size > DEFER_CHECKSUMS_OVER
    return found.relative_to(ckpt).as_posix()


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def edit_same_size(path: Path, old: str, new: str) -> None:
    """A damage that keeps the size and still parses: only a checksum can tell."""
    assert len(old) == len(new)
    text = path.read_text()
    assert text.count(old) == 1, (old, text)
    path.write_text(text.replace(old, new))


def assert_exactly(restored: dict, expected: dict) -> None:
    for name in ("big", "w"):
        assert np.asarray(restored[name]).tobytes() == np.asarray(expected[name]).tobytes(), name
    assert (np.asarray(jax.random.key_data(restored["key"])).tobytes()
            == np.asarray(jax.random.key_data(expected["key"])).tobytes())


def restore_counting(root: Path, backend: ReadCounting | None = None, **kwargs):
    """recover() (or restore(step=...) with ``step``) through a read-counting backend:
    (result, backend reads, loader, CheckpointWarning messages)."""
    backend, loader = backend or ReadCounting(), RecordingLoader()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with CheckpointManager(root, backend=backend, preemption_signals=()) as mgr:
                if "step" in kwargs:
                    result = mgr.restore(BIG_LIKE, stateful={"loader": loader}, **kwargs)
                else:
                    result = mgr.recover(BIG_LIKE, stateful={"loader": loader}, **kwargs)
    finally:
        backend.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    return result, backend.reads, loader, messages


def state_dir(root: Path, step: int) -> str:
    return str(step_dir(root, step) / "state")


def test_intact_checkpoint_restores_bit_exactly_reading_it_once(big_root):
    recovered, reads, loader, messages = restore_counting(big_root)
    assert recovered.step_info.global_step == 1 and not messages, messages
    assert_exactly(recovered.state, big_state(1))
    assert reads == [state_dir(big_root, 1)]
    assert loader.loaded == [{"position": 11}]


@pytest.mark.parametrize("where", ["middle", "chunk-index"])
def test_damaged_bulk_data_found_alongside_the_read_makes_recovery_fall_back(big_root, where):
    # middle: the read succeeds with one wrong number; chunk-index: tensorstore's own crc32c
    # of the shard index fails, so the read raises too, and the checksum verdict must win.
    ckpt = step_dir(big_root, 1)
    rel = big_data_file(ckpt)
    size = (ckpt / rel).stat().st_size
    flip_byte(ckpt / rel, size // 2 if where == "middle" else size - 8)

    recovered, reads, loader, messages = restore_counting(big_root)

    assert recovered.step_info.global_step == 0 and recovered.path == str(step_dir(big_root, 0))
    assert_exactly(recovered.state, big_state(0))
    # The damaged checkpoint was read (its checksum ran alongside) and then thrown away; its
    # loader state was never applied, only step 0's.
    assert reads == [state_dir(big_root, 1), state_dir(big_root, 0)]
    assert loader.loaded == [{"position": 10}] and loader.position == 10
    skipped = [m for m in messages if str(ckpt) in m]
    assert any(f"{rel}: crc32" in m for m in skipped), messages
    superseded = list((big_root / "recover" / "superseded").iterdir())
    assert [p.name.split(".")[0] for p in superseded] == ["step_00000001"]
    assert not ckpt.exists()


@pytest.mark.parametrize("where", ["middle", "chunk-index"])
def test_damaged_bulk_data_of_a_requested_step_raises_and_touches_nothing(big_root, where):
    ckpt = step_dir(big_root, 1)
    rel = big_data_file(ckpt)
    size = (ckpt / rel).stat().st_size
    flip_byte(ckpt / rel, size // 2 if where == "middle" else size - 8)
    backend, loader = ReadCounting(), RecordingLoader()
    loader.position = 99
    try:
        with CheckpointManager(big_root, backend=backend, preemption_signals=()) as mgr:
            with pytest.raises(CheckpointCorruptError) as info:
                mgr.restore(BIG_LIKE, step=1, stateful={"loader": loader})
    finally:
        backend.close()
    message = str(info.value)
    assert str(ckpt) in message and f"{rel}: crc32" in message, message
    assert "step=None picks the latest valid one" in message
    assert backend.reads == [state_dir(big_root, 1)]
    assert loader.loaded == [] and loader.position == 99
    assert ckpt.exists(), "an explicit restore must not move the checkpoint away"


SMALL_DAMAGE = {
    "tree.json-bitflip": ("tree.json", None),
    "tree.json-parses": ("tree.json", ("[1024, 512]", "[1024, 513]")),
    "zarr.json-bitflip": ("array-metadata", None),
    "zarr.json-parses": ("array-metadata", ('"shape":[1024,512]', '"shape":[1024,513]')),
    "_METADATA-bitflip": ("orbax-metadata", None),
}


def _damage_small(ckpt: Path, case: str) -> str:
    target, edit = SMALL_DAMAGE[case]
    if target == "array-metadata":
        rel = f"state/arrays/{leaf_name(ckpt, BIG_PATH)}/zarr.json"
    else:
        rel = target_file(ckpt, target)
    if edit is None:
        damage(ckpt / rel, "bitflip")
    else:
        edit_same_size(ckpt / rel, *edit)
    return rel


@pytest.mark.parametrize("case", list(SMALL_DAMAGE))
def test_damaged_metadata_is_caught_before_anything_is_read(big_root, case):
    ckpt = step_dir(big_root, 1)
    rel = _damage_small(ckpt, case)

    backend = ReadCounting()
    with pytest.raises(CheckpointCorruptError, match=f"{rel}: crc32"):
        restore_counting(big_root, backend, step=1)
    assert backend.reads == [], "the damaged checkpoint must never be read"
    recovered, reads, loader, messages = restore_counting(big_root)

    assert reads == [state_dir(big_root, 0)], "the damaged checkpoint must never be read"
    assert recovered.step_info.global_step == 0 and loader.loaded == [{"position": 10}]
    assert_exactly(recovered.state, big_state(0))
    assert any(str(ckpt) in m and f"{rel}: crc32" in m for m in messages), messages


def _items_root(root: Path) -> Path:
    """Checkpoints 0 and 1, each referring to its own version of a big item."""
    loader = Loader()
    with CheckpointManager(root, recover=RecoverConfig(keep_last_n=None), mode="sync",
                           preemption_signals=()) as mgr:
        for step in (0, 1):
            loader.position = 10 + step
            mgr.save(StepInfo(0, step, step), big_state(step), stateful={"loader": loader},
                     items={"ref": Versioned(step, {"big": big_state(10 + step)["big"]})})
    return root


ITEM_LIKE = {"big": BIG_LIKE["big"]}


@pytest.mark.parametrize("requested", [True, False])
def test_damaged_bulk_data_of_an_item_makes_its_checkpoint_fall_back(tmp_path, requested):
    root = _items_root(tmp_path)
    item = root / "recover" / "items" / "ref" / "v000001"
    rel = big_data_file(item)
    flip_byte(item / rel, (item / rel).stat().st_size // 2)
    items = {"ref": ITEM_LIKE} if requested else None

    recovered, reads, loader, messages = restore_counting(root, items=items)

    assert recovered.step_info.global_step == 0 and recovered.item_versions == {"ref": 0}
    assert_exactly(recovered.state, big_state(0))
    assert loader.loaded == [{"position": 10}]
    assert any(str(step_dir(root, 1)) in m and "item 'ref' v1" in m and f"{rel}: crc32" in m
               for m in messages), messages
    if requested:
        # Read alongside its checksum with the checkpoint that refers to it, then dropped.
        v0, v1 = (str(root / "recover" / "items" / "ref" / f"v00000{v}" / "state") for v in (0, 1))
        assert reads == [state_dir(root, 1), v1, state_dir(root, 0), v0]
        assert (np.asarray(recovered.items["ref"]["big"]).tobytes()
                == np.asarray(big_state(10)["big"]).tobytes())
    else:
        # Not restored, so not read: it is checked in full before anything is read.
        assert reads == [state_dir(root, 0)]
        assert recovered.items == {}


def test_damaged_bulk_data_of_an_item_of_a_requested_step_raises(tmp_path):
    root = _items_root(tmp_path)
    item = root / "recover" / "items" / "ref" / "v000001"
    rel = big_data_file(item)
    flip_byte(item / rel, (item / rel).stat().st_size // 2)
    with pytest.raises(CheckpointCorruptError) as info:
        restore_counting(root, step=1, items={"ref": ITEM_LIKE})
    message = str(info.value)
    assert "refers to unusable items" in message and "item 'ref' v1" in message, message
    assert f"{rel}: crc32" in message, message
