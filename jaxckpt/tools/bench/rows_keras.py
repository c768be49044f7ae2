"""The Keras rows of the trainers' benchmark: time ``model.fit`` loses to checkpointing with
Keras's own ``BackupAndRestore`` and with jaxckpt's, at the same cadence, side by side.

Owns: ``keras_rows`` (one child process with ``KERAS_BACKEND=jax``: a compiled MLP, optionally
beside a frozen block of weights and with steps lengthened by a host sleep, fitted with no
callback, with Keras's callback and with jaxckpt's, the variants taking turns, a fresh root
each fit) and the child's side (``_keras_worker``). Not in ``jaxckpt bench --quick``:
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

from .timing import _cpu_clock, _in_child, _lowered_threads

__all__ = ["keras_rows"]

VARIANTS = ("plain", "keras", "jaxckpt")


def keras_rows(*, widths: tuple[int, ...] = (256, 1024, 1024, 256), batches: int = 60,
               batch_size: int = 64, every: int = 10, rounds: int = 3, frozen_mb: int = 0,
               step_ms: int = 0, directory: str | None = None,
               background_nice: int | None = None) -> dict[str, Any]:
    """Measure the three fits in a fresh process and return the medians and lost times.

    Lost time per fit is each fit's wall time minus the ``plain`` fit's of the same round
    (median over rounds); per save, the host's time from the first batch to the last, over
    ``plain``'s, divided by the saves made in it (the final save and the wait for it to
    commit are left out: they are in the per-fit figure).

    Args:
        widths: the MLP's layer widths (input first).
        batches: batches of the one-epoch fit.
        batch_size: samples per batch.
        every: batches between checkpoints (Keras ``save_freq`` / ``Every(steps=...)``).
        rounds: rounds of the three fits (medians are reported).
        frozen_mb: MB of non-trainable weights beside the MLP (a frozen base): saved by
            both callbacks, passed through the step untouched.
        step_ms: milliseconds the host sleeps before each step (a callback's
            ``on_train_batch_begin``): an accelerator's share of a step, during which the
            host's cores are free.
        directory: where the checkpoints go (default the system temporary directory).
        background_nice: the nice value of every Python thread the child starts (the save's
            background threads; XLA's own are native); None: the training thread's priority.
    """
    job = {"widths": list(widths), "batches": batches, "batch_size": batch_size,
           "every": every, "rounds": rounds, "frozen_mb": frozen_mb, "step_ms": step_ms,
           "directory": directory, "background_nice": background_nice}
    return _in_child("jaxckpt.tools.bench.rows_keras:_keras_worker", job,
                     what="the Keras fit benchmark", env={"KERAS_BACKEND": "jax"})


def _model(keras: Any, job: dict[str, Any]) -> Any:
    """The compiled MLP (Dropout, Adam), after a frozen block when ``frozen_mb``."""
    widths = job["widths"]

    class FrozenBase(keras.layers.Layer):
        """Non-trainable weights the step passes through untouched."""

        def build(self, input_shape: Any) -> None:
            self.base = self.add_weight(shape=(job["frozen_mb"] * 2**18,),
                                        initializer="random_normal", trainable=False)

        def call(self, inputs: Any) -> Any:
            return inputs

    layers = [keras.Input((widths[0],))]
    layers += [FrozenBase()] if job["frozen_mb"] else []
    layers += [keras.layers.Dense(width, activation="relu") for width in widths[1:-1]]
    layers += [keras.layers.Dropout(0.1), keras.layers.Dense(widths[-1])]
    model = keras.Sequential(layers)
    model.compile(optimizer="adam", loss="mse")
    return model


def _keras_worker() -> None:
    """The child side: a job as JSON on stdin, the result as one JSON line on stdout."""
    job = json.load(sys.stdin)
    with _lowered_threads(job.get("background_nice")) as threads:
        _keras_fits(job, threads)


def _keras_fits(job: dict[str, Any], threads: Any) -> None:
    """The worker's fits, in the process's own threads."""
    import keras
    import numpy as np

    import jaxckpt
    from jaxckpt.integrations.keras import BackupAndRestore

    keras.utils.set_random_seed(0)
    widths, batch_size = job["widths"], job["batch_size"]
    data = np.random.default_rng(0)
    x = data.normal(size=(job["batches"] * batch_size, widths[0])).astype("float32")
    y = data.normal(size=(len(x), widths[-1])).astype("float32")
    model = _model(keras, job)
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

    def fit(variant: str) -> dict[str, Any]:
        chosen = [_timed_hooks(keras, callback) for callback in callbacks(variant)]
        device = _device_step(keras, job["step_ms"])
        cpu, train_cpu = _cpu_clock()
        background = threads.spent()
        started = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=True, verbose=0,
                  callbacks=[*chosen, device])
        fit_s = time.perf_counter() - started
        cpu_after, train_cpu_after = _cpu_clock()
        return {"fit_s": fit_s, "cpu_s": cpu_after - cpu,
                "train_cpu_s": train_cpu_after - train_cpu,
                "background_cpu_s": threads.spent() - background,
                "hooks_cpu_s": sum(callback.cpu_s for callback in chosen),
                "steps_s": device.begins[-1] - device.begins[0],
                "hooks_s": sum(callback.spent_s for callback in chosen),
                "end_s": sum(callback.end_s for callback in chosen)}

    for variant in VARIANTS:  # compile, and the first save of each kind, before timing
        fit(variant)
    samples: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    for round_index in range(job["rounds"]):
        for variant in VARIANTS[::-1] if round_index % 2 else VARIANTS:
            samples[variant].append(fit(variant))
    state_bytes = sum(int(np.asarray(v.value).nbytes) for v in model.variables)
    state_bytes += sum(int(np.asarray(v.value).nbytes) for v in model.optimizer.variables)
    result = _summary(samples, job)
    result.update(state_bytes=state_bytes, keras=keras.__version__,
                  **{k: job[k] for k in ("widths", "batches", "batch_size", "every",
                                         "frozen_mb", "step_ms")})
    print(json.dumps(result), flush=True)


def _summary(samples: dict[str, list[dict[str, Any]]], job: dict[str, Any]) -> dict[str, Any]:
    """Medians, lost times (per round against the same round's ``plain``, then the median)
    and the ratios jaxckpt / Keras, per fit and per save."""
    saves = job["batches"] // job["every"]
    saves_inside = (job["batches"] - 1) // job["every"]  # made before the last batch began

    def per_round(key: str, variant: str) -> list[float]:
        return [run[key] - plain[key]
                for run, plain in zip(samples[variant], samples["plain"], strict=True)]

    lost = {v: per_round("fit_s", v) for v in ("keras", "jaxckpt")}
    per_save = {v: [s / saves_inside for s in per_round("steps_s", v)] if saves_inside else []
                for v in ("keras", "jaxckpt")}

    def ratios(values: dict[str, list[float]]) -> list[float]:
        return [j / k for j, k in zip(values["jaxckpt"], values["keras"], strict=True) if k > 0]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    fit_ratios, save_ratios = ratios(lost), ratios(per_save)
    return {
        "fit_s": {v: statistics.median(r["fit_s"] for r in samples[v]) for v in VARIANTS},
        "seconds": {v: [r["fit_s"] for r in samples[v]] for v in VARIANTS},
        "samples": samples,
        "lost_s": {v: statistics.median(values) for v, values in lost.items()},
        "lost_per_save_s": {v: median(values) for v, values in per_save.items()},
        "blocking_s": {v: statistics.median(r["hooks_s"] for r in samples[v])
                       for v in ("keras", "jaxckpt")},
        "train_end_s": {v: statistics.median(r["end_s"] for r in samples[v])
                        for v in ("keras", "jaxckpt")},
        "ratio": median(fit_ratios), "ratios": fit_ratios,
        "ratio_per_save": median(save_ratios), "ratios_per_save": save_ratios,
        "saves_per_fit": saves, "load_average": list(os.getloadavg()),
        "cpu_per_save_s": {v: _cpu_split(samples, v, saves) for v in ("keras", "jaxckpt")},
    }


def _cpu_split(samples: dict[str, list[dict[str, Any]]], variant: str,
               saves: int) -> dict[str, float]:
    """CPU seconds per save (fit over the same round's ``plain`` fit, median over rounds):
    the process's, the training thread's, the other threads' (XLA's pool included), and
    where they are spent: the training thread's in the callback's hooks (``save_points``),
    the save's own Python threads' (``background``)."""
    def per_save(key: str) -> float:
        return statistics.median(run[key] - plain[key] for run, plain in
                                 zip(samples[variant], samples["plain"], strict=True)) / saves

    whole, own = per_save("cpu_s"), per_save("train_cpu_s")
    return {"total": whole, "training_thread": own, "other_threads": whole - own,
            "save_points": statistics.median(r["hooks_cpu_s"] for r in samples[variant]) / saves,
            "background": per_save("background_cpu_s")}


def _device_step(keras: Any, step_ms: int) -> Any:
    """A callback that notes when each batch begins and then sleeps ``step_ms`` (the host
    waiting for an accelerator's step). It has no ``on_train_batch_end``: Keras keeps
    dispatching steps ahead of their logs."""

    class DeviceStep(keras.callbacks.Callback):
        begins: list[float] = []

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self.begins.append(time.perf_counter())
            if step_ms:
                time.sleep(step_ms / 1000)

    step = DeviceStep()
    step.begins = []
    return step


def _timed_hooks(keras: Any, inner: Any) -> Any:
    """``inner`` behind a callback that adds up the seconds its hooks take (what the training
    thread waits for in the callback itself). It has the batch-end hook only when ``inner``
    has one: that hook alone makes Keras wait for each step's logs."""
    from keras.src import utils

    class Timed(keras.callbacks.Callback):
        spent_s = 0.0  # in every hook: begin and end of fit (open, final save) included
        cpu_s = 0.0  # the training thread's CPU seconds in them
        end_s = 0.0  # in on_train_end: a final save, waiting for the saves in flight

        def set_model(self, model: Any) -> None:
            super().set_model(model)
            inner.set_model(model)

        def set_params(self, params: Any) -> None:
            super().set_params(params)
            inner.set_params(params)

        def _call(self, name: str, *args: Any) -> float:
            started, started_cpu = time.perf_counter(), time.thread_time()
            getattr(inner, name)(*args)
            spent = time.perf_counter() - started
            self.spent_s += spent
            self.cpu_s += time.thread_time() - started_cpu
            return spent

        def on_train_begin(self, logs: Any = None) -> None:
            self._call("on_train_begin", logs)

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._call("on_epoch_begin", epoch, logs)

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            self._call("on_train_batch_begin", batch, logs)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self._call("on_epoch_end", epoch, logs)

        def on_train_end(self, logs: Any = None) -> None:
            self.end_s += self._call("on_train_end", logs)

    if not utils.is_default(inner.on_train_batch_end):
        def on_train_batch_end(self: Any, batch: int, logs: Any = None) -> None:
            self._call("on_train_batch_end", batch, logs)

        Timed.on_train_batch_end = on_train_batch_end
    return Timed()


if __name__ == "__main__":
    # key=value arguments: batches, batch_size, every, rounds, frozen_mb, step_ms (ints).
    settings: dict[str, Any] = {key: int(value) for key, value in
                                (arg.split("=", 1) for arg in sys.argv[1:])}
    print(json.dumps(keras_rows(**settings), indent=1))
