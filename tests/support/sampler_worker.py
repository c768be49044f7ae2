"""One process of a data-parallel loop whose data position is a jaxckpt.IndexSampler,
checkpointed by a real manager (launched by tests/system/test_sampler_processes.py): a
CheckpointManager over support.file_group, or with ``--dcp PORT`` a DcpCheckpointManager in a
gloo process group (torch imports cost seconds per process: the test's slow variant).

Arguments: ``ROOT SYNC_DIR INDEX COUNT TOTAL_STEPS [--kill-at STEP] [--dcp PORT]``. Prints
``FRESH`` or ``RESUMED {step}``, then ``BATCH {json}`` per step (global step, the sampler's
epoch and batch, this process's indices), and ``DONE`` at the end; with ``--kill-at`` it
SIGKILLs itself right after the ``maybe_save`` of that global step, mid-epoch, with no final
save.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import sys
from typing import Any

import numpy as np

# Scripts run from tests/support, which is therefore first on sys.path.
from file_group import FileGroupBackend
from worker_lines import claim_stdout, emit

from jaxckpt import CheckpointManager, Every, IndexSampler, RecoverConfig, StepInfo

SAMPLES, GLOBAL_BATCH, SEED = 52, 8, 11  # 6 global batches an epoch; 4 samples dropped
SAVE_EVERY = 2


def open_manager(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The manager and the initial array state of the chosen kind."""
    config = RecoverConfig(every=Every(steps=SAVE_EVERY), keep_last_n=2)
    if args.dcp is None:
        backend = FileGroupBackend(args.sync_dir, args.index, args.count)
        return (CheckpointManager(args.root, recover=config, backend=backend, mode="sync",
                                  preemption_signals=()),
                {"trained": np.zeros((), np.int64)})
    import torch
    import torch.distributed as dist

    from torch_bridge import DcpBackend, DcpCheckpointManager

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.dcp}", rank=args.index,
                            world_size=args.count, timeout=datetime.timedelta(seconds=60))
    backend = DcpBackend(collective_timeout_s=60, write_timeout_s=60)
    return (DcpCheckpointManager(args.root, recover=config, backend=backend, mode="sync",
                                 preemption_signals=()),
            {"trained": torch.zeros((), dtype=torch.int64)})


def main(args: argparse.Namespace) -> None:
    index, count, total, kill_at = args.index, args.count, args.total, args.kill_at
    sampler = IndexSampler(SAMPLES, GLOBAL_BATCH, seed=SEED, process_index=index,
                           process_count=count)
    manager, state = open_manager(args)
    with manager as mgr:
        recovered = mgr.recover(state, stateful={"data": sampler})
        if recovered is None:
            emit("FRESH")
            info = StepInfo(0, 0, 0, sampler.batches_per_epoch)
        else:
            emit(f"RESUMED {recovered.step_info.global_step}")
            state = recovered.state
            info = recovered.step_info.next()
        while info.global_step < total:
            indices = next(sampler)
            # The sampler and the step counters agree, whatever process count saved them.
            assert (sampler.epoch, sampler.position) == (info.epoch, info.epoch_step + 1), (
                sampler.epoch, sampler.position, info)
            state = {"trained": state["trained"] + 1}
            emit("BATCH " + json.dumps({"step": info.global_step, "epoch": sampler.epoch,
                                        "batch": sampler.position - 1,
                                        "indices": indices.tolist()}))
            mgr.maybe_save(info, state)
            if info.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            info = info.next()
    emit("DONE")


if __name__ == "__main__":
    claim_stdout()
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("sync_dir")
    parser.add_argument("index", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("total", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--dcp", type=int, metavar="PORT")
    try:
        main(parser.parse_args())
    except BaseException:  # noqa: BLE001 - any failure, even SystemExit, must exit at once
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # never hang in a collective or a process-group shutdown after a failure
    distributed = sys.modules.get("torch.distributed")  # imported only by the --dcp variant
    if distributed is not None and distributed.is_initialized():
        with contextlib.suppress(Exception):
            distributed.destroy_process_group()
