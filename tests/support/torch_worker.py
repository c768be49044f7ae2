"""A small PyTorch training run driven by DcpCheckpointManager, launched by test_torch_resume.

One process per rank (gloo on CPU when --world > 1). Every step appends a JSON line to
``{out}/{label}.rank{r}.jsonl`` (loss as float.hex, the sample ids of the batch); the end of a
run appends a ``final`` line with SHA-256 digests of the model, optimizer, scheduler, RNG and
sharded-table state, so the test can compare runs bit for bit.

Phases:
  train    train to --steps from the latest checkpoint under --root (or from scratch),
           optionally after an uninterrupted reference run under --reference-root, and
           optionally SIGKILL this process at --kill-point of the save of step --kill-at:
           "saving" right after maybe_save started it (the default), "written" once the
           backend's write finished (before the marker), "committed" once it is reported
           (after the marker, while retention runs).
  reshard  restore a checkpoint that --world ranks saved in --new-world ranks (default one
           process), apply the documented world-size-change rule for the data position,
           and train to the end of the epoch.

--root may be an s3:// or gs:// URL; --storage-options JSON then configures its client and
lease.

The loop follows docs/torch.md: the sampler and the loader each get their own
torch.Generator (so creating a loader iterator never draws from the global RNG), a new
iterator is made at every epoch start, and an exhausted iterator restored from a save at an
epoch's last step is replaced at once.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import posixpath
import random
import signal
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from jaxckpt import Every, RecoverConfig, StepInfo
from jaxckpt.core.layout import COMMIT_MARKER
from torch_bridge import DcpBackend, DcpCheckpointManager
from torch_bridge.dcp.backend import DcpWriteHandle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kill_points  # a sibling script: the workers run by path
from worker_lines import claim_stdout, emit

SAMPLES = 48
FEATURES = 6
BATCH = 4  # per rank
TABLE_ROWS = 8


class Samples(Dataset):
    """Deterministic features and targets; each item carries its index to track data order."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator)
        self.y = torch.randn(SAMPLES, 1, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], index


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.2),
                                  nn.Linear(16, 1))

    def forward(self, x):
        return self.body(x)


class EpochTail(Sampler[int]):
    """The documented world-size-change rule: DistributedSampler orders an epoch globally
    (seed + epoch) and deals it round-robin, so after ``offset`` samples consumed in total
    by the old world, the rest of the epoch is ``order[offset:]`` dealt over the new world."""

    def __init__(self, size: int, *, seed: int, epoch: int, offset: int, rank: int, world: int):
        generator = torch.Generator().manual_seed(seed + epoch)
        self.indices = torch.randperm(size, generator=generator).tolist()[offset:][rank::world]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def make_loader(dataset, *, rank: int, world: int, seed: int, distributed: bool = False):
    """``distributed``: order by DistributedSampler even in one process (the world-size
    change rule of docs/torch.md needs that order, whatever the world size was)."""
    if world > 1 or distributed:
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                     seed=seed, drop_last=True)
    else:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True,
                                generator=torch.Generator().manual_seed(seed + 1))
    return loader, sampler


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def digest(value) -> str:
    """SHA-256 over every tensor (bytes, dtype, shape) and plain value of a nested state."""
    hasher = hashlib.sha256()

    def feed(item, path):
        if isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item
            local = local.detach().cpu().contiguous()
            hasher.update(f"{path}:{local.dtype}:{tuple(local.shape)}:".encode())
            hasher.update(local.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(item, dict):
            for key in sorted(item, key=str):
                feed(item[key], f"{path}/{key}")
        elif isinstance(item, (list, tuple)):
            for index, element in enumerate(item):
                feed(element, f"{path}/{index}")
        else:
            hasher.update(f"{path}={item!r};".encode())

    feed(value, "")
    return hasher.hexdigest()


def unwrap(model):
    return model.module if hasattr(model, "module") else model


def state_digests(model, optimizer, scheduler, table) -> dict:
    return {
        "params": digest(unwrap(model).state_dict()),
        "optimizer": digest(optimizer.state_dict()),
        "scheduler": digest(scheduler.state_dict()),
        "table": digest(table),
    }


class Log:
    def __init__(self, out: str, label: str, rank: int):
        self.file = open(os.path.join(out, f"{label}.rank{rank}.jsonl"), "a", buffering=1)

    def write(self, **record) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())  # the process may be SIGKILLed right after



