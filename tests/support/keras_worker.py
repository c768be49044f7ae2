"""A small Keras 3 (JAX backend) ``model.fit`` run, launched by test_keras_integration.

A Dense-Dropout-Dense model on synthetic arrays, ``shuffle=True``, 3 epochs of 6 batches;
with ``--root`` it runs under ``jaxckpt.integrations.keras.BackupAndRestore`` saving every 3
steps (a rerun resumes), without it it is the uninterrupted reference. Every trained batch
prints ``LOSS epoch batch loss.hex()``; the end of the run writes every variable fit trains
(model, optimizer, metrics) to ``--out`` (.npz) and prints ``DONE``. The reference run also
prints a ``REFUSED name message`` line for each bad use ``check_refusals`` tries.

``--kill-at epoch_end:E`` or ``batch:G`` (G: the global batch index): once the checkpoints
started so far committed, print ``KILL_HERE`` and wait to be SIGKILLed by the parent. A save
in flight is killed through ``kill_points`` (``JAXCKPT_KILL_POINT``, installed on the
callback's manager).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["KERAS_BACKEND"] = "jax"

import keras  # noqa: E402
import kill_points  # noqa: E402  (a sibling script: the worker runs by path)
import numpy as np  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt.integrations.keras import BackupAndRestore  # noqa: E402

EPOCHS, BATCH, SAMPLES = 3, 8, 48


class Probe(keras.callbacks.Callback):
    """Prints the losses, and stops for the parent's SIGKILL at --kill-at."""

    def __init__(self, backup: BackupAndRestore | None, kill_at: str):
        super().__init__()
        self.backup, self.epoch = backup, 0
        self.kind, _, where = kill_at.partition(":")
        self.where = int(where) if where else -1

    def on_train_begin(self, logs=None):
        if self.backup is not None:
            kill_points.install(self.backup.manager)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not logs or "loss" not in logs:
            return  # a batch skipped on resume (trained before the interruption)
        print("LOSS", self.epoch, batch, float(logs["loss"]).hex(), flush=True)
        if self.kind == "batch" and self.epoch * 6 + batch == self.where:
            self._stop()

    def on_epoch_end(self, epoch, logs=None):
        if self.kind == "epoch_end" and epoch == self.where:
            self._stop()

    def _stop(self):
        assert self.backup is not None
        self.backup.manager.wait()
        print("KILL_HERE", flush=True)
        time.sleep(120)


def check_refusals() -> None:
    """Bad arguments, and a model without what resuming relies on, raise ConfigError."""
    from jaxckpt.integrations.keras import fit_internals

    refusals = {
        "both": lambda: BackupAndRestore("r", every=jaxckpt.Every(steps=1),
                                         recover=jaxckpt.RecoverConfig()),
        "every": lambda: BackupAndRestore("r", every=3),
        "internals": lambda: fit_internals.check_model(object()),
    }
    for name, call in refusals.items():
        try:
            call()
        except jaxckpt.ConfigError as error:
            print("REFUSED", name, str(error).replace("\n", " "), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", default="")
    args = parser.parse_args()
    if not args.root:
        check_refusals()  # the reference run has time to spare: it runs beside the chain
    keras.utils.set_random_seed(0)
    data = np.random.default_rng(0)
    x = data.normal(size=(SAMPLES, 8)).astype("float32")
    y = (x @ data.normal(size=(8, 1))).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    backup = (BackupAndRestore(args.root, every=jaxckpt.Every(steps=3)) if args.root
              else None)
    callbacks = ([backup] if backup else []) + [Probe(backup, args.kill_at)]
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0,
              callbacks=callbacks)
    arrays = {f"model.{i}": np.asarray(v.value) for i, v in enumerate(model.variables)}
    arrays.update({f"optimizer.{i}": np.asarray(v.value)
                   for i, v in enumerate(model.optimizer.variables)})
    arrays.update({f"metrics.{i}": np.asarray(v.value)
                   for i, v in enumerate(model.metrics_variables)})
    np.savez(args.out, **arrays)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
