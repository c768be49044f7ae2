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

__all__ = ["lightning_rows"]


def lightning_rows(directory: str | None = None, *, hidden: int = 1024, layers: int = 4,
                   steps: int = 30, save_every: int = 5, rounds: int = 2) -> dict[str, Any]:
    """Median fit seconds per way and the time each checkpointing way lost.

    Args:
        directory: where checkpoints go (a fresh subdirectory, removed after); None: the
            system temporary directory.
        hidden: width of the MLP's square layers (``layers`` of them, Adam state on top).
        steps: optimizer steps per fit.
        save_every: ``ModelCheckpoint(every_n_train_steps=...)`` (``save_top_k=-1``).
        rounds: fits per way; the median is reported.
    """
    blocked = {"save": 0.0, "teardown": 0.0}  # training-thread seconds inside the plugin
    fit = _fitter(blocked, hidden=hidden, layers=layers, steps=steps, save_every=save_every)
    ways = ["none", "torch_io", "jaxckpt"]
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    blocking: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    work = tempfile.mkdtemp(prefix="jaxckpt-bench-lightning-", dir=directory)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit("none", work)  # warm-up: first-call costs of torch and Lightning
            for round_index in range(rounds):
                for way in ways if round_index % 2 == 0 else ways[::-1]:
                    blocked.update(save=0.0, teardown=0.0)
                    seconds[way].append(fit(way, os.path.join(work, str(round_index))))
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
            "rounds": rounds}


def _fitter(blocked: dict[str, float], *, hidden: int, layers: int, steps: int,
            save_every: int) -> Any:
    """``fit(way, work) -> seconds``: one seeded ``trainer.fit`` checkpointed ``way``
    ("none", "torch_io", "jaxckpt"); adds the plugin's blocking seconds to ``blocked``."""
    import lightning as L
    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from torch_bridge.integrations.lightning import JaxckptCheckpointIO

    def timed(cls: Any) -> Any:
        class Timed(cls):
            def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
                start = time.perf_counter()
                super().save_checkpoint(*args, **kwargs)
                blocked["save"] += time.perf_counter() - start

            def teardown(self) -> None:
                start = time.perf_counter()
                super().teardown()
                blocked["teardown"] += time.perf_counter() - start
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

    def fit(way: str, work: str) -> float:
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
        start = time.perf_counter()
        trainer.fit(Model(), loader)
        return time.perf_counter() - start

    return fit

