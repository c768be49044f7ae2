"""Hugging Face Trainer and TRL's SFTTrainer under ``use_jaxckpt``, in real processes.

One chain of worker processes on one root is SIGKILLed three times (mid-epoch, just after
an epoch boundary, while an async save is held in flight) and rerun with the same program
each time (the last rerun in the test process); the finished run's weights, Adam state,
learning rate and the loss, grad norm and learning rate Trainer logged at every step equal,
bit for bit, those of one uninterrupted Trainer run without jaxckpt (Trainer's own resume is
exact with ``data_seed`` and ``dataloader_num_workers=0``: so is this). SFTTrainer: one kill
point. The cadence and retention read from TrainingArguments, and the settings refused, are
checked in-process.

Workers: tests/support/trainer_worker.py, each in its own session, every wait bounded.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from jaxckpt import CheckpointWarning, ConfigError, Every, RecoverConfig

from support import trainer_worker
from support.harness import Worker, repo_env
from support.paths import REPO, TRAINER_WORKER

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

TIMEOUT_S = 180


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted Trainer run with Trainer's checkpointing off and no jaxckpt."""
    trainer = trainer_worker.build_trainer(tmp_path_factory.mktemp("reference"),
                                           save_strategy="no")
    trainer.train()
    return trainer_worker.summary(trainer)


def after_commit(committed: int, step: int) -> Callable[[str], bool]:
    """A kill point: the first line once step ``committed``'s checkpoint committed and step
    ``step`` ran (the two lines come from different threads, in either order)."""
    seen: set[str] = set()

    def test(line: str) -> bool:
        seen.add(line)
        return f"COMMITTED {committed}" in seen and f"STEP {step}" in seen
    return test


def rerun_here(trainer, root: Path) -> tuple[int, dict]:
    """The last run of a chain, in this process (the same code the worker runs, one process
    start fewer): the step it resumed from, and its summary."""
    from transformers import TrainerCallback

    from torch_bridge.integrations.transformers import use_jaxckpt

    begins: list[int] = []

    class Begin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            begins.append(state.global_step)

    trainer.add_callback(Begin())
    use_jaxckpt(trainer, root, mode="async").train()
    (begin,) = begins
    return begin, trainer_worker.summary(trainer)


def run_worker(root: Path, out: Path, *flags: str, kill_at=None) -> Worker:
    worker = Worker([sys.executable, str(TRAINER_WORKER), str(root), str(out / "output"),
                     str(out / "summary.json"), *flags], env=repo_env(), cwd=REPO,
                    timeout_s=TIMEOUT_S)
    code = worker.run(kill_at)
    expected = 0 if kill_at is None else -signal.SIGKILL
    assert code == expected, f"exit {code}: {worker.lines[-8:]}\n{worker.stderr()}"
    return worker


def test_trainer_killed_three_times_resumes_bit_exact(tmp_path, reference):
    root = tmp_path / "root"
    chain = [  # (kill point, extra flags, the step the run starts from)
        (after_commit(3, 4), (), 0),                  # mid-epoch (6 steps per epoch)
        (after_commit(6, 7), (), 3),                  # just after the epoch boundary
        ("SAVED 9", ("--hold-writes", "60"), 6),      # the async save of step 9 in flight
    ]
    for kill_at, flags, start in chain:
        worker = run_worker(root, tmp_path, *flags, kill_at=kill_at)
        assert worker.tagged("BEGIN") == [str(start)], worker.lines
    begin, resumed = rerun_here(trainer_worker.build_trainer(tmp_path / "output"), root)
    assert begin == 6
    for key in ("logs", "weights", "optimizer", "lr", "global_step"):
        assert resumed[key] == reference[key], f"{key} differs from the uninterrupted run"
    assert not list((tmp_path / "output").glob("checkpoint-*"))
    steps = sorted(p.name for p in (root / "recover").glob("step_*"))
    assert steps == ["step_00000002", "step_00000005", "step_00000008", "step_00000011"]


def test_sft_trainer_killed_once_resumes_bit_exact(tmp_path):
    trainer = trainer_worker.sft_trainer(tmp_path / "reference", save_strategy="no")
    trainer.train()
    expected = trainer_worker.summary(trainer)
    root = tmp_path / "root"
    run_worker(root, tmp_path, "--sft", kill_at=after_commit(4, 5))
    begin, resumed = rerun_here(trainer_worker.sft_trainer(tmp_path / "output"), root)
    assert begin == 4
    for key in ("logs", "weights", "optimizer", "lr", "global_step"):
        assert resumed[key] == expected[key], f"{key} differs from the uninterrupted run"


