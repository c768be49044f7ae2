"""Time a trainer's loop loses to checkpointing: the framework's own saving vs jaxckpt's.

Owns: ``trainer_rows`` (a Hugging Face Trainer; one process, the variants taking turns each
round: no checkpoints, Trainer's own ``checkpoint-N`` folders, ``use_jaxckpt`` at the same
cadence, and the same with its staging overlap off: ``jaxckpt-blocking``),
``lightning_large_rows`` (the same four ways for a Lightning fit: ``ModelCheckpoint`` with
Lightning's own ``TorchCheckpointIO`` against ``JaxckptCheckpointIO``) and the command line
(``python -m jaxckpt.tools.bench.rows_trainers``). Not a section of ``jaxckpt bench``:
importing transformers or Lightning alone takes longer than ``--quick`` may.

Must not import at module level: jax, orbax, torch, transformers, lightning.
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

from .timing import _cpu_clock, _lowered_threads

__all__ = ["trainer_rows", "lightning_large_rows"]


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


def _timed(fn: Any, spent: list[float], cpu: list[float] | None = None) -> Any:
    """``fn`` noting its wall seconds in ``spent`` and its thread's CPU seconds in ``cpu``."""
    def call(*args: Any, **kwargs: Any) -> Any:
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)
            if cpu is not None:
                cpu.append(time.thread_time() - start_cpu)
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