def reported(report, storage) -> None:
    """Whether the marker exists, looked up through the root's own ``storage`` (the root
    may be an s3:// or gs:// URL)."""
    marker = storage.exists(posixpath.join(report.path, COMMIT_MARKER))
    emit(f"REPORTED {report.step} {'COMMITTED' if marker else 'MISSING'}")


def build(args, rank: int, world: int):
    seed_everything(args.seed + rank)  # per-rank RNG streams (dropout differs per rank)
    torch.manual_seed(args.seed)  # same initial weights on every rank...
    model = Net()
    torch.manual_seed(args.seed + 100 + rank)  # ...then a per-rank torch stream
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        table = distribute_tensor(torch.zeros(TABLE_ROWS, 3), mesh, [Shard(0)])
    else:
        table = torch.zeros(TABLE_ROWS, 3)
    return model, optimizer, scheduler, table


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAfterWrite:
    """A write handle that SIGKILLs this process once the write finished, before the
    manager can commit it."""

    def __init__(self, handle: DcpWriteHandle):
        self.handle = handle
        self.directory = handle.directory
        self.nbytes = handle.nbytes
        self.checksums = handle.checksums

    def done(self) -> bool:
        return self.handle.done()

    def wait(self) -> None:
        self.handle.wait()
        die()


class KillingBackend(DcpBackend):
    """DcpBackend that kills the process after the write of step ``kill_step``."""

    kill_step: int | None = None

    def write(self, directory, state, *, asynchronous):
        handle = super().write(directory, state, asynchronous=asynchronous)
        if self.kill_step is not None and f"step_{self.kill_step:08d}" in directory:
            return KillAfterWrite(handle)
        return handle


def train(args, root: str, label: str, kill_at: int | None) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if args.world > 1 else (0, 1)
    log = Log(args.out, label, rank)
    dataset = Samples()
    model, optimizer, scheduler, table = build(args, rank, world)
    loader, sampler = make_loader(dataset, rank=rank, world=world, seed=args.seed,
                                  distributed=args.sampler == "distributed")
    steps_per_epoch = SAMPLES // (BATCH * world)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "table": table}
    backend = KillingBackend(collective_timeout_s=60, write_timeout_s=60)
    point = args.kill_point if kill_at is not None else None
    if point == "written":
        backend.kill_step = kill_at

    def on_report(report) -> None:
        reported(report, mgr.store.storage)
        if point == "committed" and report.kind == "recover" and report.step == kill_at:
            die()

    config = RecoverConfig(every=Every(steps=args.save_every), keep_last_n=2)
    remote = args.storage_options if "://" in root else None
    mgr = DcpCheckpointManager(root, recover=config, mode=args.mode, backend=backend,
                               storage_options=remote, on_report=on_report,
                               preemption_signals=())
    # Kill points (kill_points) apply to the run under test, never to the reference.
    kill_points.install(mgr, {k: v for k, v in os.environ.items()
                              if label != "reference" or k != "JAXCKPT_KILL_POINT"})
    with mgr:
        recovered = mgr.recover(state, stateful={"loader": loader})
        if recovered is None:
            info = StepInfo(0, 0, 0, steps_per_epoch, counters={"world_size": world,
                                                                "epoch_samples": 0})
            emit("FRESH")
        else:
            info = recovered.step_info.next()
            log.write(resumed_from=recovered.step_info.global_step)
            emit("RESUMED " + json.dumps({"step": recovered.step_info.global_step}))
        iterator = None
        last = None
        while info.global_step < args.steps:
            if iterator is None or info.epoch_step == 0:
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(info.epoch)
                iterator = iter(loader)
            batch = next(iterator, None)
            if batch is None:  # restored from a save at an epoch's last step: start the next
                iterator = iter(loader)
                batch = next(iterator)
            x, y, ids = batch
            output = model(x)
            # Python and NumPy global RNG take part too (restored by the generic driver).
            scale = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
            loss = (output - y).square().mean() * scale
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                local = table.to_local() if hasattr(table, "to_local") else table
                local.add_(loss.detach() * (rank + 1))
            epoch_samples = (0 if info.epoch_step == 0 else info.counters["epoch_samples"])
            info = info.replace(counters={"world_size": world,
                                          "epoch_samples": epoch_samples + BATCH * world})
            log.write(step=info.global_step, loss=loss.item().hex(), ids=ids.tolist())
            emit(f"STEP {info.global_step}")
            mgr.maybe_save(info, state)
            if point == "saving" and info.global_step == kill_at:
                die()
            last = info
            info = info.next()
        if last is not None:
            mgr.save(last, state, mode="sync")
    backend.close()
    full_table = table.full_tensor() if hasattr(table, "full_tensor") else table
    log.write(final=state_digests(model, optimizer, scheduler, table),
              table=[[float(v).hex() for v in row] for row in full_table.tolist()],
              rng=digest(torch.get_rng_state()))


