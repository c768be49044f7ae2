"""jaxckpt's Keras ``BackupAndRestore`` when ``fit`` raises, in this process (a tiny model), and
the Keras row of ``jaxckpt bench --trainers`` at tiny shapes. The bit-exact resume after a
SIGKILL is tests/system/test_keras_resume.py's."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is first imported

import numpy as np
import pytest

import jaxckpt
from jaxckpt.errors import ConfigError
from jaxckpt.tools.bench.rows_keras import keras_rows

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":
    pytest.skip("Keras was imported on another backend in this process",
                allow_module_level=True)

from jaxckpt.integrations.keras import BackupAndRestore  # noqa: E402 (after the checks)


class Boom(keras.callbacks.Callback):
    """Raises after the given trained batch, as a failing step or data pipeline would."""

    def __init__(self, after: int):
        super().__init__()
        self.after = after

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.after:
            raise RuntimeError("boom")


def _fit(model, backup, batches=6, extra=()):
    x = np.arange(batches * 4 * 3, dtype="float32").reshape(-1, 3) / 100
    return model.fit(x, x[:, :1], batch_size=4, epochs=1, shuffle=False, verbose=0,
                     callbacks=[backup, *extra])


def _root_is_free(root) -> bool:
    with jaxckpt.CheckpointManager(root):  # the root's lock: refused while a manager holds it
        return True


def test_a_fit_that_raises_releases_the_manager_and_the_root(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    root = tmp_path / "root"
    backup = BackupAndRestore(root, every=jaxckpt.Every(steps=2))
    with pytest.raises(RuntimeError, match="boom"):
        _fit(model, backup, extra=[Boom(after=4)])  # step 3's save began with batch 4
    # Keras called no on_train_end: the callback noticed the error itself.
    assert backup._manager is None and "jax_state_sync" not in vars(model)
    assert _root_is_free(root)
    with jaxckpt.CheckpointManager(root) as manager:
        assert manager.committed_steps()[-1] == 3  # in flight when fit raised: committed
    _fit(model, backup)  # the same fit again resumes after step 3 and ends
    assert _root_is_free(root)

    # An error in on_train_begin itself (fit's try not yet entered) releases it too.
    with pytest.raises(ConfigError, match="batches per epoch"):
        _fit(model, backup, batches=5)
    assert _root_is_free(root)


def test_the_keras_bench_row_measures_each_variant(tmp_path):
    row = keras_rows(widths=(4, 8, 4), batches=5, batch_size=4, every=2, rounds=1,
                     frozen_mb=1, step_ms=1, directory=str(tmp_path))
    assert set(row["fit_s"]) == {"plain", "keras", "jaxckpt"}
    assert set(row["lost_s"]) == set(row["blocking_s"]) == {"keras", "jaxckpt"}
    assert set(row["lost_per_save_s"]) == set(row["train_end_s"]) == {"keras", "jaxckpt"}
    assert row["saves_per_fit"] == 2 and row["state_bytes"] > 2**20  # the frozen MB
    assert all(len(values) == 1 for values in row["seconds"].values())


class Recorder(keras.callbacks.Callback):
    """Copies every variable fit trains after each batch (from the step's own outputs)."""

    def __init__(self):
        super().__init__()
        self.after: list[dict[str, list[np.ndarray]]] = []

    def on_train_batch_end(self, batch, logs=None):
        state = self.model._jax_state
        self.after.append({name: [np.array(value) for value in values]
                           for name, values in state.items()})


@pytest.mark.filterwarnings("ignore:.*holds state for")
def test_a_save_in_flight_holds_the_values_of_its_step(tmp_path):
    """Step 3's write is held uncommitted while steps 4 and 5 train (the jitted step donates
    and updates the state the save was taken from): step 3's checkpoint holds, bit for
    bit, the values step 3 left; the values fit ends with differ from them."""
    from jaxckpt.tools.backend_hooks import HeldBackend

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    backend = HeldBackend(hold_s=0.5, at_step=3)

    class Steps(BackupAndRestore):
        def _snapshot(self):
            backend.current_step = self._global_step
            return super()._snapshot()

    recorder = Recorder()
    backup = Steps(tmp_path / "root", recover=jaxckpt.RecoverConfig(
        every=jaxckpt.Every(steps=2), keep_last_n=None), backend=backend)
    _fit(model, backup, extra=[recorder])
    keys = {"trainable": "trainable_variables", "non_trainable": "non_trainable_variables",
            "optimizer": "optimizer_variables", "metrics": "metrics_variables"}
    with jaxckpt.CheckpointManager(tmp_path / "root") as manager:
        assert manager.committed_steps() == [1, 3, 5]
        like = {group: [np.asarray(v) for v in recorder.after[3][key]]
                for group, key in keys.items()}
        saved = manager.restore(like, step=3).state
    changed = 0
    for group, key in keys.items():
        for got, want, end in zip(saved[group], recorder.after[3][key],
                                  recorder.after[5][key], strict=True):
            assert np.asarray(got).tobytes() == want.tobytes(), group
            changed += end.tobytes() != want.tobytes()
    assert changed >= 4  # the weights, biases and Adam moments moved on after step 3