def _run(variant: str, workdir: str, *, save_every: int, threads: Any = None,
         **shape: Any) -> dict[str, Any]:
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
    save_cpu: list[float] = []
    trainer._maybe_log_save_evaluate = _timed(trainer._maybe_log_save_evaluate, spent,
                                              save_cpu)
    handler = trainer.callback_handler
    handler.on_train_end = _timed(handler.on_train_end, ending, save_cpu)
    if variant == "jaxckpt-blocking":  # staging on the training thread, as before overlap
        trainer.add_callback(_blocking(trainer))
    cpu, train_cpu = _cpu_clock()
    background = threads.spent() if threads else 0.0
    start = time.perf_counter()
    with _fence_timed(spent):
        trainer.train()
    run_s = time.perf_counter() - start
    cpu_after, train_cpu_after = _cpu_clock()
    background = (threads.spent() if threads else 0.0) - background
    shutil.rmtree(output, ignore_errors=True)
    # train_end_s: jaxckpt waits there for its last save to commit (written, checksummed,
    # fsynced); Trainer's own files may still be in the page cache.
    return {"run_s": run_s, "save_points_s": sum(spent) + sum(ending),
            "train_end_s": sum(ending), "calls_s": spent, "cpu_s": cpu_after - cpu,
            "train_cpu_s": train_cpu_after - train_cpu, "save_points_cpu_s": sum(save_cpu),
            "background_cpu_s": background}


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
                 directory: str | None = None,
                 background_nice: int | None = None) -> dict[str, Any]:
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
        background_nice: the nice value every Python thread started during the runs takes
            (the save's background threads; torch's own pool is native): None leaves them
            at the training thread's priority.
    """
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    workdir = tempfile.mkdtemp(prefix="jaxckpt-bench-trainer-", dir=directory)
    shape = dict(steps=steps, width=width, layers=layers, frozen_mb=frozen_mb, step_ms=step_ms)
    variants = ["none", "trainer", "jaxckpt", "jaxckpt-blocking"]
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    # Trainer prints its logs: to stderr, so that stdout holds only the result.
    with contextlib.redirect_stdout(sys.stderr), contextlib.ExitStack() as cleanup, \
            _lowered_threads(background_nice) as threads:
        cleanup.callback(shutil.rmtree, workdir, True)
        _run("none", workdir, save_every=save_every, **shape)  # warm-up: imports, allocator
        for round_index in range(repeats):
            for name in variants[::-1] if round_index % 2 else variants:
                samples[name].append(_run(name, workdir, save_every=save_every,
                                          threads=threads, **shape))

    return _summary(samples, variants, {**shape, "save_every": save_every,
                                        "repeats": repeats}, steps, save_every)


def _summary(samples: dict[str, list[dict[str, Any]]], variants: list[str],
             shape: dict[str, Any], steps: int, save_every: int) -> dict[str, Any]:
    """Medians of each variant's runs (``variants[0]``: the one without checkpoints, the
    baseline; ``variants[1]``: the framework's own, the ratio's denominator)."""
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
    saves = steps // save_every
    own = variants[1]
    ratios = [j / t for j, t in zip(lost["jaxckpt"], lost[own], strict=True) if t > 0]
    return {"shape": shape,
            "samples": samples,
            "run_s": {name: median(name, "run_s") for name in variants},
            "save_points_s": {name: median(name, "save_points_s") for name in variants},
            "train_end_s": {name: median(name, "train_end_s") for name in variants},
            "lost_s": {name: statistics.median(values) for name, values in lost.items()},
            "run_lost_s": {name: statistics.median(v) for name, v in run_lost.items()},
            "steady_save_s": steady,
            "cpu_per_save_s": {name: _cpu_per_save(samples[name], samples["none"], saves)
                               for name in variants[1:]},
            f"lost_ratio_jaxckpt_to_{own}": statistics.median(ratios) if ratios else None}


def _cpu_per_save(runs: list[dict[str, Any]], plain: list[dict[str, Any]],
                  saves: int) -> dict[str, float | None]:
    """CPU seconds a save costs the process, over the same run without checkpoints (per
    round, then the median): in all, on the training thread, on every other thread (these
    three include what a busy machine's spinning thread pools add), and, measured where they
    are spent: the training thread's inside the save points (``save_points``) and the save's
    own Python threads' (``background``)."""
    def per_save(key: str) -> float | None:
        values = [(run[key] - base[key]) / saves for run, base in zip(runs, plain, strict=True)
                  if key in run and key in base]
        return statistics.median(values) if values and saves else None

    total, train = per_save("cpu_s"), per_save("train_cpu_s")
    return {"total": total, "training_thread": train,
            "other_threads": None if total is None or train is None else total - train,
            "save_points": per_save("save_points_cpu_s"),
            "background": per_save("background_cpu_s")}


def _lightning_module(*, hidden: int, layers: int, frozen_mb: int, step_ms: int) -> Any:
    """A seeded MLP (``layers`` square layers, Adam), a frozen base of ``frozen_mb`` MB in
    its state dict, and ``step_ms`` of sleep before each optimizer step (inside Lightning's
    closure, after the backward: where a host waits for an accelerator)."""
    import lightning as L
    import torch

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden)
                                             for _ in range(layers)])
            if frozen_mb:  # saved with the model, untouched by the step
                self.frozen_base = torch.nn.Parameter(torch.randn(
                    frozen_mb * 2**18, generator=torch.Generator().manual_seed(1)),
                    requires_grad=False)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch[0]).square().mean()

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            time.sleep(step_ms / 1000)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam([p for p in self.parameters() if p.requires_grad],
                                    lr=1e-4)

    torch.manual_seed(0)
    return Model()