def reshard(args) -> None:
    """Restore a checkpoint that args.world ranks saved, in --new-world ranks (this is rank
    --rank of them), and train to the end of the epoch."""
    rank, world = args.rank, args.new_world
    log = Log(args.out, "reshard", rank)
    dataset = Samples()
    model, optimizer, scheduler, table = build(args, rank, world)
    loader, _ = make_loader(dataset, rank=rank, world=world, seed=args.seed)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "table": table}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remote = args.storage_options if "://" in args.root else None
        with DcpCheckpointManager(args.root, recover=RecoverConfig(every=Every(steps=1000)),
                                  storage_options=remote, preemption_signals=()) as mgr:
            recovered = mgr.recover(state, stateful={"loader": loader})
    full_table = table.full_tensor() if hasattr(table, "full_tensor") else table
    log.write(restored=recovered.step_info.to_json(),
              digests=state_digests(model, optimizer, scheduler, table),
              table=[[float(v).hex() for v in row] for row in full_table.tolist()],
              warnings=[f"{w.category.__name__}: {w.message}" for w in caught])
    counters = recovered.step_info.counters
    if counters["world_size"] != world:
        # The rule: the restored per-rank loader position belongs to the old sharding; rebuild
        # the sampler over the rest of the epoch's global order for the new world size.
        info = recovered.step_info.next()
        epoch = recovered.step_info.epoch if info.epoch_step else info.epoch
        offset = counters["epoch_samples"] if info.epoch_step else 0
        tail = EpochTail(SAMPLES, seed=args.seed, epoch=epoch, offset=offset, rank=rank,
                         world=world)
        loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=tail, drop_last=True,
                                    generator=torch.Generator().manual_seed(args.seed + 1))
    for x, y, ids in loader:
        loss = (model(x) - y).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        log.write(ids=ids.tolist(), loss=loss.item().hex())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["train", "reshard"], required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--reference-root")
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="run")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--kill-point", choices=["saving", "written", "committed"],
                        default="saving")
    parser.add_argument("--storage-options", type=json.loads, default=None)
    parser.add_argument("--mode", default="async")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--sampler", choices=("random", "distributed"), default="random",
                        help="train, one process: RandomSampler or DistributedSampler order")
    parser.add_argument("--new-world", type=int, default=1,
                        help="reshard: how many ranks restore (this is --rank of them)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ranks = args.world if args.phase == "train" else args.new_world
    if ranks > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                rank=args.rank, world_size=ranks,
                                timeout=datetime.timedelta(seconds=60))
    try:
        if args.phase == "reshard":
            reshard(args)
        else:
            if args.reference_root:
                train(args, args.reference_root, "reference", None)
                emit("REFERENCE DONE")
            train(args, args.root, args.label, args.kill_at)
            emit("DONE")
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # never hang in a collective or a process-group shutdown after a failure
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    claim_stdout()
    main(sys.argv[1:])
