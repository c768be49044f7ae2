"""An Accelerate loop checkpointed by DcpCheckpointManager (docs/integrations.md, "Accelerate").

``python accelerate_worker.py ROOT OUT [--hold-s S]``: a 2-layer MLP with dropout, AdamW and a
linear LR schedule, prepared by ``accelerate.Accelerator``, trains 12 steps (6 per epoch) and
saves every 3 steps under ROOT, resuming from the newest valid checkpoint with
``skip_first_batches``. Prints ``START n`` (the first step it runs), ``LOSS n hex`` and
``STEP n`` after each step, ``SAVED n`` when a save returned (``--hold-s``: its write then
stays in flight that long), ``COMMITTED n``; writes the final weights and optimizer state
to ``OUT`` (safetensors).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from safetensors.torch import save_file

from jaxckpt import Every, RecoverConfig, StepInfo
from torch_bridge import DcpBackend, DcpCheckpointManager

_OUT = threading.Lock()


def _say(line: str) -> None:
    """One whole line to stdout: the commit callback prints from a background thread, and
    print() writes the text and the newline separately, so two lines could interleave."""
    with _OUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

STEPS = 12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("out")
    parser.add_argument("--hold-s", type=float, default=0.0)
    # "C:S": before printing STEP S, wait until the save of step C has committed, so that a
    # kill at STEP S finds it committed however slow the machine's background write is.
    parser.add_argument("--await-commit", default=None)
    args = parser.parse_args()
    set_seed(0)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True))
    data = torch.utils.data.TensorDataset(torch.randn(24, 8), torch.randn(24, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=STEPS)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                              scheduler)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    backend = DcpBackend()
    if args.hold_s:
        from support.held_writes import hold_async_writes
        hold_async_writes(backend, args.hold_s)
    committed: dict[int, threading.Event] = collections.defaultdict(threading.Event)
    awaited = tuple(int(n) for n in args.await_commit.split(":")) if args.await_commit else None

    def on_report(report) -> None:
        _say(f"COMMITTED {report.step}")
        committed[report.step].set()

    with DcpCheckpointManager(args.root, recover=RecoverConfig(every=Every(steps=3)),
                              mode="async", backend=backend, on_report=on_report) as mgr:
        recovered = mgr.recover(state)
        mgr.overlap_staging(optimizer, model)  # as docs/integrations.md's recipe
        info = recovered.step_info.next() if recovered else StepInfo(0, 0, 0, len(loader))
        _say(f"START {info.global_step}")
        while info.global_step < STEPS:
            loader.set_epoch(info.epoch)
            batches = accelerator.skip_first_batches(loader, info.epoch_step)
            for inputs, targets in batches:
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                optimizer.zero_grad()
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                _say(f"LOSS {info.global_step} {loss.item().hex()}")
                if mgr.maybe_save(info, state):
                    _say(f"SAVED {info.global_step}")
                if awaited is not None and info.global_step == awaited[1]:
                    assert committed[awaited[0]].wait(120), f"step {awaited[0]} never committed"
                _say(f"STEP {info.global_step}")
                info = info.next()
                if info.global_step >= STEPS:
                    break
    backend.close()
    final = {f"model/{k}": v.contiguous() for k, v in model.state_dict().items()}
    for index, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            final[f"optimizer/{index}/{key}"] = value.reshape(-1).contiguous()
    save_file(final, args.out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
