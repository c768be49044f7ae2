"""Live Flax NNX objects as the state: saved whole, restored in place, and the warning for
NNX objects a save leaves out; a SIGKILL test of an NNX-tutorial-shaped loop."""

from __future__ import annotations

import json
import signal
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxckpt

from support.harness import Worker, repo_env
from support.paths import NNX_WORKER

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

from support.models import TinyNet  # noqa: E402  (needs flax)


def build(seed):
    model = TinyNet(nnx.Rngs(seed, dropout=seed + 1))
    return {
        "model": model,
        "optimizer": nnx.Optimizer(model, optax.adamw(0.1), wrt=nnx.Param),
        "rngs": nnx.Rngs(seed + 2, shuffle=seed + 3),
        "metrics": nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                   loss=nnx.metrics.Average("loss")),
        "plain": {"table": np.arange(6.0).reshape(2, 3) + seed, "count": seed,
                  "device": jnp.full((2,), seed, jnp.int32)},
    }


def train(live, steps=2):
    """Change every kind of variable: params, batch stats, moments and step, the model's
    dropout stream, the outside Rngs, metric totals."""
    model, optimizer = live["model"], live["optimizer"]
    model.train()
    inputs = jax.random.normal(live["rngs"].shuffle(), (5, 3))
    for _ in range(steps):
        grads = nnx.grad(lambda m: jnp.mean(m(inputs) ** 2))(model)
        optimizer.update(model, grads)
        live["metrics"].update(loss=jnp.float32(0.25), logits=jnp.ones((5, 4)),
                               labels=jnp.arange(5) % 4)
        live["rngs"]()


def nnx_bits(live):
    """path -> bytes of every variable of every live object (key data for keys)."""
    objects = {name: obj for name, obj in live.items() if isinstance(obj, nnx.Pytree)}
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(objects))[0]:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[jax.tree_util.keystr(path)] = (np.asarray(leaf).dtype, np.asarray(leaf).tobytes())
    return out


def manager(root, **kwargs):
    return jaxckpt.CheckpointManager(
        str(root), recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=None),
        preemption_signals=(), **kwargs)


STEP = jaxckpt.StepInfo(0, 3, 3, None)


@pytest.mark.parametrize("lazy", [False, True], ids=["dict", "lambda"])
def test_live_objects_are_saved_whole_and_restored_in_place(tmp_path, lazy):
    live = build(0)
    train(live)
    with manager(tmp_path) as mgr:
        assert mgr.maybe_save(STEP, (lambda: live) if lazy else live)

    fresh = build(7)
    ids = {name: id(obj) for name, obj in fresh.items()}
    assert nnx_bits(fresh) != nnx_bits(live)
    with manager(tmp_path) as mgr:
        restored = mgr.recover(fresh)

    assert restored.step_info == STEP
    for name in ("model", "optimizer", "rngs", "metrics"):
        assert restored.state[name] is fresh[name], name  # the same objects, updated
        assert id(fresh[name]) == ids[name]
    assert nnx_bits(fresh) == nnx_bits(live)
    assert restored.state["plain"]["count"] == 0
    np.testing.assert_array_equal(restored.state["plain"]["table"], live["plain"]["table"])
    assert isinstance(restored.state["plain"]["device"], jax.Array)
    # The restored objects keep working: the next dropout mask and batch are the same.
    train(fresh, steps=1)
    train(live, steps=1)
    assert nnx_bits(fresh) == nnx_bits(live)


def test_live_objects_are_written_as_their_nnx_state(tmp_path):
    """Tree paths are those of {name: nnx.state(obj)}: such a checkpoint restores into live
    objects and back."""
    live = build(0)
    train(live)
    as_states = {name: nnx.state(obj) if isinstance(obj, nnx.Pytree) else obj
                 for name, obj in live.items()}
    with manager(tmp_path) as mgr:
        mgr.save(STEP, as_states)
    fresh = build(3)
    with manager(tmp_path) as mgr:
        mgr.recover(fresh)
        mgr.maybe_save(STEP.next(), fresh)  # one more step "trained" (none: same values)
        mgr.save(state=fresh)
    assert nnx_bits(fresh) == nnx_bits(live)

    other = build(5)
    like = {name: nnx.state(obj) if isinstance(obj, nnx.Pytree) else obj
            for name, obj in other.items()}
    with manager(tmp_path) as mgr:
        restored = mgr.restore(like, step=STEP.next().global_step)
    for name, obj in other.items():
        if isinstance(obj, nnx.Pytree):
            nnx.update(obj, restored.state[name])
    assert nnx_bits(other) == nnx_bits(live)


