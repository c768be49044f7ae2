"""The settings of ``jaxckpt bench``: ``BenchConfig`` and the names of its sections.

Owns: ``SECTIONS`` (the groups of rows a run may pick), ``BenchConfig`` (sizes, rounds,
sections; checked when made) and the byte and thread constants the rows share.

Must not import: jax, orbax, torch (numpy is not needed either).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["SECTIONS", "BenchConfig"]

#: Groups of rows; ``BenchConfig.sections`` picks a subset. "first" and "leaves" are
#: in ``rows_leaves``, "back" (whole restarted processes) in ``rows_back``, "torch" and
#: "hf" in ``rows_torch`` (the transformers model's "hf" rows in ``rows_hf_torch``),
#: "train" in ``training``, "incremental" in ``rows_incremental``;
#: ``jaxckpt bench --scale`` is ``scale``.
SECTIONS = ("jax", "many", "leaves", "first", "back", "torch", "hf", "train", "memory", "aux",
            "local", "multiprocess", "incremental")

_MiB = 1 << 20
#: Threads of the O_DIRECT read floor and the bare read beside the restore: as many as a
#: restore reads with (``OrbaxOptions.read_threads``): more reads in flight overlap the page
#: faults with the disk (benchmarks/results/restore-read-floor_cpu2core_2026-11-25.md).
_READ_THREADS = 8


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """What to measure, and how big."""

    directory: str | None = None
    """Where files are written (a fresh subdirectory, removed at the end); None: the system
    temporary directory. Point it at the disk your checkpoints go to."""
    size_mb: int = 1024
    """Total size of the benchmark state, MiB."""
    leaves: int = 64
    """Leaves of the main state (about ``size_mb / leaves`` MiB each)."""
    many_leaves: int = 10_000
    """Leaves of the many-small-leaves variant of the same bytes (0 skips it)."""
    repeats: int = 5
    """Rounds; every reported figure is a median over them, with its spread (min-max)."""
    leaves_mb: int = 128
    """Size of the leaf-count comparison's state ("leaves" section), MiB."""
    leaf_counts: tuple[int, int, int] = (8, 2048, 10_000)
    """Leaf counts the "leaves" section compares at equal bytes (the first is the
    baseline)."""
    train_steps: int = 200
    """Steps of each training-loop run (with and without checkpoints)."""
    train_sizes: tuple[int, ...] = (512, 2048, 2048, 512)
    """Layer widths of the training loop's MLP (jaxckpt.tools.demo.train)."""
    train_batch: int = 256
    """Batch size of the training loop."""
    save_every: int = 20
    """Steps between the training loop's async saves."""
    train_fresh_process: bool = True
    """Each training-loop run in a fresh process (False: a round's runs share one, which
    saves the start-ups where only the rows' presence matters, as in ``--quick``)."""
    memory_saves: int = 50
    """Async saves over which host memory (RSS) is followed."""
    hf_shard_mb: int = 256
    """``max_shard_bytes`` of the Hugging Face export, MiB."""
    incremental_frozen_mb: int = 1024
    """Frozen part of the "incremental" section's state (a few large leaves), MiB."""
    incremental_trained_mb: int = 16
    """Trained part of that state (changed at every save), MiB."""
    sections: tuple[str, ...] = SECTIONS
    """Which groups of rows to run (see ``SECTIONS``)."""

    def __post_init__(self) -> None:
        for name in ("size_mb", "leaves", "repeats", "train_steps", "save_every",
                     "memory_saves", "hf_shard_mb", "train_batch", "leaves_mb",
                     "incremental_frozen_mb", "incremental_trained_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BenchConfig.{name} must be an int >= 1, got {value!r}.")
        if isinstance(self.many_leaves, bool) or not isinstance(self.many_leaves, int) \
                or self.many_leaves < 0:
            raise ValueError(f"BenchConfig.many_leaves must be an int >= 0, got "
                             f"{self.many_leaves!r}.")
        if len(self.leaf_counts) != 3 or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 1
                for n in self.leaf_counts):
            raise ValueError(f"BenchConfig.leaf_counts must be three ints >= 1, got "
                             f"{self.leaf_counts!r}.")
        unknown = sorted(set(self.sections) - set(SECTIONS))
        if unknown:
            raise ValueError(f"BenchConfig.sections has unknown names {unknown}; pick from "
                             f"{list(SECTIONS)}.")
        if self.size_mb * _MiB // self.leaves < 64:
            raise ValueError(f"BenchConfig: size_mb={self.size_mb} over leaves={self.leaves} "
                             f"leaves is under 64 bytes a leaf; use fewer leaves.")

    @classmethod
    def quick(cls, **changes: Any) -> BenchConfig:
        """The tiny size CI runs to keep the benchmark working (well under a minute)."""
        base: dict[str, Any] = dict(size_mb=8, leaves=8, many_leaves=256, repeats=1, train_steps=41,
                    train_sizes=(16, 64, 64, 16), train_batch=32, memory_saves=6,
                    hf_shard_mb=2, leaves_mb=4, leaf_counts=(8, 64, 256),
                    train_fresh_process=False, incremental_frozen_mb=16,
                    incremental_trained_mb=1)
        base.update(changes)
        return cls(**base)
