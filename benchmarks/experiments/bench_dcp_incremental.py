"""DcpBackend incremental saves against plain ones, interleaved in one process.

Rows per round (each a sync save, so the time covers hashing, writing and fsync):
  plain        a save without a base (no hashing: what incremental=False does)
  hashed       an incremental save against a base, nothing frozen (every tensor changed)
  plain-frozen / incremental-frozen: the frozen state, plain vs incremental against a base
Reports the median over rounds of each ratio and its spread, and the bytes each save wrote
(the data files the writer wrote, from the handle's checksums).

Usage (PYTHONPATH=. so that the checkout's torch_bridge is imported):
       python benchmarks/experiments/bench_dcp_incremental.py [--mib 128] [--frozen-mib 256]
       [--trained-mib 8] [--repeats 5] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from jaxckpt.backends.base import IncrementalBase
from jaxckpt.core.layout import STATE_DIR, ref_key, step_dirname
from torch_bridge import DcpBackend


def tensors(mib: int, pieces: int, seed: int, prefix: str = "w") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    each = (mib << 20) // 4 // pieces
    return {f"{prefix}{i}": torch.randn(each, generator=generator) for i in range(pieces)}


class Run:
    """Saves into one root's recover/ directory, each against the previous (its base)."""

    def __init__(self, where: str, incremental: bool):
        self.recover = tempfile.mkdtemp(dir=where)
        self.incremental = incremental
        self.backend = DcpBackend()
        self.step = 0
        # The manager of an incremental run gives its first save an empty base.
        self.base = IncrementalBase(step=-1, directory="", recover_dir=self.recover, files={})

    def save(self, state: dict[str, torch.Tensor]) -> tuple[float, int]:
        self.step += 1
        directory = os.path.join(self.recover, step_dirname(self.step), STATE_DIR)
        os.makedirs(os.path.dirname(directory))
        start = time.perf_counter()
        handle = self.backend.write(directory, {"t": state}, asynchronous=False,
                                    base=self.base if self.incremental else None)
        seconds = time.perf_counter() - start
        checksums = handle.checksums or {}
        files = {ref_key(self.step, f"{STATE_DIR}/{rel}"): entry
                 for rel, entry in checksums.items()}
        files.update(handle.references or {})
        self.base = IncrementalBase(step=self.step, directory=directory,
                                    recover_dir=self.recover, files=files)
        written = sum(e["size"] for r, e in checksums.items() if r.endswith(".distcp"))
        return seconds, written

    def close(self) -> None:
        self.backend.close()
        shutil.rmtree(self.recover)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--frozen-mib", type=int, default=256)
    parser.add_argument("--trained-mib", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/var/tmp")
    args = parser.parse_args()
    ratios: dict[str, list[float]] = {"hashed/plain": [], "incremental/plain (frozen)": []}
    sizes: dict[str, int] = {}
    for round_index in range(args.repeats):
        # nothing frozen: every tensor differs from the base's
        plain, hashed = Run(args.dir, False), Run(args.dir, True)
        for run in (plain, hashed):  # a first save each: the hashed run's base
            run.save(tensors(args.mib, 16, 0))
        times = {}
        for name, run in (("plain", plain), ("hashed", hashed)) if round_index % 2 else (
                ("hashed", hashed), ("plain", plain)):
            times[name], sizes[name] = run.save(tensors(args.mib, 16, round_index + 1))
        ratios["hashed/plain"].append(times["hashed"] / times["plain"])
        plain.close()
        hashed.close()
        # frozen + trained
        frozen = tensors(args.frozen_mib, 16, 100)
        plain, incremental = Run(args.dir, False), Run(args.dir, True)
        incremental.save({**frozen, **tensors(args.trained_mib, 4, 200, "t")})
        state = {**frozen, **tensors(args.trained_mib, 4, 300 + round_index, "t")}
        for name, run in (("plain-frozen", plain), ("incremental-frozen", incremental)):
            times[name], sizes[name] = run.save(state)
        ratios["incremental/plain (frozen)"].append(times["incremental-frozen"]
                                                    / times["plain-frozen"])
        plain.close()
        incremental.close()
        print(f"round {round_index}: " + ", ".join(f"{k} {v:.3f}s" for k, v in times.items()),
              flush=True)
    for name, values in ratios.items():
        print(f"{name}: median {statistics.median(values):.3f} "
              f"(min {min(values):.3f}, max {max(values):.3f})")
    print("bytes written per save: " + ", ".join(f"{k} {v}" for k, v in sizes.items()))


if __name__ == "__main__":
    main()