class Tied(nnx.Module):
    def __init__(self, rngs):
        self.encode = nnx.Linear(3, 3, rngs=rngs)
        self.decode = self.encode  # tied weights: one Variable reachable twice


class Holder(nnx.Module):
    def __init__(self, inner):
        self.inner = inner


def test_shared_variables_are_stored_once_and_restore_consistently(tmp_path):
    def make(seed):
        model = TinyNet(nnx.Rngs(seed))
        return {"ema": Holder(model), "model": model, "tied": Tied(nnx.Rngs(seed + 1))}

    live = make(0)
    live["tied"].encode.kernel.set_value(live["tied"].encode.kernel.get_value() + 1.0)
    with manager(tmp_path) as mgr:
        mgr.save(STEP, live)
    tree = json.loads((tmp_path / "recover" / "step_00000003" / "state" / "tree.json")
                      .read_text())
    paths = [leaf["path"] for leaf in tree["leaves"]]
    tied = [path for path in paths if path.startswith("['tied']")]
    assert len(tied) == 2 and len({path.split("]")[1] for path in tied}) == 1, tied  # once
    assert not any(path.startswith("['model']") for path in paths)  # reached via ['ema'] first

    fresh = make(5)
    with manager(tmp_path) as mgr:
        mgr.recover(fresh)
    assert fresh["tied"].decode is fresh["tied"].encode
    assert fresh["ema"].inner is fresh["model"]
    np.testing.assert_array_equal(fresh["tied"].decode.kernel[...],
                                  live["tied"].encode.kernel[...])
    np.testing.assert_array_equal(fresh["model"].linear.kernel[...],
                                  live["model"].linear.kernel[...])


def test_restore_in_place_keeps_each_variable_on_its_sharding(tmp_path):
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    live = build(0)
    train(live)
    with manager(tmp_path) as mgr:
        mgr.save(STEP, live)

    fresh = build(1)
    kernel = fresh["model"].linear.kernel
    sharding = NamedSharding(mesh, P(None, "a"))
    kernel.set_value(jax.device_put(kernel.get_value(), sharding))
    with manager(tmp_path) as mgr:
        mgr.recover(fresh)
    assert fresh["model"].linear.kernel[...].sharding == sharding
    assert nnx_bits(fresh) == nnx_bits(live)


def test_a_restore_that_fails_verification_leaves_live_objects_untouched(tmp_path):
    """Checksums of large files are checked while they are read; values of a read that
    fails them must never reach the caller's objects."""
    def make(seed):
        model = nnx.Linear(512, 1024, rngs=nnx.Rngs(seed))  # a 2 MiB kernel: its own file
        return {"model": model, "rngs": nnx.Rngs(seed)}

    live = make(0)
    with manager(tmp_path) as mgr:
        mgr.save(STEP, live)
    chunks = [path for path in (tmp_path / "recover").rglob("c/0/0")
              if path.stat().st_size > 1 << 20]
    assert len(chunks) == 1
    with open(chunks[0], "r+b") as handle:
        handle.seek(100)
        handle.write(b"\xff" * 8)

    fresh = make(1)
    before = nnx_bits(fresh)
    with manager(tmp_path) as mgr, pytest.raises(jaxckpt.CheckpointCorruptError):
        mgr.restore(fresh, step=3)
    assert nnx_bits(fresh) == before

    # The same restore of an intact checkpoint does update them in place.
    live = make(2)
    with manager(tmp_path / "other") as mgr:
        mgr.save(STEP, live)
        restored = mgr.restore(fresh, step=3)
    assert restored.state["model"] is fresh["model"]
    assert nnx_bits(fresh) == nnx_bits(live)


# ----------------------------------------------------------------- what a save leaves out


