"""BackupAndRestore: a Keras 3 ``model.fit`` callback that checkpoints through jaxckpt.

Owns: when the callback saves (once a batch is trained, by the manager's triggers), what a
checkpoint holds (the variables fit trains, NumPy's global RNG as of the epoch's start, the
step, Keras's global seed) and how a rerun of the same ``fit`` resumes: the epoch it stopped
in, its trained batches skipped, every variable and RNG as they were. Keras internals are
reached only through ``fit_internals``.

Must not import: torch, torch_bridge.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxckpt.config import Every, RecoverConfig, StepInfo
from jaxckpt.errors import ConfigError
from jaxckpt.manager.manager import CheckpointManager

from . import fit_internals as internals

keras: Any = internals.import_keras()  # a ConfigError unless Keras runs on JAX

__all__ = ["BackupAndRestore"]


def host_views(values: list[Any]) -> list[Any]:
    """The values a save hands the manager: a NumPy view (no copy) of each array held whole
    on one CPU device, the others as they are. The manager's asynchronous save copies NumPy
    leaves into host buffers it reuses and keeps no view once it returns, so the next step
    can donate the arrays (fit's jitted step donates its state) and update them in place.
    Given the arrays themselves, the CPU backend would write from views it keeps until the
    write ends: the next step could not donate them and would fill fresh output buffers
    (page faults on every byte of the state). Arrays on accelerators, sharded ones and
    dtypes NumPy has no buffer for (bfloat16) go to the backend, which copies them itself."""
    return [np.asarray(value) if _on_one_cpu(value) else value for value in values]


def _on_one_cpu(value: Any) -> bool:
    devices = getattr(value, "devices", None)
    if devices is None or getattr(value.dtype, "isbuiltin", 0) != 1:
        return False
    placed = devices()
    return len(placed) == 1 and next(iter(placed)).platform == "cpu"


class _FitPosition:
    """The non-array part of a checkpoint, saved as a stateful object: NumPy's global RNG as
    of the epoch's start (Keras's array adapter draws each epoch's shuffle from it), NumPy's
    RNG at the save, and Keras's global seed. ``load_state_dict`` only keeps what it reads;
    the callback applies it when the resumed epoch begins."""

    def __init__(self) -> None:
        self.epoch_start_numpy: dict[str, Any] | None = None
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_start_numpy": self.epoch_start_numpy,
                "numpy_at_save": np.random.get_state(legacy=False),
                "global_seed": internals.get_global_seed()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded = dict(state)


class BackupAndRestore(keras.callbacks.Callback):
    """Checkpoint ``model.fit`` with jaxckpt; a rerun of the same ``fit`` resumes exactly.

    Saves, through a ``CheckpointManager`` (asynchronous, verified, retained by ``recover``),
    every variable fit trains or updates (weights, non-trainable state such as the Dropout
    layers' seed generators, the optimizer's and the metrics' variables), the epoch and the
    batch within it, NumPy's global RNG as of the epoch's start and Keras's global seed. At
    the start of ``fit`` it resumes from the newest valid checkpoint: the interrupted epoch
    starts again with the same shuffle, its trained batches are skipped (they still reach the
    other callbacks' ``on_train_batch_begin``/``end``, with empty logs), and training goes on
    as if never interrupted. The checkpoints stay after ``fit`` ends (a final one is written
    synchronously): a rerun of a finished ``fit`` trains nothing; use a new root for a new run.

    A batch's save starts when the next batch begins (or its epoch ends), with the values
    that batch left; the callback has no ``on_train_batch_end``, so it does not stop Keras
    from dispatching steps ahead. The training thread copies the state to host memory (on
    CPU into buffers the manager reuses); the write runs in the background.

    Needs Keras 3 on the JAX backend (``KERAS_BACKEND=jax`` before Keras is imported), a model
    compiled with ``steps_per_execution=1``, and input whose epochs have a known number of
    batches (arrays, a ``PyDataset`` with a length, or ``steps_per_epoch``).

    Args:
        root: the checkpoint root (a local path, ``s3://`` or ``gs://``).
        every: when a checkpoint is due (global steps count trained batches); default every
            epoch. Give ``recover=`` instead for the full recovery config.
        recover: a ``RecoverConfig`` (its ``every`` is the cadence); exclusive with ``every``.
        **manager_kwargs: further ``CheckpointManager`` arguments (``mode``,
            ``storage_options``, ``local``, ...).

    Concurrency: the training thread only (Keras calls callbacks there); one fit per root.
    """

    def __init__(self, root: str | os.PathLike[str], every: Every | None = None,
                 recover: RecoverConfig | None = None, **manager_kwargs: Any):
        super().__init__()
        if every is not None and not isinstance(every, Every):
            raise ConfigError(f"BackupAndRestore(every=...) takes a jaxckpt.Every, got "
                              f"{every!r}. Write every=jaxckpt.Every(steps=100).")
        if recover is not None and not isinstance(recover, RecoverConfig):
            raise ConfigError(f"BackupAndRestore(recover=...) takes a jaxckpt.RecoverConfig, "
                              f"got {type(recover).__name__}.")
        if every is not None and recover is not None:
            raise ConfigError("BackupAndRestore got both every= and recover=: put the cadence "
                              "in the config, recover=RecoverConfig(every=..., ...).")
        if recover is None:
            recover = RecoverConfig(every=every if every is not None else Every(epochs=1))
        self.root = os.fspath(root) if not isinstance(root, str) else root
        self.recover_config = recover
        self._manager_kwargs = dict(manager_kwargs)
        self._manager: CheckpointManager | None = None
        self._position = _FitPosition()
        self._steps_per_epoch = 0
        self._epoch = 0
        self._global_step = -1  # the last trained batch over the run; -1: none yet
        self._trained = False  # this fit trained a batch (so it has a step to save at its end)
        self._resume: dict[str, Any] | None = None  # what the resumed epoch's begin applies
        self._skip: tuple[int, int] = (-1, 0)  # (epoch, batches) skipped in that epoch
        self._batch: int | None = None  # the batch begun last in this epoch, not yet counted

    @property
    def manager(self) -> CheckpointManager:
        """The CheckpointManager of the ``fit`` in progress (from ``on_train_begin``)."""
        if self._manager is None:
            raise ConfigError("BackupAndRestore.manager exists from on_train_begin of fit on.")
        return self._manager

    # ------------------------------------------------------------------ keras hooks

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        try:
            self._begin()
        except BaseException as error:  # fit has not entered its try yet: nothing else closes
            self._close(error)
            raise

    def _begin(self) -> None:
        model = self._model
        internals.check_model(model)
        steps = self.params.get("steps")
        if not steps:
            raise ConfigError(
                "BackupAndRestore needs the number of batches per epoch to resume mid-epoch; "
                "this input has none. Pass arrays, a PyDataset with __len__, or "
                "fit(steps_per_epoch=...).")
        self._steps_per_epoch = int(steps)
        self._close()
        self._manager = CheckpointManager(self.root, recover=self.recover_config,
                                          **self._manager_kwargs)
        internals.watch_fit_error(model, self._close)
        self._global_step, self._resume, self._skip, self._trained = -1, None, (-1, 0), False
        self._batch = None
        variables = internals.fit_variables(model)
        like = {group: [v.value for v in variables[group]] for group in internals.FIT_STATE}
        recovered = self._manager.recover(like, stateful={"keras_fit": self._position})
        if recovered is None:
            internals.set_initial_epoch(model, None)
            return
        info = recovered.step_info
        if info.steps_per_epoch != self._steps_per_epoch:
            raise ConfigError(
                f"BackupAndRestore: the checkpoint in {self.root} was written by a fit with "
                f"{info.steps_per_epoch} batches per epoch, this fit has "
                f"{self._steps_per_epoch}. Rerun the same fit call, or use a new root.")
        for group in ("trainable", "non_trainable", "optimizer"):
            for variable, value in zip(variables[group], recovered.state[group], strict=True):
                variable.assign(value)
        loaded = self._position.loaded or {}
        internals.set_global_seed(loaded.get("global_seed"))
        self._global_step = info.global_step
        if info.is_epoch_end:  # the next epoch starts from scratch with the RNG at the save
            start, numpy_state, metrics, skip = info.epoch + 1, loaded.get("numpy_at_save"), None, 0
        else:  # the same epoch again: the same shuffle, its trained batches skipped
            start, numpy_state = info.epoch, loaded.get("epoch_start_numpy")
            metrics, skip = recovered.state["metrics"], info.epoch_step + 1
        self._resume = {"epoch": start, "numpy": numpy_state, "metrics": metrics, "skip": skip}
        internals.set_initial_epoch(model, start)

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._epoch, self._batch = epoch, None
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch"] == epoch:
            if resume["numpy"] is not None:
                np.random.set_state(resume["numpy"])
            if resume["metrics"] is not None:  # fit reset them after on_train_begin
                for variable, value in zip(self._model.metrics_variables, resume["metrics"],
                                           strict=True):
                    variable.assign(value)
            if resume["skip"]:
                internals.skip_batches(self._model, resume["skip"])
                self._skip = (epoch, resume["skip"])
        self._position.epoch_start_numpy = np.random.get_state(legacy=False)

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._end_batch()  # the batch before this one has been trained
        self._batch = batch

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._end_batch()  # the epoch's last batch (or the one a callback stopped fit at)

    def _end_batch(self) -> None:
        """Count the batch trained last and save it when a checkpoint is due. Called when the
        next batch begins or the epoch ends, not from ``on_train_batch_end``: a callback
        with that hook makes Keras wait for every step's logs before the next step starts
        (no asynchronous dispatch), which would cost every step, not only the saves."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        skip_epoch, skipped = self._skip
        if self._epoch == skip_epoch and batch < skipped:
            return  # trained before the interruption
        self._global_step += 1
        self._trained = True
        info = StepInfo(epoch=self._epoch, epoch_step=batch, global_step=self._global_step,
                        steps_per_epoch=self._steps_per_epoch)
        self.manager.maybe_save(info, self._snapshot, stateful={"keras_fit": self._position})

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        try:
            self._end_batch()
            if self._manager is not None and self._trained:
                self._manager.save(state=self._snapshot(), stateful={"keras_fit": self._position},
                                   mode="sync")
        finally:
            self._close()

    # ------------------------------------------------------------------ parts

    def _snapshot(self) -> dict[str, list[Any]]:
        """What a save writes: the values of the last trained step, as host views on CPU
        (``host_views``), called by the manager only when a save is due."""
        variables = internals.fit_variables(self._model)
        return {group: host_views([v.value for v in variables[group]])
                for group in internals.FIT_STATE}

    def _close(self, error: BaseException | None = None) -> None:
        """End this fit's use of the root: at its end, or when ``fit`` raised ``error``
        (then the saves in flight finish, no final one is written, the error is not masked)."""
        if self._model is not None:
            internals.unwatch_fit_error(self._model)
            internals.stop_skipping(self._model)
            internals.set_initial_epoch(self._model, None)
        manager, self._manager = self._manager, None
        if manager is None:
            return
        if error is None:
            manager.close()
        else:
            manager.__exit__(type(error), error, error.__traceback__)
