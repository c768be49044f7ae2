"""The Lightning row of the trainer benchmarks: loop time lost to checkpointing with
Lightning's own ``TorchCheckpointIO`` against ``JaxckptCheckpointIO``, side by side.

Owns ``lightning_rows``: the same model, data and ``ModelCheckpoint`` cadence fitted three
ways per round (no checkpoint, Lightning's own, the plugin), in turns whose order flips every
round; the time a run loses is its ``trainer.fit`` wall time (the plugin's last save waited
for at teardown included) minus the run without checkpoints; beside it, the training
thread's seconds inside the plugin's ``save_checkpoint`` and ``teardown``. Not in
``jaxckpt bench --quick``: importing Lightning and three fits exceed its budget.

Must not import at module level: torch, lightning, torch_bridge, jax.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

from .timing import _cpu_clock, _lowered_threads

__all__ = ["lightning_rows"]


def lightning_rows(directory: str | None = None, *, hidden: int = 1024, layers: int = 4,
                   steps: int = 30, save_every: int = 5, rounds: int = 2,
                   background_nice: int | None = None) -> dict[str, Any]:
    """Median fit seconds per way and the time each checkpointing way lost.

    Args:
        directory: where checkpoints go (a fresh subdirectory, removed after); None: the
            system temporary directory.
        hidden: width of the MLP's square layers (``layers`` of them, Adam state on top).
        steps: optimizer steps per fit.
        save_every: ``ModelCheckpoint(every_n_train_steps=...)`` (``save_top_k=-1``).
        rounds: fits per way; the median is reported.
        background_nice: the nice value of every Python thread started meanwhile (the
            save's background threads); None: the training thread's priority.
    """
    # training-thread seconds inside the plugin, and its CPU seconds there
    blocked = {"save": 0.0, "teardown": 0.0, "cpu": 0.0}
    fit = _fitter(blocked, hidden=hidden, layers=layers, steps=steps, save_every=save_every)
    ways = ["none", "torch_io", "jaxckpt"]
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    cpu: dict[str, list[tuple[float, float, float, float]]] = {way: [] for way in ways}
    blocking: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    work = tempfile.mkdtemp(prefix="jaxckpt-bench-lightning-", dir=directory)
    try:
        with warnings.catch_warnings(), _lowered_threads(background_nice) as threads:
            warnings.simplefilter("ignore")
            fit("none", work)  # warm-up: first-call costs of torch and Lightning
            for round_index in range(rounds):
                for way in ways if round_index % 2 == 0 else ways[::-1]:
                    blocked.update(save=0.0, teardown=0.0, cpu=0.0)
                    background = threads.spent()
                    spent, used = fit(way, os.path.join(work, str(round_index)))
                    seconds[way].append(spent)
                    cpu[way].append((*used, blocked["cpu"], threads.spent() - background))
                    blocking[way].append(dict(blocked))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {way: statistics.median(values) for way, values in seconds.items()}
    lost_torch = max(0.0, median["torch_io"] - median["none"])
    lost_jaxckpt = max(0.0, median["jaxckpt"] - median["none"])
    state_mb = layers * (hidden * hidden + hidden) * 4 * 3 / (1 << 20)  # params + Adam
    return {"checkpoint_mb": round(state_mb, 1), "saves": steps // save_every,
            "fit_s": {way: round(value, 3) for way, value in median.items()},
            "lost_s": {"torch_io": round(lost_torch, 3), "jaxckpt": round(lost_jaxckpt, 3)},
            "ratio": round(lost_jaxckpt / lost_torch, 3) if lost_torch else None,
            "blocking_s": {way: {part: round(statistics.median(item[part] for item in
                                                               blocking[way]), 3)
                                 for part in ("save", "teardown")}
                           for way in ("torch_io", "jaxckpt")},
            "cpu_per_save_s": _cpu_per_save(cpu, steps // save_every),
            "rounds": rounds}


def _cpu_per_save(cpu: dict[str, list[tuple[float, float, float, float]]],
                  saves: int) -> dict[str, dict[str, float]]:
    """Per way: CPU seconds per save over the fit without checkpoints of the same round
    (median over rounds): the process's in all, the training thread's, the other threads'
    (spinning thread pools of a busy machine included), and where they are spent: the
    training thread's inside the plugin (``save_points``), the save's own Python threads'
    (``background``)."""
    def median(way: str, index: int) -> float:
        return statistics.median((run[index] - base[index]) / saves
                                 for run, base in zip(cpu[way], cpu["none"], strict=True))

    return {way: {"total": round(median(way, 0), 4), "training_thread": round(median(way, 1), 4),
                  "other_threads": round(median(way, 0) - median(way, 1), 4),
                  "save_points": round(median(way, 2), 4), "background": round(median(way, 3), 4)}
            for way in ("torch_io", "jaxckpt")}


def _fitter(blocked: dict[str, float], *, hidden: int, layers: int, steps: int,
            save_every: int) -> Any:
    """``fit(way, work) -> (seconds, (process CPU s, training thread CPU s))``: one seeded
    ``trainer.fit`` checkpointed ``way`` ("none", "torch_io", "jaxckpt"); adds the plugin's
    blocking seconds to ``blocked``."""
    import lightning as L
    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from torch_bridge.integrations.lightning import JaxckptCheckpointIO

    def timed(cls: Any) -> Any:
        class Timed(cls):
            def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
                start, start_cpu = time.perf_counter(), time.thread_time()
                super().save_checkpoint(*args, **kwargs)
                blocked["save"] += time.perf_counter() - start
                blocked["cpu"] += time.thread_time() - start_cpu

            def teardown(self) -> None:
                start, start_cpu = time.perf_counter(), time.thread_time()
                super().teardown()
                blocked["teardown"] += time.perf_counter() - start
                blocked["cpu"] += time.thread_time() - start_cpu
        return Timed

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden)
                                             for _ in range(layers)])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    def fit(way: str, work: str) -> tuple[float, tuple[float, float]]:
        L.seed_everything(0, verbose=False)
        data = torch.utils.data.TensorDataset(torch.randn(steps * 16, hidden))
        loader = torch.utils.data.DataLoader(data, batch_size=16)
        callbacks: list[Any] = []
        plugins: list[Any] = []
        if way != "none":
            callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
                dirpath=os.path.join(work, way), every_n_train_steps=save_every,
                save_top_k=-1))
            plugins.append(timed(JaxckptCheckpointIO if way == "jaxckpt"
                                 else TorchCheckpointIO)())
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=way != "none", callbacks=callbacks,
                            plugins=plugins)
        cpu, train_cpu = _cpu_clock()
        start = time.perf_counter()
        trainer.fit(Model(), loader)
        spent = time.perf_counter() - start
        cpu_after, train_cpu_after = _cpu_clock()
        return spent, (cpu_after - cpu, train_cpu_after - train_cpu)

    return fit

