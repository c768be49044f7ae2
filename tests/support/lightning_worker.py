"""A Lightning run checkpointed by JaxckptCheckpointIO, for the kill test and its reference.

``python lightning_worker.py DIR [--hold-s S] [--plain] [--reference DIR2]``: a 2-layer MLP
with dropout fits synthetic data for 12 steps (6 per epoch, a shuffling StatefulDataLoader),
ModelCheckpoint every 3 steps plus ``last.ckpt`` in ``DIR/ckpt``, with ``ckpt_path="last"``.
Prints ``START n`` (the step resumed from), ``STEP n`` after each step, ``EPOCH_END e``,
``SAVED n`` when a save returned (``--hold-s``: its write then stays in flight that long),
``COMMITTED n``, ``DONE`` at the end. Appends ``{"step", "loss"}`` lines to
``DIR/losses.jsonl``; writes the final weights and Adam state to ``DIR/final.safetensors``.
``--plain``: Lightning's own TorchCheckpointIO. ``--reference DIR2``: then an uninterrupted
run with Lightning's own checkpointing in ``DIR2`` (one process start less for the test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import warnings

import lightning as L
import torch
from safetensors.torch import save_file
from torchdata.stateful_dataloader import StatefulDataLoader

STEPS, BATCH, SAMPLES = 12, 4, 24
_OUT = threading.Lock()


def _say(line: str) -> None:
    """One whole line to stdout: COMMITTED is printed from the manager's background thread,
    and print() writes the text and the newline separately, so two lines could interleave."""
    with _OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class MLP(L.LightningModule):
    def __init__(self, losses_path: str):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
        self.losses_path = losses_path

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        with open(self.losses_path, "a") as out:
            out.write(json.dumps({"step": self.global_step, "loss": loss.item().hex()}) + "\n")
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Markers(L.Callback):
    def on_train_start(self, trainer, *args):
        _say(f"START {trainer.global_step}")

    def on_train_batch_end(self, trainer, *args):
        _say(f"STEP {trainer.global_step}")

    def on_train_epoch_end(self, trainer, *args):
        _say(f"EPOCH_END {trainer.current_epoch}")


def fit(directory: str, *, jaxckpt: bool, hold_s: float = 0.0) -> None:
    """One ``trainer.fit(..., ckpt_path="last")`` from the seed, in ``directory``."""
    L.seed_everything(0, verbose=False)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 8), torch.randn(SAMPLES, 1))
    loader = StatefulDataLoader(data, batch_size=BATCH, shuffle=True,
                                generator=torch.Generator().manual_seed(1))
    model = MLP(os.path.join(directory, "losses.jsonl"))
    plugins = []
    if jaxckpt:
        from torch_bridge import DcpBackend
        from torch_bridge.integrations.lightning import JaxckptCheckpointIO

        from support.held_writes import hold_async_writes

        class Announcing(JaxckptCheckpointIO):
            def save_checkpoint(self, checkpoint, path, storage_options=None):
                super().save_checkpoint(checkpoint, path, storage_options)
                _say(f"SAVED {checkpoint['global_step']}")

        kwargs = {"on_report": lambda report: _say(f"COMMITTED {report.step}")}
        if hold_s:
            kwargs["backend"] = hold_async_writes(DcpBackend(), hold_s)
        plugins.append(Announcing(**kwargs))
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=os.path.join(directory, "ckpt"), every_n_train_steps=3, save_top_k=-1,
        save_last=True)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[checkpoints, Markers()], plugins=plugins)
    trainer.fit(model, loader, ckpt_path="last")
    optimizer = trainer.optimizers[0].state_dict()
    final = {f"model/{k}": v.contiguous() for k, v in model.state_dict().items()}
    for index, state in optimizer["state"].items():
        for key, value in state.items():
            final[f"optimizer/{index}/{key}"] = value.reshape(-1).contiguous()
    save_file(final, os.path.join(directory, "final.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--hold-s", type=float, default=0.0)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--reference", help="then an uninterrupted run with Lightning's own "
                        "checkpointing in this directory (one process less for the test)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    fit(args.dir, jaxckpt=not args.plain, hold_s=args.hold_s)
    if args.reference:
        fit(args.reference, jaxckpt=False)
    _say("DONE")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
