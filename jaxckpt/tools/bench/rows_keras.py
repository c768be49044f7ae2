"""The Keras row of the trainers' benchmark: time ``model.fit`` loses to checkpointing with
Keras's own ``BackupAndRestore`` and with jaxckpt's, at the same cadence, side by side.

Owns: ``keras_rows`` (one child process with ``KERAS_BACKEND=jax``: a compiled MLP fitted
with no callback, with Keras's callback and with jaxckpt's, the variants taking turns, a fresh
root each fit) and the child's side (``_keras_worker``). Not in ``jaxckpt bench --quick``:
importing Keras alone takes seconds. Run it with ``python -m jaxckpt.tools.bench.rows_keras``.

Must not import at module level: jax, keras, torch. Concurrency contract: ``keras_rows``
waits for the process it starts.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from .timing import _in_child

__all__ = ["keras_rows"]

VARIANTS = ("plain", "keras", "jaxckpt")


def keras_rows(*, widths: tuple[int, ...] = (256, 1024, 1024, 256), batches: int = 60,
               batch_size: int = 64, every: int = 10, rounds: int = 3,
               directory: str | None = None) -> dict[str, Any]:
    """Measure the three fits in a fresh process and return the medians and lost times.

    Args:
        widths: the MLP's layer widths (input first).
        batches: batches of the one-epoch fit.
        batch_size: samples per batch.
        every: batches between checkpoints (Keras ``save_freq`` / ``Every(steps=...)``).
        rounds: rounds of the three fits (medians are reported).
        directory: where the checkpoints go (default the system temporary directory).
    """
    job = {"widths": list(widths), "batches": batches, "batch_size": batch_size,
           "every": every, "rounds": rounds, "directory": directory}
    return _in_child("jaxckpt.tools.bench.rows_keras:_keras_worker", job,
                     what="the Keras fit benchmark", env={"KERAS_BACKEND": "jax"})


def _keras_worker() -> None:
    """The child side: a job as JSON on stdin, the result as one JSON line on stdout."""
    job = json.load(sys.stdin)
    import keras
    import numpy as np

    import jaxckpt
    from jaxckpt.integrations.keras import BackupAndRestore

    keras.utils.set_random_seed(0)
    widths, batch_size = job["widths"], job["batch_size"]
    data = np.random.default_rng(0)
    x = data.normal(size=(job["batches"] * batch_size, widths[0])).astype("float32")
    y = data.normal(size=(len(x), widths[-1])).astype("float32")
    layers = [keras.Input((widths[0],))]
    layers += [keras.layers.Dense(width, activation="relu") for width in widths[1:-1]]
    layers += [keras.layers.Dropout(0.1), keras.layers.Dense(widths[-1])]
    model = keras.Sequential(layers)
    model.compile(optimizer="adam", loss="mse")
    scratch = tempfile.mkdtemp(prefix="bench-keras-", dir=job["directory"])
    runs = iter(range(1 << 30))

    def callbacks(variant: str) -> list[Any]:
        root = os.path.join(scratch, f"{variant}-{next(runs)}")
        if variant == "keras":
            return [keras.callbacks.BackupAndRestore(root, save_freq=job["every"],
                                                     delete_checkpoint=False)]
        if variant == "jaxckpt":
            return [BackupAndRestore(root, every=jaxckpt.Every(steps=job["every"]))]
        return []

    hooks_s: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    batch_hooks_s: dict[str, list[float]] = {variant: [] for variant in VARIANTS}

    def fit(variant: str) -> float:
        chosen = [_timed_hooks(keras, callback) for callback in callbacks(variant)]
        started = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=True, verbose=0,
                  callbacks=chosen)
        hooks_s[variant].append(sum(callback.spent_s for callback in chosen))
        batch_hooks_s[variant].append(sum(callback.batch_s for callback in chosen))
        return time.perf_counter() - started

    for variant in VARIANTS:  # compile, and the first save of each kind, before timing
        fit(variant)
        hooks_s[variant].clear()
        batch_hooks_s[variant].clear()
    seconds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_index in range(job["rounds"]):
        order = VARIANTS[::-1] if round_index % 2 else VARIANTS
        for variant in order:
            seconds[variant].append(fit(variant))
    median = {variant: statistics.median(values) for variant, values in seconds.items()}
    lost = {variant: median[variant] - median["plain"] for variant in ("keras", "jaxckpt")}
    state_bytes = sum(int(np.asarray(v.value).nbytes) for v in model.variables)
    state_bytes += sum(int(np.asarray(v.value).nbytes) for v in model.optimizer.variables)
    saves = job["batches"] // job["every"]
    blocking = {variant: statistics.median(hooks_s[variant]) for variant in ("keras", "jaxckpt")}
    per_save = {variant: statistics.median(batch_hooks_s[variant]) / saves
                for variant in ("keras", "jaxckpt")}
    result = {"fit_s": median, "seconds": seconds, "lost_s": lost, "blocking_s": blocking,
              "blocking_per_save_s": per_save,
              "ratio": lost["jaxckpt"] / lost["keras"] if lost["keras"] > 0 else None,
              "state_bytes": state_bytes, "saves_per_fit": saves,
              "keras": keras.__version__, **{k: job[k] for k in ("widths", "batches",
                                                                  "batch_size", "every")}}
    print(json.dumps(result), flush=True)


def _timed_hooks(keras: Any, inner: Any) -> Any:
    """``inner`` behind a callback that adds up the seconds its train hooks take (what the
    training thread waits for in the callback itself)."""

    class Timed(keras.callbacks.Callback):
        spent_s = 0.0  # in every hook: begin and end of fit (open, final save) included
        batch_s = 0.0  # in on_train_batch_end: the saves themselves

        def set_model(self, model: Any) -> None:
            super().set_model(model)
            inner.set_model(model)

        def set_params(self, params: Any) -> None:
            super().set_params(params)
            inner.set_params(params)

        def _call(self, name: str, *args: Any) -> None:
            started = time.perf_counter()
            getattr(inner, name)(*args)
            self.spent_s += time.perf_counter() - started

        def on_train_begin(self, logs: Any = None) -> None:
            self._call("on_train_begin", logs)

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._call("on_epoch_begin", epoch, logs)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            started = time.perf_counter()
            self._call("on_train_batch_end", batch, logs)
            self.batch_s += time.perf_counter() - started

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self._call("on_epoch_end", epoch, logs)

        def on_train_end(self, logs: Any = None) -> None:
            self._call("on_train_end", logs)

    return Timed()


if __name__ == "__main__":
    print(json.dumps(keras_rows(), indent=1))
