"""jaxckpt.import_orbax / `jaxckpt import-orbax`: Orbax checkpoints written by real Orbax (a
CheckpointManager with StandardSave, PyTreeSave or Composite items, one step directory, one
Standard/PyTreeCheckpointer directory) become verified jaxckpt checkpoints whose restore equals
Orbax's own restore bit for bit, and the source is never changed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxckpt
from jaxckpt.tools import cli


def make_tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "params": {"dense": {"kernel": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
                             "bias": jnp.asarray(rng.standard_normal(8), jnp.bfloat16)},
                   "embed": jnp.asarray(rng.standard_normal((300, 64)), jnp.bfloat16)},
        "opt": {"count": jnp.asarray(rng.integers(0, 1000, (3,)), jnp.int32),
                "mu": [jnp.asarray(rng.standard_normal(5), jnp.float32),
                       jnp.asarray(rng.standard_normal((2, 2)), jnp.float32)]},
        "key": jax.random.key(seed),
        "step": jnp.asarray(seed, jnp.int32),
    }


def digest(tree) -> dict:
    """path -> (type, dtype, shape, sha256 of the bytes): equal digests are equal bits."""
    def one(leaf):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return ("key", str(leaf.dtype), leaf.shape,
                    hashlib.sha256(np.asarray(jax.random.key_data(leaf)).tobytes()).hexdigest())
        array = np.asarray(leaf)
        return (type(leaf).__name__ if isinstance(leaf, (int, float, bool)) else "array",
                str(array.dtype), array.shape, hashlib.sha256(array.tobytes()).hexdigest())
    return {jax.tree_util.keystr(path): one(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def file_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()} | {
        str(p.relative_to(root)) + "/": "dir" for p in root.rglob("*") if p.is_dir()}


def restore_jaxckpt(root: Path, like, step: int | None = None):
    with jaxckpt.CheckpointManager(root, mode="sync") as manager:
        return manager.restore(like, step=step).state


def orbax_manager(path: Path, saves: dict[int, object]) -> Path:
    with ocp.CheckpointManager(path) as manager:
        for step, args in saves.items():
            manager.save(step, args=args)
        manager.wait_until_finished()
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("orbax")
    made = {
        "standard": orbax_manager(base / "standard", {
            step: ocp.args.StandardSave(make_tree(step)) for step in (0, 100, 200)}),
        "pytree": orbax_manager(base / "pytree", {7: ocp.args.PyTreeSave(make_tree(7))}),
        "composite": orbax_manager(base / "composite", {3: ocp.args.Composite(
            state=ocp.args.StandardSave(make_tree(3)),
            ema=ocp.args.PyTreeSave({"w": np.arange(6, dtype=np.float32)}),
            metrics=ocp.args.JsonSave({"loss": 0.25, "seen": 12}))}),
    }
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(base / "single_standard", make_tree(11))
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(base / "single_pytree", make_tree(12))
    made["single_standard"] = base / "single_standard"
    made["single_pytree"] = base / "single_pytree"
    return made


def orbax_restore(kind: str, src: Path, step: int):
    """What a plain Orbax user gets back from src."""
    if kind in ("standard", "pytree"):
        with ocp.CheckpointManager(src) as manager:
            return manager.restore(step)
    if kind == "composite":
        with ocp.CheckpointManager(src) as manager:
            return dict(manager.restore(step))
    with (ocp.StandardCheckpointer() if kind == "single_standard"
          else ocp.PyTreeCheckpointer()) as checkpointer:
        return checkpointer.restore(src)


# (source, step argument, step expected in the jaxckpt checkpoint)
CASES = [("standard", None, 200), ("standard", 100, 100), ("pytree", None, 7),
         ("composite", None, 3), ("single_standard", None, 0), ("single_pytree", None, 0)]


@pytest.mark.parametrize("kind, step, expected_step", CASES)
def test_import_restores_what_orbax_restores_bit_for_bit(kind, step, expected_step, sources,
                                                         tmp_path):
    src = sources[kind]
    before = file_hashes(src)
    path = jaxckpt.import_orbax(src, tmp_path / "root", step=step)
    assert Path(path) == tmp_path / "root" / "recover" / f"step_{expected_step:08d}"
    assert file_hashes(src) == before  # not one byte or entry of src changed
    expected = orbax_restore(kind, src, expected_step)
    got = restore_jaxckpt(tmp_path / "root", expected)
    assert digest(got) == digest(expected)
    assert {d[1] for d in digest(got).values()} >= {"float32", "bfloat16", "int32"}
    assert cli.main(["verify", str(tmp_path / "root")]) == 0


def test_a_single_step_directory_imports_at_its_own_step(sources, tmp_path):
    src = sources["standard"] / "100"
    before = file_hashes(sources["standard"])
    path = jaxckpt.import_orbax(src, tmp_path / "root")
    assert path.endswith("step_00000100")
    assert file_hashes(sources["standard"]) == before
    expected = orbax_restore("standard", sources["standard"], 100)
    assert digest(restore_jaxckpt(tmp_path / "root", expected)) == digest(expected)


def test_a_missing_step_is_refused_listing_the_steps_there(sources, tmp_path):
    with pytest.raises(jaxckpt.ConfigError, match="no Orbax step 5; steps there: 0, 100, 200"):
        jaxckpt.import_orbax(sources["standard"], tmp_path / "root", step=5)
    assert not (tmp_path / "root").exists()


def test_a_root_holding_that_step_is_refused(sources, tmp_path):
    jaxckpt.import_orbax(sources["standard"], tmp_path / "root")
    before = file_hashes(tmp_path / "root")
    with pytest.raises(jaxckpt.CheckpointRootError, match="already holds a checkpoint at step 200"):
        jaxckpt.import_orbax(sources["standard"], tmp_path / "root", step=200)
    assert file_hashes(tmp_path / "root") == {k: v for k, v in before.items()}
    jaxckpt.import_orbax(sources["standard"], tmp_path / "root", step=0)  # another step: fine


def test_a_foreign_root_is_refused_and_left_alone(sources, tmp_path):
    other = orbax_manager(tmp_path / "other", {1: ocp.args.StandardSave(make_tree(1))})
    before = file_hashes(other)
    with pytest.raises(jaxckpt.CheckpointRootError, match="never writes: 1/"):
        jaxckpt.import_orbax(sources["standard"], other)
    assert file_hashes(other) == before


def test_what_is_not_an_orbax_checkpoint_is_refused(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("x")
    with pytest.raises(jaxckpt.CheckpointNotFoundError, match="not an Orbax checkpoint"):
        jaxckpt.import_orbax(tmp_path / "junk", tmp_path / "root")
    with pytest.raises(jaxckpt.ConfigError, match="inside src"):
        jaxckpt.import_orbax(tmp_path / "junk", tmp_path / "junk" / "root")


def test_cli_import_orbax_and_its_exit_codes(sources, tmp_path, capsys):
    src = sources["standard"]
    assert cli.main(["import-orbax", str(src), str(tmp_path / "root"), "--step", "100"]) == 0
    assert "step_00000100" in capsys.readouterr().out
    expected = orbax_restore("standard", src, 100)
    assert digest(restore_jaxckpt(tmp_path / "root", expected)) == digest(expected)
    assert cli.main(["import-orbax", str(src), str(tmp_path / "r2"), "--step", "5"]) == 2
    assert "steps there: 0, 100, 200" in capsys.readouterr().err
    assert cli.main(["import-orbax", str(tmp_path / "nope"), str(tmp_path / "r3")]) == 3
    assert cli.main(["import-orbax", str(src), str(src)]) == 2  # root inside src
    assert cli.main(["import-orbax", str(src), str(tmp_path / "root"), "--step", "100"]) == 3
    assert "already holds" in capsys.readouterr().err


def test_a_json_item_with_text_is_left_out_with_a_warning(tmp_path):
    src = orbax_manager(tmp_path / "src", {4: ocp.args.Composite(
        state=ocp.args.StandardSave({"w": jnp.arange(3, dtype=jnp.float32)}),
        config=ocp.args.JsonSave({"name": "tiny", "lr": 0.1}))})
    with pytest.warns(jaxckpt.CheckpointWarning, match=r"'config'.*\['name'\].*left out"):
        jaxckpt.import_orbax(src, tmp_path / "root")
    like = {"state": {"w": np.zeros(3, np.float32)}}
    got = restore_jaxckpt(tmp_path / "root", like)
    assert np.array_equal(got["state"]["w"], np.arange(3, dtype=np.float32))
