"""The Accelerate row of the trainer benchmarks: loop time lost to checkpointing with
``Accelerator.save_state`` against ``DcpCheckpointManager``, side by side.

Owns ``accelerate_rows``: the loop of docs/integrations.md's Accelerate recipe (a prepared
MLP, AdamW, a scheduler, a seedable loader, ``jaxckpt.batches``) run four ways per round (no
checkpoint, ``save_state`` every ``save_every`` steps, the manager's async ``maybe_save`` at
the same steps with ``overlap_staging`` as the recipe has it, and without it:
``jaxckpt-blocking``), in turns whose order flips every round. The lost time compared with the
target is the training thread's seconds per save once under way, as the large Trainer row's
(``rows_trainers._steady_per_save``): the save call plus the next optimizer step, where the
overlap's fence waits for the copy (over the same in the run without checkpoints);
``lost_rounds_s`` per round. Whole-loop wall times are reported beside it (on a shared
2-core machine they also hold the background write's share of the cores).
``step_ms`` sleeps before each optimizer step, standing for an accelerator's forward and
backward.

Must not import at module level: torch, accelerate, torch_bridge, jax.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

from .rows_trainers import _steady_per_save

__all__ = ["accelerate_rows"]

_WAYS = ("none", "accelerate", "jaxckpt", "jaxckpt-blocking")


def accelerate_rows(directory: str | None = None, *, hidden: int = 1024, layers: int = 4,
                    steps: int = 30, save_every: int = 5, step_ms: float = 0.0,
                    rounds: int = 2) -> dict[str, Any]:
    """Median loop seconds per way and the time each checkpointing way lost.

    Args:
        directory: where checkpoints go (a fresh subdirectory, removed after); None: the
            system temporary directory.
        hidden: width of the MLP's square layers (``layers`` of them, AdamW state on top).
        steps: optimizer steps per run.
        save_every: steps between saves (both ways save at the same steps).
        step_ms: milliseconds slept before each optimizer step (0: none).
        rounds: runs per way; the median is reported.
    """
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in _WAYS}
    work = tempfile.mkdtemp(prefix="jaxckpt-bench-accelerate-", dir=directory)
    shape: dict[str, Any] = dict(hidden=hidden, layers=layers, steps=steps,
                                 save_every=save_every, step_ms=step_ms)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run("none", work, **shape)  # warm-up: first-call costs of torch and Accelerate
            for round_index in range(rounds):
                for way in _WAYS if round_index % 2 == 0 else _WAYS[::-1]:
                    runs[way].append(_run(way, os.path.join(work, str(round_index)),
                                          **shape))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    loop = {way: statistics.median(run["loop_s"] for run in runs[way]) for way in _WAYS}
    checkpointed = ("accelerate", "jaxckpt", "jaxckpt-blocking")
    steady = {way: _steady_per_save(runs[way], runs["none"], steps, save_every)
              for way in checkpointed}
    lost = {way: None if value is None else round(value, 3) for way, value in steady.items()}
    rounds_lost = {way: [None if value is None else round(value, 3) for value in (
        _steady_per_save([run], [base], steps, save_every)
        for run, base in zip(runs[way], runs["none"], strict=True))] for way in checkpointed}
    state_mb = layers * (hidden * hidden + hidden) * 4 * 3 / (1 << 20)  # params + AdamW
    return {"checkpoint_mb": round(state_mb, 1), "saves": steps // save_every,
            "lost_s": lost, "lost_rounds_s": rounds_lost,
            "loop_s": {way: round(value, 3) for way, value in loop.items()},
            "lost_wall_s": {way: round(loop[way] - loop["none"], 3) for way in checkpointed},
            "end_s": {way: round(statistics.median(run["end_s"] for run in runs[way]), 3)
                      for way in checkpointed},
            "rounds": rounds}


def _run(way: str, work: str, *, hidden: int, layers: int, steps: int, save_every: int,
         step_ms: float) -> dict[str, Any]:
    """One seeded loop checkpointed ``way``: its wall seconds, the seconds inside the save
    calls at each step and at the end (the manager's wait for its last save)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    from jaxckpt import Every, RecoverConfig, batches
    from torch_bridge import DcpCheckpointManager

    set_seed(0)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True))
    data = torch.utils.data.TensorDataset(torch.randn(steps * 16, hidden))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                              scheduler)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    mgr = None
    if way.startswith("jaxckpt"):
        mgr = DcpCheckpointManager(os.path.join(work, way), mode="async",
                                   recover=RecoverConfig(every=Every(steps=save_every)))
        if way == "jaxckpt":
            mgr.overlap_staging(optimizer, model)
    saves: list[float] = []
    updates: list[float] = []
    start = time.perf_counter()
    for step, (inputs,) in batches(loader, total_steps=steps):
        loss = model(inputs).square().mean()
        optimizer.zero_grad()
        accelerator.backward(loss)
        if step_ms:
            time.sleep(step_ms / 1000)
        began = time.perf_counter()
        optimizer.step()  # with the overlap: waits for the last save's copy
        updates.append(time.perf_counter() - began)
        scheduler.step()
        began = time.perf_counter()
        if mgr is not None:
            mgr.maybe_save(step, state)
        elif way == "accelerate" and (step.global_step + 1) % save_every == 0:
            accelerator.save_state(os.path.join(work, way, f"step_{step.global_step + 1}"))
        saves.append(time.perf_counter() - began)
    calls = [save + update for save, update in zip(saves, updates[1:] + [0.0], strict=True)]
    began = time.perf_counter()
    if mgr is not None:
        mgr.close()  # the last save's write, waited for as a run's end would
    end = time.perf_counter()
    return {"loop_s": end - start, "calls_s": calls, "end_s": end - began}
