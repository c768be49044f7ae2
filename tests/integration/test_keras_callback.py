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
        _fit(model, backup, extra=[Boom(after=3)])
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
    row = keras_rows(widths=(4, 8, 4), batches=4, batch_size=4, every=2, rounds=1,
                     directory=str(tmp_path))
    assert set(row["fit_s"]) == {"plain", "keras", "jaxckpt"}
    assert set(row["lost_s"]) == set(row["blocking_s"]) == {"keras", "jaxckpt"}
    assert row["saves_per_fit"] == 2 and row["state_bytes"] > 0
    assert all(len(values) == 1 for values in row["seconds"].values())
