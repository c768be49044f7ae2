"""Time a Hugging Face Trainer run loses to checkpointing: Trainer's own vs jaxckpt's.

Owns: ``trainer_rows`` (one process, the variants taking turns each round: no checkpoints,
Trainer's own ``checkpoint-N`` folders, ``use_jaxckpt`` at the same cadence, and the same
with its staging overlap off: ``jaxckpt-blocking``) and
its command line (``python -m jaxckpt.tools.bench.rows_trainers``). Not a section of
``jaxckpt bench``: importing transformers alone takes longer than ``--quick`` may.

Must not import at module level: jax, orbax, torch, transformers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

__all__ = ["trainer_rows"]


def _trainer(output_dir: str, *, steps: int, save_every: int | None, width: int,
             layers: int, frozen_mb: int = 0, step_ms: int = 0) -> Any:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, 4096, (256, 64),
                                     generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=4)
    save = {"save_strategy": "no"} if save_every is None else {
        "save_strategy": "steps", "save_steps": save_every}
    args = TrainingArguments(output_dir=output_dir, max_steps=steps,
                             per_device_train_batch_size=4, logging_steps=save_every or steps,
                             data_seed=0, report_to=[], use_cpu=True, disable_tqdm=True,
                             log_level="error", **save)
    model = LlamaForCausalLM(config)
    if frozen_mb:  # a frozen base: saved with the model, untouched by the step
        model.frozen_base = torch.nn.Parameter(
            torch.randn(frozen_mb * 2**18, generator=torch.Generator().manual_seed(1)),
            requires_grad=False)

    class DeviceStep(TrainerCallback):
        """Stands for the part of a step an accelerator runs (its forward and backward, which
        the host waits for before the optimizer step): the host's cores are idle."""

        def on_pre_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(step_ms / 1000)

    return Trainer(model=model, args=args, train_dataset=Tokens(),
                   callbacks=[DeviceStep()] if step_ms else None)


def _timed(fn: Any, spent: list[float]) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)
    return call


@contextlib.contextmanager
def _fence_timed(spent: list[float]) -> Any:
    """Count the overlap's fence (a step waiting for a save's staging copy) as the training
    thread's time of the save point before it."""
    from torch_bridge.dcp.overlap import StagingOverlap

    fence = StagingOverlap.fence

    def timed(self: Any, timeout_s: float | None = None) -> bool:
        start = time.perf_counter()
        try:
            return fence(self, timeout_s)
        finally:
            if spent:
                spent[-1] += time.perf_counter() - start

    StagingOverlap.fence = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        StagingOverlap.fence = fence  # type: ignore[method-assign]