@pytest.mark.parametrize(("settings", "expected"), [
    ({"save_strategy": "steps", "save_steps": 50}, RecoverConfig(every=Every(steps=50),
                                                                 keep_last_n=None)),
    ({"save_strategy": "steps", "save_steps": 10, "save_total_limit": 2},
     RecoverConfig(every=Every(steps=10), keep_last_n=2)),
    ({"save_strategy": "epoch", "save_total_limit": 0}, RecoverConfig(every=Every(epochs=1),
                                                                      keep_last_n=None)),
])
def test_cadence_and_retention_follow_the_training_arguments(tmp_path, settings, expected):
    from torch_bridge.integrations.transformers import recover_config_from_args

    args = trainer_worker.training_args(tmp_path, **settings)
    assert recover_config_from_args(args) == expected


@pytest.mark.parametrize(("settings", "message"), [
    ({"save_strategy": "no"}, r"save_strategy='no' saves nothing.*Every\(steps=N\)"),
    ({"save_strategy": "steps", "save_steps": 0.25}, r"save_steps=0.25 is a fraction"),
    ({"save_strategy": "best", "metric_for_best_model": "loss"},
     r"save_strategy='best' is not supported.*KeepBest"),
    ({"save_only_model": True}, r"save_only_model=True.*hf_exporter"),
])
def test_unsupported_settings_are_refused_naming_the_field_and_fix(tmp_path, settings, message):
    from torch_bridge.integrations.transformers import use_jaxckpt

    trainer = trainer_worker.build_trainer(tmp_path, **settings)
    with pytest.raises(ConfigError, match=message):
        use_jaxckpt(trainer, tmp_path / "root")
    assert not (tmp_path / "root").exists()  # refused before anything was written


def test_a_given_recover_config_replaces_the_save_strategy_and_hooks_once(tmp_path):
    from torch_bridge.integrations.transformers import use_jaxckpt

    trainer = trainer_worker.build_trainer(tmp_path, save_strategy="no")
    config = RecoverConfig(every=Every(steps=5), keep_last_n=3)
    assert use_jaxckpt(trainer, tmp_path / "root", recover=config) is trainer
    with pytest.raises(ConfigError, match="already saves through jaxckpt"):
        use_jaxckpt(trainer, tmp_path / "root")


def test_a_trainer_checkpoint_folder_resumes_then_saves_through_jaxckpt(tmp_path, reference):
    """A run moving to jaxckpt midway: ``train(resume_from_checkpoint=folder)`` loads
    Trainer's own ``checkpoint-3`` exactly, and the saves after it are jaxckpt's."""
    from transformers import TrainerCallback

    from torch_bridge.integrations.transformers import use_jaxckpt

    class StopAtThree(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    own = trainer_worker.build_trainer(tmp_path / "own", callbacks=[StopAtThree()])
    own.train()
    moved = use_jaxckpt(trainer_worker.build_trainer(tmp_path / "moved"), tmp_path / "root")
    moved.train(resume_from_checkpoint=str(tmp_path / "own" / "checkpoint-3"))
    resumed = trainer_worker.summary(moved)
    for key in ("logs", "weights", "optimizer", "lr", "global_step"):
        assert resumed[key] == reference[key], f"{key} differs from the uninterrupted run"
    assert not list((tmp_path / "moved").glob("checkpoint-*"))
    steps = sorted(p.name for p in (tmp_path / "root" / "recover").glob("step_*"))
    assert steps == ["step_00000005", "step_00000008", "step_00000011"]


def test_a_save_overlapping_the_next_step_holds_the_weights_before_that_step(tmp_path):
    """The save of step 3 stages on the backend's worker (slowed down here) while step 4's
    forward and backward run; step 4's optimizer step waits for the copy, so the
    checkpoint holds step 3's weights bit for bit."""
    import time

    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from transformers import TrainerCallback

    from torch_bridge import DcpBackend, DcpCheckpointManager
    from torch_bridge.integrations.transformers import use_jaxckpt

    class SlowStager(DefaultStager):
        def stage(self, state_dict, **kwargs):
            time.sleep(0.5)
            events.append("staged")
            return super().stage(state_dict, **kwargs)

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 3:
                weights.update({k: v.detach().clone() for k, v in model.state_dict().items()})

    events: list[str] = []
    weights: dict[str, torch.Tensor] = {}
    backend = DcpBackend(async_checkpointer="thread")
    backend._stager = SlowStager(StagingOptions(False, False, False, False))
    trainer = trainer_worker.build_trainer(tmp_path, max_steps=4, callbacks=[Record()])
    use_jaxckpt(trainer, tmp_path / "root", backend=backend)
    trainer.create_optimizer()
    trainer.optimizer.register_step_post_hook(lambda *_: events.append("step") and None)
    trainer.train()
    assert events == ["step"] * 3 + ["staged", "step", "staged"]  # step 4 waited
    model = trainer_worker.tiny_llama()
    with DcpCheckpointManager(tmp_path / "root") as manager, \
            pytest.warns(CheckpointWarning, match="trainer_state"):
        manager.restore({"model": model}, step=2, partial=True)
    saved = model.state_dict()
    assert weights and all(torch.equal(saved[k], v) for k, v in weights.items())
    assert any(not torch.equal(p, weights[k]) for k, p in trainer.model.state_dict().items())