def left_out_records(record):
    return [w for w in record if issubclass(w.category, jaxckpt.CheckpointWarning)
            and "NNX" in str(w.message)]


def left_out_warnings(record):
    return [str(w.message) for w in left_out_records(record)]


def test_a_save_that_leaves_out_rngs_and_metrics_warns_once_naming_them(tmp_path):
    live = build(0)
    model, optimizer, rngs, metrics = (live[k] for k in ("model", "optimizer", "rngs",
                                                         "metrics"))
    with manager(tmp_path) as mgr, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mgr.maybe_save(STEP, lambda: nnx.state((model, optimizer)))
        mgr.maybe_save(STEP.next(), lambda: nnx.state((model, optimizer)))
        mgr.save(state=nnx.state((model, optimizer)))
    found = left_out_warnings(record)
    assert len(found) == 1, found
    assert "'rngs' (flax.nnx.rnglib.Rngs)" in found[0]
    assert "'metrics' (flax.nnx.training.metrics.MultiMetric)" in found[0]
    named = found[0].split("Fix:")[0]
    assert "'model'" not in named and "'optimizer'" not in named
    assert "pass them in the state dict" in found[0]
    assert left_out_records(record)[0].filename == __file__  # points at the caller's save


def test_a_save_of_live_objects_names_an_ema_copy_left_out_and_not_what_was_passed(tmp_path):
    live = build(0)
    ema = TinyNet(nnx.Rngs(9))  # an EMA model beside the live dict
    with manager(tmp_path) as mgr, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mgr.save(STEP, {k: live[k] for k in ("model", "optimizer", "rngs")})
    found = left_out_warnings(record)
    assert len(found) == 1, found
    assert "'ema'" in found[0] and "TinyNet" in found[0]
    # Only the caller's own variables are looked at: live["metrics"] is not one.
    named = found[0].split("Fix:")[0]
    assert "'metrics'" not in named and "'model'" not in named
    del ema


def test_a_save_of_the_whole_live_state_does_not_warn(tmp_path):
    live = build(0)
    model, optimizer, rngs, metrics = (live[k] for k in ("model", "optimizer", "rngs",
                                                         "metrics"))
    layer = model.linear  # part of what is saved
    with manager(tmp_path) as mgr, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mgr.maybe_save(STEP, lambda: {"model": model, "optimizer": optimizer, "rngs": rngs,
                                      "metrics": metrics, "plain": live["plain"]})
    assert left_out_warnings(record) == []
    fresh = build(3)
    with manager(tmp_path) as mgr:
        assert mgr.recover(fresh).state["rngs"] is fresh["rngs"]
    assert nnx_bits(fresh) == nnx_bits(live)
    del layer


def test_a_pure_pytree_save_is_not_judged(tmp_path):
    live = build(0)
    model, rngs = live["model"], live["rngs"]
    with manager(tmp_path) as mgr, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mgr.save(STEP, {"w": jnp.ones(3)})
    assert left_out_warnings(record) == []
    # ... while the same scope with an NNX save does warn (the check is live here).
    with manager(tmp_path / "b") as mgr, warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mgr.save(STEP, {"model": model})
    assert len(left_out_warnings(record)) == 1
    del model, rngs


# ------------------------------------------------------------------------ SIGKILL and resume

STEPS = 16
KILL_AFTER_REPORTED = 7  # kill at the first step line after the save of step 7 committed
WORKER_TIMEOUT_S = 120.0


def run_worker(tmp, root, tag, *, kill_after_reported=None):
    """Run tests/support/nnx_worker.py; with ``kill_after_reported``, SIGKILL its process
    group at the first ``STEP`` line after ``REPORTED <n>`` with n >= that step. Returns the
    lines."""
    env = repo_env(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
                   XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   JAX_COMPILATION_CACHE_DIR=str(tmp / "jax-cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    worker = Worker([sys.executable, str(NNX_WORKER), "--root", str(root),
                     "--log", str(tmp / f"{root.name}.log"),
                     "--final", str(tmp / f"{root.name}.npz"), "--steps", str(STEPS)],
                    env=env, timeout_s=WORKER_TIMEOUT_S)
    armed = False

    def first_step_after_the_report(line):
        nonlocal armed
        tag_, _, value = line.partition(" ")
        if kill_after_reported is not None and tag_ == "REPORTED" \
                and int(value) >= kill_after_reported:
            armed = True
        return armed and tag_ == "STEP"

    code = worker.run(kill_at=first_step_after_the_report)
    lines = worker.lines
    if kill_after_reported is not None:
        assert worker.killed and code == -signal.SIGKILL and "DONE" not in lines, (tag, lines, code)
    else:
        assert code == 0 and lines[-1] == "DONE", (tag, lines, code, worker.stderr())
    return lines