def _blocking(trainer: Any) -> Any:
    """A callback turning ``use_jaxckpt``'s overlap off once the manager exists."""
    from transformers import TrainerCallback

    from torch_bridge.dcp import overlap

    class Blocking(TrainerCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            hook = trainer._jaxckpt_hook
            overlap.detach(hook.manager.backend)
            hook.overlap = None

    return Blocking()


def _run(variant: str, workdir: str, *, save_every: int, **shape: Any) -> dict[str, Any]:
    """One ``trainer.train()``: its seconds, and the seconds the training thread spent at
    the save points (Trainer's logging plus its save, or jaxckpt's staging) and in
    ``on_train_end`` (where jaxckpt waits for its last save to commit)."""
    from torch_bridge.integrations.transformers import use_jaxckpt

    output = tempfile.mkdtemp(dir=workdir)
    trainer = _trainer(output, save_every=None if variant == "none" else save_every, **shape)
    if variant.startswith("jaxckpt"):
        trainer = use_jaxckpt(trainer, os.path.join(output, "root"), preemption_signals=())
    spent: list[float] = []
    ending: list[float] = []
    trainer._maybe_log_save_evaluate = _timed(trainer._maybe_log_save_evaluate, spent)
    handler = trainer.callback_handler
    handler.on_train_end = _timed(handler.on_train_end, ending)
    if variant == "jaxckpt-blocking":  # staging on the training thread, as before overlap
        trainer.add_callback(_blocking(trainer))
    start = time.perf_counter()
    with _fence_timed(spent):
        trainer.train()
    run_s = time.perf_counter() - start
    shutil.rmtree(output, ignore_errors=True)
    # train_end_s: jaxckpt waits there for its last save to commit (written, checksummed,
    # fsynced); Trainer's own files may still be in the page cache.
    return {"run_s": run_s, "save_points_s": sum(spent) + sum(ending),
            "train_end_s": sum(ending), "calls_s": spent}


def _steady_per_save(runs: list[dict[str, Any]], plain: list[dict[str, Any]], steps: int,
                     save_every: int) -> float | None:
    """The training thread's seconds per save once the run is under way: at the save steps
    after the first (whose staging buffers are new) and before the last (whose save point
    comes at the epoch's end), over the same step without checkpoints; median per round,
    then over rounds. None when the run has fewer than three saves."""
    steps_at = [k * save_every - 1 for k in range(2, steps // save_every)]
    if not steps_at:
        return None
    return statistics.median(
        statistics.median(run["calls_s"][i] - base["calls_s"][i] for i in steps_at)
        for run, base in zip(runs, plain, strict=True))


def trainer_rows(*, steps: int = 40, save_every: int = 10, width: int = 256, layers: int = 4,
                 repeats: int = 3, frozen_mb: int = 0, step_ms: int = 0,
                 directory: str | None = None) -> dict[str, Any]:
    """Median seconds of each variant, and the time each loses to checkpointing: the
    training thread's time at the save points and at the end of training minus the same
    without checkpoints (per round, then the median; whole runs are reported too, but on a
    shared machine their noise hides seconds). ``train_end_s`` is the end of training's
    share (jaxckpt waits there for its last commit); ``steady_save_s`` the seconds per save
    once the run is under way (``_steady_per_save``).

    Args:
        steps: optimizer steps per run.
        save_every: steps between checkpoints (Trainer's ``save_steps``; jaxckpt follows it).
        width: the Llama's hidden size (4 heads, intermediate size 2 x width).
        layers: its decoder layers.
        repeats: rounds; the variants take turns within each, in alternating order.
        frozen_mb: MB of frozen weights added to the model (a fine-tuned frozen base): saved
            by both, untouched by the step, so the state grows and the step does not.
        step_ms: milliseconds each step sleeps before its optimizer step, standing for an
            accelerator's forward and backward during which the host's cores are free for
            the staging copy and the background write.
        directory: where runs write (a temporary directory under it); None: the system's.
    """
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    workdir = tempfile.mkdtemp(prefix="jaxckpt-bench-trainer-", dir=directory)
    shape = dict(steps=steps, width=width, layers=layers, frozen_mb=frozen_mb, step_ms=step_ms)
    variants = ["none", "trainer", "jaxckpt", "jaxckpt-blocking"]
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    # Trainer prints its logs: to stderr, so that stdout holds only the result.
    with contextlib.redirect_stdout(sys.stderr), contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, workdir, True)
        _run("none", workdir, save_every=save_every, **shape)  # warm-up: imports, allocator
        for round_index in range(repeats):
            for name in variants[::-1] if round_index % 2 else variants:
                samples[name].append(_run(name, workdir, save_every=save_every, **shape))

    def median(name: str, key: str) -> float:
        return statistics.median(sample[key] for sample in samples[name])

    lost = {name: [run["save_points_s"] - plain["save_points_s"]
                   for run, plain in zip(samples[name], samples["none"], strict=True)]
            for name in variants[1:]}
    # The whole run's extra seconds: what the background write costs the steps too.
    run_lost = {name: [run["run_s"] - plain["run_s"]
                       for run, plain in zip(samples[name], samples["none"], strict=True)]
                for name in variants[1:]}
    steady = {name: _steady_per_save(samples[name], samples["none"], steps, save_every)
              for name in variants[1:]}
    ratios = [j / t for j, t in zip(lost["jaxckpt"], lost["trainer"], strict=True) if t > 0]
    return {"shape": {**shape, "save_every": save_every, "repeats": repeats},
            "samples": samples,
            "run_s": {name: median(name, "run_s") for name in variants},
            "save_points_s": {name: median(name, "save_points_s") for name in variants},
            "train_end_s": {name: median(name, "train_end_s") for name in variants},
            "lost_s": {name: statistics.median(values) for name, values in lost.items()},
            "run_lost_s": {name: statistics.median(v) for name, v in run_lost.items()},
            "steady_save_s": steady,
            "lost_ratio_jaxckpt_to_trainer": statistics.median(ratios) if ratios else None}

if __name__ == "__main__":
    # key=value arguments: steps, save_every, width, layers, repeats, frozen_mb, step_ms (ints).
    settings: dict[str, Any] = {key: int(value) for key, value in
                                (arg.split("=", 1) for arg in sys.argv[1:])}
    print(json.dumps(trainer_rows(**settings), indent=2))
