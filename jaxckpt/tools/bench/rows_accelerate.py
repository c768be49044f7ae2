"""The Accelerate row of the trainer benchmarks: loop time lost to checkpointing with
``Accelerator.save_state`` against ``DcpCheckpointManager``, side by side.

Owns ``accelerate_rows``: the loop of docs/integrations.md's Accelerate recipe (a prepared
MLP, AdamW, a scheduler, a seedable loader, ``jaxckpt.batches``) run three ways per round (no
checkpoint, ``save_state`` every ``save_every`` steps, the manager's async ``maybe_save`` at
the same steps), in turns whose order flips every round. A run's lost time is its loop wall
time (the manager's wait for its last save included) minus the run without checkpoints;
beside it, the training thread's seconds inside the save calls. ``step_ms`` sleeps before
each optimizer step, standing for an accelerator's forward and backward.

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

__all__ = ["accelerate_rows"]

_WAYS = ("none", "accelerate", "jaxckpt")


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
    seconds: dict[str, list[float]] = {way: [] for way in _WAYS}
    blocked: dict[str, list[float]] = {way: [] for way in _WAYS}
    work = tempfile.mkdtemp(prefix="jaxckpt-bench-accelerate-", dir=directory)
    shape: dict[str, Any] = dict(hidden=hidden, layers=layers, steps=steps,
                                 save_every=save_every, step_ms=step_ms)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run("none", work, **shape)  # warm-up: first-call costs of torch and Accelerate
            for round_index in range(rounds):
                for way in _WAYS if round_index % 2 == 0 else _WAYS[::-1]:
                    wall, inside = _run(way, os.path.join(work, str(round_index)), **shape)
                    seconds[way].append(wall)
                    blocked[way].append(inside)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {way: statistics.median(values) for way, values in seconds.items()}
    lost = {way: round(max(0.0, median[way] - median["none"]), 3)
            for way in ("accelerate", "jaxckpt")}
    state_mb = layers * (hidden * hidden + hidden) * 4 * 3 / (1 << 20)  # params + AdamW
    return {"checkpoint_mb": round(state_mb, 1), "saves": steps // save_every,
            "loop_s": {way: round(value, 3) for way, value in median.items()},
            "lost_s": lost,
            "ratio": round(lost["jaxckpt"] / lost["accelerate"], 3)
            if lost["accelerate"] else None,
            "blocking_s": {way: round(statistics.median(blocked[way]), 3)
                           for way in ("accelerate", "jaxckpt")},
            "rounds": rounds}


def _run(way: str, work: str, *, hidden: int, layers: int, steps: int, save_every: int,
         step_ms: float) -> tuple[float, float]:
    """One seeded loop checkpointed ``way``: (loop wall seconds, seconds inside saves)."""
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
    if way == "jaxckpt":
        mgr = DcpCheckpointManager(os.path.join(work, way), mode="async",
                                   recover=RecoverConfig(every=Every(steps=save_every)))
    inside = 0.0
    start = time.perf_counter()
    for step, (inputs,) in batches(loader, total_steps=steps):
        loss = model(inputs).square().mean()
        optimizer.zero_grad()
        accelerator.backward(loss)
        if step_ms:
            time.sleep(step_ms / 1000)
        optimizer.step()
        scheduler.step()
        began = time.perf_counter()
        if mgr is not None:
            mgr.maybe_save(step, state)
        elif way == "accelerate" and (step.global_step + 1) % save_every == 0:
            accelerator.save_state(os.path.join(work, way, f"step_{step.global_step + 1}"))
        inside += time.perf_counter() - began
    if mgr is not None:
        began = time.perf_counter()
        mgr.close()  # the last save's write, waited for as a run's end would
        inside += time.perf_counter() - began
    return time.perf_counter() - start, inside