def _lightning_run(variant: str, workdir: str, *, steps: int, save_every: int,
                   **shape: Any) -> dict[str, Any]:
    """One ``trainer.fit`` checkpointed by ``ModelCheckpoint`` (``none``: ``save_top_k=0``,
    the same callback saving nothing): its seconds, the seconds the training thread spent
    in the callback's ``on_train_batch_end`` at each step (the save, and the fence's wait
    counted with the save before it) and in the checkpoint IO's ``teardown`` (where
    jaxckpt waits for its last commit)."""
    import lightning as L
    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from torch_bridge.dcp import overlap
    from torch_bridge.integrations.lightning import JaxckptCheckpointIO

    spent: list[float] = []
    ending: list[float] = []

    class Blocking(JaxckptCheckpointIO):
        def _overlap_staging(self, manager: Any, trainer: Any) -> None:
            overlap.detach(manager.backend)  # the copy on the training thread, as before

    io_class = {"jaxckpt": JaxckptCheckpointIO, "jaxckpt-blocking": Blocking}.get(
        variant, TorchCheckpointIO)

    class TimedIO(io_class):  # type: ignore[valid-type,misc]
        def teardown(self) -> None:
            start = time.perf_counter()
            try:
                super().teardown()
            finally:
                ending.append(time.perf_counter() - start)

    output = tempfile.mkdtemp(dir=workdir)
    plugin = (TimedIO(os.path.join(output, "root"), preemption_signals=())
              if variant.startswith("jaxckpt") else TimedIO())
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=os.path.join(output, "ckpt"), every_n_train_steps=save_every,
        save_top_k=0 if variant == "none" else -1)
    checkpoint.on_train_batch_end = _timed(  # type: ignore[method-assign]
        checkpoint.on_train_batch_end, spent)
    data = torch.utils.data.TensorDataset(torch.randn(steps * 16, shape["hidden"]))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[checkpoint], plugins=[plugin])
    model = _lightning_module(**shape)
    cpu, train_cpu = _cpu_clock()
    start = time.perf_counter()
    with _fence_timed(spent):
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=16))
    run_s = time.perf_counter() - start
    cpu_after, train_cpu_after = _cpu_clock()
    shutil.rmtree(output, ignore_errors=True)
    return {"run_s": run_s, "save_points_s": sum(spent) + sum(ending),
            "train_end_s": sum(ending), "calls_s": spent, "cpu_s": cpu_after - cpu,
            "train_cpu_s": train_cpu_after - train_cpu}


def lightning_large_rows(*, steps: int = 30, save_every: int = 5, hidden: int = 1024,
                         layers: int = 4, repeats: int = 3, frozen_mb: int = 256,
                         step_ms: int = 100, directory: str | None = None) -> dict[str, Any]:
    """``trainer_rows`` for Lightning: the variants ``none``, ``torch_io`` (Lightning's own
    ``torch.save``), ``jaxckpt`` (``JaxckptCheckpointIO``, its staging overlapped with the
    next step) and ``jaxckpt-blocking`` (the copy on the training thread), at the same
    ``ModelCheckpoint(every_n_train_steps=save_every)``, taking turns each round.

    Args:
        steps: optimizer steps per fit.
        save_every: steps between checkpoints.
        hidden: the MLP's width (``layers`` square layers; Adam's two moments on top).
        layers: its layers.
        repeats: rounds; the variants take turns within each, in alternating order.
        frozen_mb: MB of frozen weights in the model's state dict (saved, never stepped).
        step_ms: milliseconds each step sleeps before its optimizer step (an accelerator's
            forward and backward, the host's cores idle).
        directory: where runs write (a temporary directory under it); None: the system's.
    """
    import warnings

    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    workdir = tempfile.mkdtemp(prefix="jaxckpt-bench-lightning-", dir=directory)
    shape = dict(steps=steps, hidden=hidden, layers=layers, frozen_mb=frozen_mb,
                 step_ms=step_ms)
    variants = ["none", "torch_io", "jaxckpt", "jaxckpt-blocking"]
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with contextlib.redirect_stdout(sys.stderr), contextlib.ExitStack() as cleanup, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cleanup.callback(shutil.rmtree, workdir, True)
        _lightning_run("none", workdir, save_every=save_every, **shape)  # warm-up
        for round_index in range(repeats):
            for name in variants[::-1] if round_index % 2 else variants:
                samples[name].append(_lightning_run(name, workdir, save_every=save_every,
                                                    **shape))
    return _summary(samples, variants, {**shape, "save_every": save_every,
                                        "repeats": repeats}, steps, save_every)


if __name__ == "__main__":
    # key=value arguments: steps, save_every, width, layers, repeats, frozen_mb, step_ms (ints);
    # a first argument "lightning": lightning_large_rows (hidden= in place of width=).
    lightning = sys.argv[1:2] == ["lightning"]
    settings: dict[str, Any] = {key: int(value) for key, value in
                                (arg.split("=", 1) for arg in sys.argv[1 + lightning:])}
    rows = lightning_large_rows if lightning else trainer_rows
    print(json.dumps(rows(**settings), indent=2))