def log_entries(path):
    entries = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        entries.setdefault(entry["step"], []).append(entry)
    return entries


def test_sigkilled_nnx_tutorial_loop_resumes_bit_identical(tmp_path):
    reference = tmp_path / "reference"
    run_worker(tmp_path, reference, "reference")
    crashed = tmp_path / "crashed"
    first = run_worker(tmp_path, crashed, "killed", kill_after_reported=KILL_AFTER_REPORTED)
    second = run_worker(tmp_path, crashed, "resumed")

    assert first[0] == "FRESH"
    resumed_from = json.loads(second[0].partition(" ")[2])["step"]
    assert second[0].startswith("RESUMED") and resumed_from >= KILL_AFTER_REPORTED
    assert f"STEP {resumed_from + 1}" == second[1]
    # Every step logged by either segment (steps after the checkpoint ran twice) has the
    # reference's loss and metrics, bit for bit.
    expected = {step: entries[0] for step, entries in
                log_entries(tmp_path / "reference.log").items()}
    got = log_entries(tmp_path / "crashed.log")
    assert sorted(got) == list(range(STEPS))
    for step, entries in got.items():
        for entry in entries:
            assert entry == expected[step], step
    with np.load(tmp_path / "reference.npz") as want, np.load(tmp_path / "crashed.npz") as have:
        assert sorted(have.files) == sorted(want.files)
        kinds = {name.split("[", 1)[0] for name in want.files}
        assert kinds == {"model", "optimizer", "metrics", "rngs"}
        for name in want.files:
            assert have[name].dtype == want[name].dtype, name
            assert have[name].tobytes() == want[name].tobytes(), name


def test_live_objects_inside_other_pytree_nodes_and_many_leaves_are_found(tmp_path):
    """Objects inside pytree nodes other than dicts, lists and tuples (which the quick
    walk does not open), beside many leaves, are found through the treedef."""
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Bundle:
        model: Any
        scale: jax.Array

    def make(seed):
        return {"bundle": Bundle(TinyNet(nnx.Rngs(seed)), jnp.float32(seed)),
                "many": [np.full(2, float(i + seed)) for i in range(300)]}

    live = make(0)
    with manager(tmp_path) as mgr:
        mgr.save(STEP, live)
    fresh = make(4)
    with manager(tmp_path) as mgr:
        restored = mgr.recover(fresh).state
    assert restored["bundle"].model is fresh["bundle"].model
    assert nnx_bits({"a": fresh["bundle"].model}) == nnx_bits({"a": live["bundle"].model})
    assert float(restored["bundle"].scale) == 0.0
    np.testing.assert_array_equal(restored["many"][299], live["many"][299])


def test_a_live_model_as_an_auxiliary_item_is_restored_in_place(tmp_path):
    live, ref = build(0), TinyNet(nnx.Rngs(11))
    config = jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=None)
    with jaxckpt.CheckpointManager(str(tmp_path), recover=config, preemption_signals=(),
                                   items={"ref": jaxckpt.Every(steps=2)}) as mgr:
        mgr.save(STEP, live, items={"ref": ref})
    fresh, fresh_ref = build(1), TinyNet(nnx.Rngs(12))
    with jaxckpt.CheckpointManager(str(tmp_path), recover=config, preemption_signals=(),
                                   items={"ref": jaxckpt.Every(steps=2)}) as mgr:
        restored = mgr.recover(fresh, items={"ref": fresh_ref})
    assert restored.items["ref"] is fresh_ref
    assert nnx_bits({"ref": fresh_ref}) == nnx_bits({"ref": ref})
    assert nnx_bits(fresh) == nnx_bits(live)
