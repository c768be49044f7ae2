"""use_jaxckpt: a Hugging Face ``Trainer`` (TRL's trainers too) saving through jaxckpt.

Owns: the hooks set on one Trainer instance and the callback that closes its manager; the
cadence and retention read from ``TrainingArguments`` (``recover_config_from_args``) and the
settings refused. Trainer's own resume logic runs unchanged: it is handed a directory that
holds only the checkpoint's ``trainer_state.json`` (written from the checkpoint's JSON), and
its loaders of weights, optimizer, scheduler and RNG are pointed at the jaxckpt checkpoint.
What a checkpoint holds and how it is written is ``DcpCheckpointManager``'s.

Must not import: jax, orbax.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from jaxckpt import ConfigError, Every, ExportConfig, RecoverConfig, StepInfo
from jaxckpt.core.extras import requires_extra
from jaxckpt.errors import CheckpointCorruptError
from torch_bridge import rng
from torch_bridge.dcp import overlap
from torch_bridge.dcp.backend import DcpBackend
from torch_bridge.manager import DcpCheckpointManager

with requires_extra("transformers", "torch_bridge.integrations.transformers"):
    from transformers import Trainer, TrainerCallback, TrainerState
    from transformers.trainer_callback import ExportableState

__all__ = ["use_jaxckpt", "recover_config_from_args", "STATEFUL_NAME"]

#: The name of the Trainer's state among the checkpoint's stateful objects.
STATEFUL_NAME = "trainer_state"
_STATE_FILE = "trainer_state.json"  # the name Trainer's resume reads
_HOOKED = "_jaxckpt_hook"


def use_jaxckpt(trainer: Any, root: str | os.PathLike[str], recover: RecoverConfig | None = None,
                export: ExportConfig | None = None, **manager_kwargs: Any) -> Any:
    """Make ``trainer`` save through jaxckpt and resume from ``root``; returns ``trainer``.

    From then on ``trainer.train()`` writes no ``checkpoint-N`` folders: at each save point
    (after Trainer's logging and evaluation of a step) a ``DcpCheckpointManager`` under
    ``root`` saves the model, optimizer, LR scheduler, gradient scaler, RNGs and the
    ``TrainerState`` asynchronously. When ``root`` holds a valid checkpoint, ``train()``
    (no argument) resumes from the newest one as ``train(resume_from_checkpoint=...)``
    would: Trainer skips the batches already seen and restores the RNGs after the skip.
    A ``resume_from_checkpoint`` path still loads a Trainer checkpoint folder (a run moving
    to jaxckpt). The manager is closed (its last save committed) at the end of training
    and on an exception.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass: TRL's ``SFTTrainer``, ...).
        root: the checkpoint root: a local path, ``s3://`` or ``gs://``.
        recover: the recovery checkpoints' config; None: from ``trainer.args``
            (``recover_config_from_args``).
        export: exports on their own cadence, e.g.
            ``ExportConfig(exporter=torch_bridge.hf_exporter(params_of="model"))``.
        manager_kwargs: any other keyword of ``DcpCheckpointManager`` (``mode``,
            ``on_report``, ``backend``, ``storage_options``, ...).
    """
    if not isinstance(trainer, Trainer):
        raise ConfigError(f"use_jaxckpt(trainer, ...) takes a transformers.Trainer (or a "
                          f"subclass such as trl.SFTTrainer), got {type(trainer).__name__}.")
    if getattr(trainer, _HOOKED, None) is not None:
        raise ConfigError("use_jaxckpt: this Trainer already saves through jaxckpt; call "
                          "use_jaxckpt once per Trainer.")
    check_supported(trainer)
    if recover is None:
        recover = recover_config_from_args(trainer.args)
    hook = _JaxckptHook(trainer, os.fspath(root), recover, export, manager_kwargs)
    hook.install()
    return trainer


def check_supported(trainer: Any) -> None:
    """Raise ``ConfigError`` for the settings whose saving or resume jaxckpt does not take
    over, naming the field and the fix."""
    args = trainer.args
    if _strategy(args.save_strategy) == "best":
        raise ConfigError(
            "TrainingArguments.save_strategy='best' is not supported by use_jaxckpt: set "
            "save_strategy='steps' (or 'epoch') and keep the best checkpoints by a metric "
            "with recover=RecoverConfig(keep_best=KeepBest(metric='eval_loss', mode='min')); "
            "the logged values of each step are the checkpoint's metrics.")
    if args.load_best_model_at_end:
        raise ConfigError(
            "TrainingArguments.load_best_model_at_end=True is not supported by use_jaxckpt "
            "(there is no checkpoint-N folder to load). Set it to False; keep the best with "
            "RecoverConfig(keep_best=...) and load it with DcpCheckpointManager(root)"
            ".restore(state, step=...).")
    if args.save_only_model:
        raise ConfigError(
            "TrainingArguments.save_only_model=True is not supported by use_jaxckpt: its "
            "checkpoints are for resuming and hold the optimizer too. Set it to False; for "
            "model-only files pass export=ExportConfig(exporter=torch_bridge.hf_exporter("
            "params_of='model')).")
    if getattr(trainer, "is_deepspeed_enabled", False) or args.deepspeed:
        raise ConfigError(
            "TrainingArguments.deepspeed is set: DeepSpeed engines save their own state and "
            "use_jaxckpt does not take it over. Remove use_jaxckpt or train without DeepSpeed "
            "(FSDP or DDP).")


def recover_config_from_args(args: Any) -> RecoverConfig:
    """The recovery cadence and retention of ``TrainingArguments``: ``save_strategy="steps"``
    saves every ``save_steps`` steps, ``"epoch"`` at every epoch end (either way the last
    step of training is saved too); ``save_total_limit`` keeps that many (None or <= 0:
    all), as Trainer's own rotation does.

    Args:
        args: a ``transformers.TrainingArguments``.
    """
    strategy = _strategy(args.save_strategy)
    if strategy == "no":
        raise ConfigError(
            "TrainingArguments.save_strategy='no' saves nothing, so use_jaxckpt has no cadence "
            "to follow. Set save_strategy='steps' with save_steps=N (or 'epoch'), or pass "
            "recover=RecoverConfig(every=Every(steps=N)).")
    if strategy == "steps":
        steps = args.save_steps
        if not float(steps).is_integer() or steps < 1:
            raise ConfigError(
                f"TrainingArguments.save_steps={steps!r} is a fraction of the run; use_jaxckpt "
                f"needs a whole number of steps. Set save_steps to an int >= 1, or pass "
                f"recover=RecoverConfig(every=Every(steps=N)).")
        every = Every(steps=int(steps))
    elif strategy == "epoch":
        every = Every(epochs=1)
    else:
        raise ConfigError(f"TrainingArguments.save_strategy={strategy!r} is not supported by "
                          f"use_jaxckpt; use 'steps' or 'epoch'.")
    limit = args.save_total_limit
    return RecoverConfig(every=every, keep_last_n=limit if limit and limit > 0 else None)


def _strategy(value: Any) -> str:
    return str(getattr(value, "value", value))


class _TrainerStateRecord:
    """The Trainer's state as a stateful object of the checkpoint: ``TrainerState`` as a
    JSON dict (the fields of its ``trainer_state.json``), the same on every process."""

    jaxckpt_state_scope = "global"

    def __init__(self, trainer: Any):
        self._trainer = trainer
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self._trainer.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state)


class _JaxckptHook(TrainerCallback):
    """The hooks of one Trainer: opens the manager at ``train()``, saves at the save points,
    feeds Trainer's resume, closes the manager at the end of training or on an error.

    Concurrency: Trainer's training thread only; the manager's own threads are its own."""

    def __init__(self, trainer: Any, root: str, recover: RecoverConfig,
                 export: ExportConfig | None, manager_kwargs: dict[str, Any]):
        self.trainer = trainer
        self.root = root
        self.recover = recover
        self.export = export
        self.manager_kwargs = manager_kwargs
        self.manager: DcpCheckpointManager | None = None
        self.record = _TrainerStateRecord(trainer)
        self.resume_dir: str | None = None
        self.resume_step: int | None = None
        self.rng: dict[str, Any] | None = None
        self.steps_per_epoch: int | None = None
        self.at_epoch_end = False
        self.handled_step = 0
        self.overlap: overlap.StagingOverlap | None = None
        self.fence: overlap.StagingFence | None = None

    # --- installing --------------------------------------------------------------------
    def install(self) -> None:
        trainer = self.trainer
        originals = {name: getattr(trainer, name) for name in (
            "train", "set_initial_training_values", "_maybe_log_save_evaluate",
            "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_rng_state")}
        self.originals = originals
        # Bound on the instance: a subclass's own versions (TRL's) run inside them.
        trainer.train = self.train
        trainer.set_initial_training_values = self.set_initial_training_values
        trainer._maybe_log_save_evaluate = self.maybe_log_save_evaluate
        trainer._load_from_checkpoint = self.load_from_checkpoint
        trainer._load_optimizer_and_scheduler = self.load_optimizer_and_scheduler
        trainer._load_rng_state = self.load_rng_state
        trainer.add_callback(self)
        setattr(trainer, _HOOKED, self)

    # --- train(): the manager's lifetime -------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """Trainer's ``train``: resumes from the root's newest valid checkpoint unless given
        a Trainer checkpoint folder (a ``str``); True, False and None all mean the root."""
        self._open()
        try:
            if not isinstance(resume_from_checkpoint, str):
                resume_from_checkpoint = self._prepare_resume()
            return self.originals["train"](resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            self._abort()
            raise
        finally:
            self._forget_resume()

    def _open(self) -> None:
        self._abort()  # a manager left over from a train() that did not finish
        self.manager = DcpCheckpointManager(self.root, recover=self.recover, export=self.export,
                                            **self.manager_kwargs)
        self.handled_step = 0
        backend = self.manager.backend
        # Several processes stage on the training thread (overlap.single_process says why).
        self.overlap = (overlap.attach(backend) if isinstance(backend, DcpBackend)
                        and overlap.single_process() else None)

    def _prepare_resume(self) -> str | None:
        """Choose the checkpoint (its TrainerState only: the tensors load once the optimizer
        and scheduler exist) and write its ``trainer_state.json`` where Trainer reads it."""
        assert self.manager is not None
        self.record.loaded = None
        recovered = self.manager.recover({}, stateful={STATEFUL_NAME: self.record},
                                         partial=True)
        if recovered is None:
            return None
        if self.record.loaded is None:
            raise CheckpointCorruptError(
                f"{recovered.path}: the checkpoint holds no {STATEFUL_NAME!r}; it was not written "
                f"by use_jaxckpt. Restore it with DcpCheckpointManager, or use another root.")
        self.resume_step = recovered.step_info.global_step
        self.resume_dir = tempfile.mkdtemp(prefix="jaxckpt-trainer-resume-")
        with open(os.path.join(self.resume_dir, _STATE_FILE), "w") as stream:
            stream.write(json.dumps(self.record.loaded, indent=2, sort_keys=True) + "\n")
        return self.resume_dir

    def _forget_resume(self) -> None:
        if self.resume_dir is not None:
            shutil.rmtree(self.resume_dir, ignore_errors=True)
        self.resume_dir = self.resume_step = self.rng = None

    def _abort(self) -> None:
        """Close the manager without masking the error being raised (if any)."""
        manager, self.manager = self.manager, None
        self._remove_fence()
        if manager is not None:
            manager.__exit__(*sys.exc_info())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        manager, self.manager = self.manager, None
        self._remove_fence()
        if manager is not None:
            manager.close()  # waits for the last save to commit; raises its error

    # --- resuming: Trainer's loaders pointed at the checkpoint ---------------------------
    def _ours(self, checkpoint: Any) -> bool:
        return self.resume_dir is not None and checkpoint == self.resume_dir

    def load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._ours(resume_from_checkpoint):
            return  # the weights load with the optimizer, once it exists
        self.originals["_load_from_checkpoint"](resume_from_checkpoint, model)

    def load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._ours(checkpoint):
            self._restore_tensors()
        # Trainer's (or a subclass's): finds none of its files in our directory, but a
        # subclass may read its own there.
        self.originals["_load_optimizer_and_scheduler"](checkpoint)

    def load_rng_state(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            self.originals["_load_rng_state"](checkpoint)
        elif self.rng is not None:
            rng.restore_rng(self.rng)

    def _restore_tensors(self) -> None:
        """Model, optimizer, scheduler and scaler from the chosen step; the RNGs it holds are
        kept aside for ``_load_rng_state`` (Trainer restores them after skipping batches)."""
        assert self.manager is not None
        before = rng.capture_rng()
        recovered = self.manager.recover(self._entries(), stateful={STATEFUL_NAME: self.record})
        self.rng = rng.capture_rng()
        rng.restore_rng(before)
        step = None if recovered is None else recovered.step_info.global_step
        if step != self.resume_step:
            raise CheckpointCorruptError(
                f"the checkpoint of step {self.resume_step} failed verification while its "
                f"tensors were read and was set aside (now: {step}); Trainer had started from "
                f"its state. Run the same command again: it resumes from the newest valid one.")

    def _entries(self) -> dict[str, Any]:
        """The tensors of a checkpoint: what Trainer's own checkpoint folder holds besides
        its JSON and RNG files."""
        trainer = self.trainer
        optimizer = trainer.optimizer
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        entries = {"model": trainer.model, "optimizer": optimizer,
                   "scheduler": trainer.lr_scheduler}
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            entries["scaler"] = scaler
        return entries

    # --- saving: one save point per step --------------------------------------------------
    def set_initial_training_values(self, *args: Any, **kwargs: Any) -> Any:
        values = self.originals["set_initial_training_values"](*args, **kwargs)
        self.steps_per_epoch = int(values[1])  # num_update_steps_per_epoch
        return values

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.at_epoch_end = False

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.at_epoch_end = True

    def maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """Trainer's logging and evaluation, without its save; then jaxckpt's save point."""
        self.trainer.control.should_save = False
        self.originals["_maybe_log_save_evaluate"](*args, **kwargs)
        self.trainer.control.should_save = False
        self._save_point()

    def _save_point(self) -> None:
        """Offer this step to the manager once, at the step's last save point: the one after
        the epoch end when the epoch (or training) ends with it, as Trainer's own save."""
        trainer, manager = self.trainer, self.manager
        control, step = trainer.control, trainer.state.global_step
        if manager is None or step == 0 or step == self.handled_step:
            return
        info = self._step_info(step)
        ending = control.should_training_stop or control.should_epoch_stop
        if not self.at_epoch_end and (info.is_epoch_end or ending):
            return  # on_epoch_end and the epoch's save point come next
        self.handled_step = step
        self._install_fence()
        metrics = self._metrics(step)
        stateful = {STATEFUL_NAME: self.record}
        reports = manager.maybe_save(info, self._state_to_save, stateful=stateful,
                                     metrics=metrics, epoch_end=info.is_epoch_end)
        saved = any(report.kind == "recover" for report in reports)
        if not saved and control.should_training_stop and manager.recover_config.enabled:
            manager.save(info, self._state_to_save, stateful=stateful, metrics=metrics)
            saved = True
        if saved:
            trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state,
                                                               trainer.control)

    # --- the overlap's fence: no optimizer step while a save's staging copy is made ------
    def _install_fence(self) -> None:
        """Hook the optimizer's step and the forward of modules holding buffers (once per
        object, ``overlap.StagingFence``): a save stages on the backend's worker while the
        next forward and backward run, and whatever would change its tensors waits for the
        copy."""
        if self.overlap is None:
            return
        if self.fence is None:
            self.fence = overlap.StagingFence(self.overlap)
        try:
            self.fence.install([self._entries()["optimizer"]], [self.trainer.model])
        except TypeError:  # not a torch optimizer: stage on the training thread
            assert self.manager is not None
            self._remove_fence()
            overlap.detach(self.manager.backend)
            self.overlap = None

    def _remove_fence(self) -> None:
        fence, self.fence = self.fence, None
        if fence is not None:
            fence.remove()

    def _step_info(self, step: int) -> StepInfo:
        """Trainer counts completed steps from 1; a StepInfo names the step from 0."""
        per_epoch = self.steps_per_epoch
        index = step - 1
        if per_epoch is None:
            return StepInfo(0, index, index)
        return StepInfo(index // per_epoch, index % per_epoch, index, per_epoch)

    def _metrics(self, step: int) -> dict[str, float]:
        """The numbers logged at this step (loss, learning rate, eval metrics...)."""
        out: dict[str, float] = {}
        for entry in self.trainer.state.log_history:
            if entry.get("step") == step:
                out.update({key: value for key, value in entry.items()
                            if isinstance(value, (int, float)) and not isinstance(value, bool)})
        return out

    def _state_to_save(self) -> dict[str, Any]:
        """Called by the manager when a save is due: the TrainerState brought up to date as
        Trainer's own save does (floating-point operations, stateful callbacks), then the
        tensors."""
        trainer = self.trainer
        if trainer.hp_search_backend is None:
            trainer.store_flos()
        callbacks: list[Any] = [callback for callback in trainer.callback_handler.callbacks
                                + [trainer.control] if isinstance(callback, ExportableState)]
        trainer.state.stateful_callbacks = TrainerState(
            stateful_callbacks=callbacks).stateful_callbacks
        return self._entries()

