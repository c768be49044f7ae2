"""A root holding files jaxckpt did not write is refused with CheckpointRootError naming what
was found, and nothing at all is written into it; a missing or empty directory, or one holding
only what jaxckpt writes, is accepted. Foreign directories are made by real Orbax."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import jaxckpt
from jaxckpt.commit.ownership import foreign_entries
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.tools import cli


def listing(root: Path) -> list[tuple[str, int]]:
    """Every entry under root with its size (-1 for directories): equal before and after."""
    return sorted((str(p.relative_to(root)), -1 if p.is_dir() else p.stat().st_size)
                  for p in root.rglob("*"))


def orbax_manager_dir(path: Path) -> Path:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    tree = {"w": jnp.arange(8, dtype=jnp.float32), "n": {"b": jnp.ones(3, jnp.bfloat16)}}
    with ocp.CheckpointManager(path) as manager:
        for step in (0, 100):
            manager.save(step, args=ocp.args.StandardSave(tree))
        manager.wait_until_finished()
    return path


def orbax_single_dir(path: Path) -> Path:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, {"w": np.arange(4, dtype=np.float32)})
    return path


def random_files(path: Path) -> Path:
    (path / "logs").mkdir(parents=True)
    (path / "train.py").write_text("print('hi')\n")
    (path / "logs" / "events.bin").write_bytes(os.urandom(64))
    return path


def jaxckpt_root_with_a_stray_file(path: Path) -> Path:
    jaxckpt.CheckpointManager(path, mode="sync").close()
    (path / "notes.txt").write_text("mine")
    return path


def foreign_entry_inside_recover(path: Path) -> Path:
    (path / "recover" / "0").mkdir(parents=True)
    return path


def recover_is_a_file(path: Path) -> Path:
    path.mkdir()
    (path / "recover").write_text("")
    return path


# (make the directory, words the error must contain)
FOREIGN = [
    (orbax_manager_dir, ["0/, 100/", "Orbax", "import-orbax"]),
    (orbax_single_dir, ["_CHECKPOINT_METADATA", "_METADATA", "Orbax"]),
    (random_files, ["logs/, train.py"]),
    (jaxckpt_root_with_a_stray_file, ["notes.txt"]),
    (foreign_entry_inside_recover, ["recover/0"]),
    (recover_is_a_file, ["recover"]),
]


@pytest.mark.parametrize("make, words", FOREIGN, ids=lambda v: getattr(v, "__name__", ""))
def test_manager_refuses_a_foreign_root_and_writes_nothing(make, words, tmp_path):
    root = make(tmp_path / "root")
    before = listing(root)
    with pytest.raises(jaxckpt.CheckpointRootError) as error:
        jaxckpt.CheckpointManager(root, mode="sync")
    message = str(error.value)
    for word in words + ["never writes", "new or empty directory"]:
        assert word in message, message
    assert listing(root) == before  # no .lock, no recover/, no export/


def test_orbax_root_used_to_resume_silently_from_scratch(tmp_path):
    """The reported failure: recover() on an Orbax root returned None (a fresh start)."""
    root = orbax_manager_dir(tmp_path / "orbax")
    before = listing(root)
    with pytest.raises(jaxckpt.CheckpointRootError):
        with jaxckpt.CheckpointManager(root, mode="sync") as manager:
            manager.recover({"w": np.zeros(8, np.float32)})
    assert listing(root) == before


@pytest.mark.parametrize("command", ["ls", "verify", "info"])
def test_cli_exits_3_on_an_orbax_directory(command, tmp_path, capsys):
    root = orbax_manager_dir(tmp_path / "orbax")
    before = listing(root)
    assert cli.main([command, str(root)]) == 3
    out = capsys.readouterr().err
    assert "not a jaxckpt checkpoint or root" in out and "import-orbax" in out
    assert listing(root) == before


def test_roots_jaxckpt_writes_are_accepted(tmp_path):
    root = tmp_path / "run"
    state = {"w": np.arange(16, dtype=np.float32)}
    with jaxckpt.CheckpointManager(root, recover=jaxckpt.RecoverConfig(keep_last_n=None),
                                   mode="sync") as manager:
        for step in (0, 1):
            manager.save(jaxckpt.StepInfo(0, step, step, 10), state)
    store = CheckpointStore(root)
    store.quarantine(store.step_path(0), "corrupt")  # recover/superseded/
    os.makedirs(store.item_path("ref", 3))  # recover/items/ref/v000003
    os.makedirs(os.path.join(store.recover_dir, ".tmp-step_00000002.abc"))
    os.makedirs(os.path.join(store.export_dir, "epoch0epochstep1globalstep1"))
    os.makedirs(os.path.join(store.export_dir, ".tmp-epoch0epochstep2globalstep2.1234"))
    os.makedirs(root / "lost+found")
    assert foreign_entries(str(root)) == []
    for fine in (root, tmp_path / "missing", tmp_path / "empty"):
        if fine.name == "empty":
            fine.mkdir()
        jaxckpt.CheckpointManager(fine, mode="sync").close()


def test_foreign_entries_lists_only_what_jaxckpt_never_writes(tmp_path):
    root = random_files(tmp_path / "root")
    (root / "recover" / "step_00000001").mkdir(parents=True)
    (root / "recover" / "checkpoint_5").mkdir()
    (root / "export").mkdir()
    (root / "export" / "hf_model").mkdir()
    assert foreign_entries(str(root)) == ["export/hf_model", "logs/", "recover/checkpoint_5",
                                          "train.py"]


def test_dcp_manager_refuses_a_foreign_root_too(tmp_path):
    pytest.importorskip("torch")
    from torch_bridge import DcpCheckpointManager

    root = random_files(tmp_path / "root")
    before = listing(root)
    with pytest.raises(jaxckpt.CheckpointRootError, match="logs/, train.py"):
        DcpCheckpointManager(root, mode="sync")
    assert listing(root) == before


def test_a_start_removes_a_marker_write_killed_inside_a_committed_step(tmp_path):
    """Retention writes RETIRED into a step that is still committed; a kill before the rename
    leaves its temp file there. The next manager's start removes it and keeps the step."""
    root = tmp_path / "run"
    state = {"w": np.arange(16, dtype=np.float32)}
    with jaxckpt.CheckpointManager(root, mode="sync") as manager:
        manager.save(jaxckpt.StepInfo(0, 0, 0, 10), state)
    step = CheckpointStore(root).step_path(0)
    stray = os.path.join(step, ".tmp-RETIRED.1234abcd")
    with open(stray, "w") as handle:
        handle.write("{")
    with jaxckpt.CheckpointManager(root, mode="sync") as manager:
        assert manager.committed_steps() == [0]
    assert not os.path.exists(stray)
    assert not CheckpointStore(root).verify(step)
