"""One process of a data-parallel loop whose data position is a jaxckpt.IndexSampler,
checkpointed by a real CheckpointManager over support.file_group (launched by
tests/system/test_sampler_processes.py).

Arguments: ``ROOT SYNC_DIR INDEX COUNT TOTAL_STEPS [KILL_AT]``. Prints ``FRESH`` or ``RESUMED
{step}``, then ``BATCH {json}`` per step (global step, the sampler's epoch and batch, this
process's indices), and ``DONE`` at the end; with KILL_AT it SIGKILLs itself right after the
``maybe_save`` of that global step, mid-epoch, with no final save.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

# Scripts run from tests/support, which is therefore first on sys.path.
from file_group import FileGroupBackend

from jaxckpt import CheckpointManager, Every, IndexSampler, RecoverConfig, StepInfo

SAMPLES, GLOBAL_BATCH, SEED = 52, 8, 11  # 6 global batches an epoch; 4 samples dropped
SAVE_EVERY = 2


def main(root: str, sync_dir: str, index: int, count: int, total: int,
         kill_at: int | None) -> None:
    backend = FileGroupBackend(sync_dir, index, count)
    sampler = IndexSampler(SAMPLES, GLOBAL_BATCH, seed=SEED, process_index=index,
                           process_count=count)
    state = {"trained": np.zeros((), np.int64)}
    config = RecoverConfig(every=Every(steps=SAVE_EVERY), keep_last_n=2)
    with CheckpointManager(root, recover=config, backend=backend, mode="sync",
                           preemption_signals=()) as mgr:
        recovered = mgr.recover(state, stateful={"data": sampler})
        if recovered is None:
            print("FRESH", flush=True)
            info = StepInfo(0, 0, 0, sampler.batches_per_epoch)
        else:
            print(f"RESUMED {recovered.step_info.global_step}", flush=True)
            state = recovered.state
            info = recovered.step_info.next()
        while info.global_step < total:
            indices = next(sampler)
            # The sampler and the step counters agree, whatever process count saved them.
            assert (sampler.epoch, sampler.position) == (info.epoch, info.epoch_step + 1), (
                sampler.epoch, sampler.position, info)
            state = {"trained": state["trained"] + 1}
            print("BATCH " + json.dumps({"step": info.global_step, "epoch": sampler.epoch,
                                         "batch": sampler.position - 1,
                                         "indices": indices.tolist()}), flush=True)
            mgr.maybe_save(info, state)
            if info.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            info = info.next()
    print("DONE", flush=True)


if __name__ == "__main__":
    root_arg, sync_arg, index_arg, count_arg, total_arg, *rest = sys.argv[1:]
    main(root_arg, sync_arg, int(index_arg), int(count_arg), int(total_arg),
         int(rest[0]) if rest else None)
