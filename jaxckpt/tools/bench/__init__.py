"""``jaxckpt bench``: what checkpointing costs on this machine, measured in one run on one state.

Owns: the benchmark states (about 1 GiB over 64 leaves of float32 and bfloat16 by default,
the same bytes over 10,000 leaves, the same tensors for torch, a Llama param tree for the
Hugging Face export), every measurement (physical floors, Orbax's CheckpointManager with
default options, jaxckpt sync/async save and restore, torch.save, DCP, DcpCheckpointManager,
safetensors and ``export_hf``, a training loop with async saves, host memory over repeated
saves, bytes rewritten for an unchanged auxiliary item), the targets, and the text and JSON
output.

How numbers are taken: every row is measured once per round and the rounds repeat
(``repeats``), so the rows of one round ran side by side under the same load. A ratio is
computed within each round, then the median over rounds is reported: on a shared, noisy
machine both sides of a ratio see the same noise, while absolute times across rounds may
differ several-fold. Reads are cold (the page cache is dropped before each, which needs
root) when ``/proc/sys/vm/drop_caches`` is writable, else warm for every row alike, and the
output says which. Every save row is durable (data fsynced) unless its label says
otherwise, because jaxckpt's saves are. The training-loop runs each get a fresh Python
process (``_train_in_process``), as a user's training job would.

Importing this module imports numpy only; ``run_bench`` imports jax and orbax, and the
torch rows import torch and torch_bridge lazily: without them those rows read
"unavailable" and the JAX rows still run.

Concurrency contract: ``run_bench`` is called from one thread; it creates and removes files
only under its own directory (a fresh subdirectory of ``directory``), and waits for the
training-loop processes it starts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxckpt.core.extras import requires_extra
from jaxckpt.storage.posix import fsync_file

from .floors import (
    _direct_refused,
    _files_under,
    _raw_read,
    _raw_read_direct,
    _raw_write,
    _raw_write_direct,
    _read_all,
    _touch_fresh,
)
from .local import LOCAL_ROWS, LOCAL_TARGETS, local_tier_rows

__all__ = ["BenchConfig", "BenchResult", "run_bench", "format_table", "SECTIONS"]

#: Groups of rows; ``BenchConfig.sections`` picks a subset. "first" and "leaves" are
#: in ``bench_rows_leaves``; ``jaxckpt bench --scale`` is ``bench_scale``.
SECTIONS = ("jax", "many", "leaves", "first", "torch", "hf", "train", "memory", "aux",
            "local", "multiprocess")

#: A target holds only with this margin on the median: a ">= 0.8" target needs 0.88, a
#: "<= 1.5" one 1.35. A target met only on a lucky run is not met.
MARGIN = 0.10

_MiB = 1 << 20
#: Threads of the O_DIRECT read floor and the bare read beside the restore: as many as a
#: restore reads with (``OrbaxOptions.read_threads``). Into the restore's 4 KiB pages, 4
#: threads read 512 MiB in 0.54 s where 8 took 0.40 s (the page faults are CPU work that
#: more reads in flight overlap with the disk; docs/performance.md, Tenth round (rawread)).
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
    memory_saves: int = 50
    """Async saves over which host memory (RSS) is followed."""
    hf_shard_mb: int = 256
    """``max_shard_bytes`` of the Hugging Face export, MiB."""
    sections: tuple[str, ...] = SECTIONS
    """Which groups of rows to run (see ``SECTIONS``)."""

    def __post_init__(self) -> None:
        for name in ("size_mb", "leaves", "repeats", "train_steps", "save_every",
                     "memory_saves", "hf_shard_mb", "train_batch", "leaves_mb"):
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
                    hf_shard_mb=2, leaves_mb=4, leaf_counts=(8, 64, 256))
        base.update(changes)
        return cls(**base)


# ------------------------------------------------------------------------------ results


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Row:
    key: str
    label: str
    section: str
    nbytes_of: str | None = None
    """Which state's size gives this row a throughput ("jax", "torch", "hf"), if any."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Target:
    label: str
    numerator: str
    denominator: str
    op: str
    """"<=" or ">=": how the median ratio must compare with ``limit``."""
    limit: float
    invert: bool = False
    """Ratio of throughputs: denominator time / numerator time."""
    note: str = ""


_ROWS: tuple[_Row, ...] = (
    _Row(key="copy", label="host copy of the state, fresh buffers (staging floor)",
         section="jax", nbytes_of="jax"),
    _Row(key="copy_reused", label="host copy of the state into reused buffers",
         section="jax", nbytes_of="jax"),
    _Row(key="write", label="raw write + fsync, one file", section="jax", nbytes_of="jax"),
    _Row(key="write_files", label="raw write + fsync, a file per leaf, 4 threads",
         section="jax", nbytes_of="jax"),
    _Row(key="write_direct", label="raw write + fsync, O_DIRECT, a file per leaf, 4 threads",
         section="jax", nbytes_of="jax"),
    _Row(key="read", label="raw read, one file", section="jax", nbytes_of="jax"),
    _Row(key="read_files", label="raw read, a file per leaf, 4 threads", section="jax",
         nbytes_of="jax"),
    _Row(key="read_direct", label="raw read, O_DIRECT, a file per leaf, 8 threads",
         section="jax", nbytes_of="jax"),
    _Row(key="read_direct_numpy",
         label="  the same into numpy's buffers (huge pages asked for; not a floor)",
         section="jax", nbytes_of="jax"),
    _Row(key="write_best", label="raw write floor: the fastest of the three, per round",
         section="jax", nbytes_of="jax"),
    _Row(key="read_best", label="raw read floor: the fastest of the three, per round",
         section="jax", nbytes_of="jax"),
    _Row(key="orbax_blocking", label="Orbax CheckpointManager defaults: save() blocks",
         section="jax"),
    _Row(key="orbax_save", label="Orbax CheckpointManager defaults: save, finished",
         section="jax", nbytes_of="jax"),
    _Row(key="orbax_restore", label="Orbax CheckpointManager defaults: restore",
         section="jax", nbytes_of="jax"),
    _Row(key="jx_sync", label="jaxckpt sync save, committed", section="jax",
         nbytes_of="jax"),
    _Row(key="jx_write", label="  of which OrbaxBackend.write", section="jax",
         nbytes_of="jax"),
    _Row(key="jx_commit", label="  of which the rest: commit (crc32c + fsync pass), driver",
         section="jax", nbytes_of="jax"),
    _Row(key="jx_blocking", label="jaxckpt async save: blocking", section="jax"),
    _Row(key="jx_async", label="jaxckpt async save: total, committed", section="jax",
         nbytes_of="jax"),
    _Row(key="jx_restore", label="jaxckpt restore (verify=checksums, the default)",
         section="jax", nbytes_of="jax"),
    _Row(key="jx_read", label="  OrbaxBackend.read alone (= verify=sizes)", section="jax",
         nbytes_of="jax"),
    _Row(key="jx_verify", label="  checksum verification alone", section="jax",
         nbytes_of="jax"),
    _Row(key="jx_read_bare", label="  bare read of the same files, 8 threads, next to it",
         section="jax", nbytes_of="jax"),
    _Row(key="fresh_memory", label="  page faults: touching fresh memory of the state's size",
         section="jax", nbytes_of="jax"),
    _Row(key="many_copy", label="many leaves: host copy, fresh buffers", section="many",
         nbytes_of="jax"),
    _Row(key="many_orbax_save", label="many leaves: Orbax defaults save, finished",
         section="many", nbytes_of="jax"),
    _Row(key="many_orbax_restore", label="many leaves: Orbax defaults restore",
         section="many", nbytes_of="jax"),
    _Row(key="many_jx_sync", label="many leaves: jaxckpt sync save, committed",
         section="many", nbytes_of="jax"),
    _Row(key="many_jx_blocking", label="many leaves: jaxckpt async save: blocking",
         section="many"),
    _Row(key="many_jx_restore", label="many leaves: jaxckpt restore (verify=checksums)",
         section="many", nbytes_of="jax"),
    _Row(key="lv_save_0", label="{0} leaves ({mb} MiB): jaxckpt sync save, committed",
         section="leaves", nbytes_of="leaves"),
    _Row(key="lv_save_1", label="{1} leaves, same bytes: jaxckpt sync save, committed",
         section="leaves", nbytes_of="leaves"),
    _Row(key="lv_save_2", label="{2} leaves, same bytes: jaxckpt sync save, committed",
         section="leaves", nbytes_of="leaves"),
    _Row(key="lv_restore_0", label="{0} leaves ({mb} MiB): jaxckpt restore", section="leaves",
         nbytes_of="leaves"),
    _Row(key="lv_restore_1", label="{1} leaves, same bytes: jaxckpt restore",
         section="leaves", nbytes_of="leaves"),
    _Row(key="lv_restore_2", label="{2} leaves, same bytes: jaxckpt restore",
         section="leaves", nbytes_of="leaves"),
    _Row(key="first_import", label="fresh process: import jax", section="first"),
    _Row(key="first_save", label="fresh process: first save (manager made, sync, committed)",
         section="first", nbytes_of="jax"),
    _Row(key="second_save", label="fresh process: second save, the same way",
         section="first", nbytes_of="jax"),
    _Row(key="first_restore", label="fresh process: first restore (new manager)",
         section="first", nbytes_of="jax"),
    _Row(key="torch_save", label="torch.save + fsync", section="torch", nbytes_of="torch"),
    _Row(key="dcp_save", label="dcp.save", section="torch", nbytes_of="torch"),
    _Row(key="dcp_blocking", label="dcp.async_save: blocking", section="torch"),
    _Row(key="dcp_async", label="dcp.async_save: total", section="torch", nbytes_of="torch"),
    _Row(key="dcpm_blocking", label="DcpCheckpointManager async save: blocking",
         section="torch"),
    _Row(key="dcpm_async", label="DcpCheckpointManager async save: total, committed",
         section="torch", nbytes_of="torch"),
    _Row(key="dcpm_sync", label="DcpCheckpointManager sync save, committed",
         section="torch", nbytes_of="torch"),
    _Row(key="dcp_load", label="dcp.load", section="torch", nbytes_of="torch"),
    _Row(key="dcpm_restore", label="DcpCheckpointManager restore", section="torch",
         nbytes_of="torch"),
    _Row(key="st_save", label="safetensors save_file + fsync, same tensors and shards",
         section="hf", nbytes_of="hf"),
    _Row(key="hf_export", label="torch_bridge.export_hf", section="hf", nbytes_of="hf"),
    _Row(key="train_plain", label="training loop, no checkpoints", section="train"),
    _Row(key="train_raw", label="training loop, raw write + fsync every N steps (floor)",
         section="train"),
    _Row(key="train_ckpt", label="training loop, jaxckpt async save every N steps",
         section="train"),
    _Row(key="train_ckpt_orbax_io",
         label="training loop, the same with Orbax's own writer (native_io=False)",
         section="train"),
    # bench_multiprocess: the same global bytes saved by 1 process, then by 2.
    _Row(key="mp_save_1", label="jaxckpt sync save, 1 process", section="multiprocess",
         nbytes_of="multiprocess"),
    _Row(key="mp_save_1_orbax", label="jaxckpt sync save, 1 process, Orbax's writer",
         section="multiprocess", nbytes_of="multiprocess"),
    _Row(key="mp_save_2", label="jaxckpt sync save, 2 processes, same bytes",
         section="multiprocess", nbytes_of="multiprocess"),
) + tuple(_Row(key=key, label=label, section="local") for key, label in LOCAL_ROWS)

_TARGETS: tuple[_Target, ...] = (
    _Target(label="async blocking / host copy", numerator="jx_blocking", denominator="copy",
            op="<=", limit=1.5),
    _Target(label="sync save throughput / raw write", numerator="jx_sync",
            denominator="write_best", op=">=", limit=0.8, invert=True),
    _Target(label="sync save throughput / Orbax defaults", numerator="jx_sync",
            denominator="orbax_save", op=">=", limit=2.0, invert=True),
    _Target(label="async save throughput / raw write", numerator="jx_async",
            denominator="write_best", op=">=", limit=0.8, invert=True),
    _Target(label="restore throughput / raw read", numerator="jx_restore",
            denominator="read_best", op=">=", limit=0.8, invert=True),
    _Target(label="restore throughput / bare read of its files, side by side",
            numerator="jx_restore", denominator="jx_read_bare", op=">=", limit=0.8,
            invert=True, note="the same files into fresh memory, the two taking turns"),
    _Target(label="restore throughput / Orbax defaults", numerator="jx_restore",
            denominator="orbax_restore", op=">=", limit=2.0, invert=True),
    _Target(label="backend read throughput / raw read (verify=sizes)", numerator="jx_read",
            denominator="read_best", op=">=", limit=0.8, invert=True),
    _Target(label="many leaves async blocking / their host copy",
            numerator="many_jx_blocking", denominator="many_copy", op="<=", limit=1.5),
    _Target(label="many leaves save / same bytes in few leaves", numerator="many_jx_sync",
            denominator="jx_sync", op="<=", limit=3.0),
    _Target(label="many leaves restore / same bytes in few leaves",
            numerator="many_jx_restore", denominator="jx_restore", op="<=", limit=3.0),
    _Target(label="many leaves save throughput / Orbax defaults", numerator="many_jx_sync",
            denominator="many_orbax_save", op=">=", limit=2.0, invert=True),
    _Target(label="{1} leaves save / {0} leaves, same bytes", numerator="lv_save_1",
            denominator="lv_save_0", op="<=", limit=1.5),
    _Target(label="{2} leaves save / {0} leaves, same bytes", numerator="lv_save_2",
            denominator="lv_save_0", op="<=", limit=2.0),
    _Target(label="{1} leaves restore / {0} leaves, same bytes", numerator="lv_restore_1",
            denominator="lv_restore_0", op="<=", limit=1.5),
    _Target(label="{2} leaves restore / {0} leaves, same bytes", numerator="lv_restore_2",
            denominator="lv_restore_0", op="<=", limit=2.0),
    _Target(label="DcpCheckpointManager blocking / dcp.async_save blocking",
            numerator="dcpm_blocking", denominator="dcp_blocking", op="<=", limit=1.1),
    _Target(label="DcpCheckpointManager sync save throughput / dcp.save",
            numerator="dcpm_sync", denominator="dcp_save", op=">=", limit=0.9, invert=True,
            note="the same state; the manager also commits (checksums, fsyncs)"),
    _Target(label="DcpCheckpointManager async save throughput / dcp.async_save",
            numerator="dcpm_async", denominator="dcp_async", op=">=", limit=0.9,
            invert=True, note="total time, to committed / to the future's result"),
    _Target(label="DcpCheckpointManager restore throughput / dcp.load",
            numerator="dcpm_restore", denominator="dcp_load", op=">=", limit=0.9,
            invert=True),
    _Target(label="HF export throughput / safetensors", numerator="hf_export",
            denominator="st_save", op=">=", limit=0.8, invert=True),
    _Target(label="training loop wall time with saves / without, minus 1",
            numerator="train_ckpt", denominator="train_plain", op="<=", limit=0.03),
    _Target(label="  floor: with raw write + fsync / without, minus 1",
            numerator="train_raw", denominator="train_plain", op="<=", limit=0.03,
            note="the least an async checkpoint of this state costs on this machine"),
    _Target(label="2-process save time per byte / 1 process", numerator="mp_save_2",
            denominator="mp_save_1", op="<=", limit=1.5),
    _Target(label="  the same, 1 process also through Orbax's writer", numerator="mp_save_2",
            denominator="mp_save_1_orbax", op="<=", limit=1.5,
            note="2 processes write through Orbax; this part is the second process alone"),
) + tuple(_Target(**target) for target in LOCAL_TARGETS)


@dataclasses.dataclass(kw_only=True)
class BenchResult:
    """Everything one run measured (``to_json`` gives the machine-readable form)."""

    config: BenchConfig
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Row key -> seconds, one per round."""
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)
    """Row key or section -> why it was not measured."""
    nbytes: dict[str, int] = dataclasses.field(default_factory=dict)
    """State name ("jax", "torch", "hf") -> bytes of array data."""
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Single measurements and context (cache mode, memory, aux items, loop shape)."""
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Targets that are not a ratio of two rows (memory, bytes)."""

    def add(self, key: str, seconds: float) -> None:
        self.samples.setdefault(key, []).append(float(seconds))

    def derive_floors(self) -> None:
        """``write_best``/``read_best``: per round, the fastest of the raw figures (one
        file; a file per leaf; a file per leaf with O_DIRECT, where the filesystem takes
        it). The physical limit is what the best simple approach reaches, so targets are
        taken against it."""
        for kind in ("write", "read"):
            ways = [self.samples.get(key) for key in (kind, f"{kind}_files", f"{kind}_direct")]
            ways = [way for way in ways if way]
            if len(ways) >= 2:
                self.samples[f"{kind}_best"] = [min(times) for times in zip(*ways, strict=False)]

    def median(self, key: str) -> float | None:
        values = self.samples.get(key)
        return statistics.median(values) if values else None

    def ratios(self, target: _Target) -> list[float]:
        """The per-round ratios of a target (rows measured side by side); empty when a
        side was not measured."""
        num, den = self.samples.get(target.numerator), self.samples.get(target.denominator)
        if not num or not den:
            return []
        pairs = list(zip(num, den, strict=False))
        if target.numerator in ("train_ckpt", "train_raw"):  # overhead, not a ratio
            return [n / d - 1.0 for n, d in pairs]
        if target.invert:
            return [d / n for n, d in pairs]
        return [n / d for n, d in pairs]

    def ratio(self, target: _Target) -> float | None:
        """Median over rounds of the per-round ratio (rows measured side by side)."""
        values = self.ratios(target)
        return statistics.median(values) if values else None

    def targets(self) -> list[dict[str, Any]]:
        """Every target of the selected sections: the median of its per-round ratios, their
        spread, and whether it holds, plain and with ``MARGIN``."""
        rows = []
        for target in _TARGETS:
            if _section_of(target.numerator) not in self.config.sections:
                continue
            values = self.ratios(target)
            value = statistics.median(values) if values else None
            missing = [k for k in (target.numerator, target.denominator)
                       if not self.samples.get(k)]
            why = "; ".join(self.unavailable.get(k) or self.unavailable.get(_section_of(k), "")
                            for k in missing).strip("; ")
            rows.append({"target": label_of(target.label, self.config), "value": value,
                         "spread": [min(values), max(values)] if values else None,
                         "op": target.op, "limit": target.limit,
                         "met": held(value, target.op, target.limit),
                         "met_with_margin": held(value, target.op, target.limit, MARGIN),
                         "note": why if value is None else target.note})
        return rows + self.checks

    def to_json(self) -> dict[str, Any]:
        rows = {}
        for row in _ROWS:
            median = self.median(row.key)
            nbytes = self.nbytes.get(row.nbytes_of) if row.nbytes_of else None
            samples = self.samples.get(row.key)
            rows[row.key] = {
                "label": label_of(row.label, self.config), "median_s": median,
                "samples_s": samples,
                "spread_s": [min(samples), max(samples)] if samples else None,
                "bytes": nbytes,
                "gb_per_s": nbytes / median / 1e9 if nbytes and median else None,
                "unavailable": self.unavailable.get(row.key)
                or (self.unavailable.get(row.section) if median is None else None)}
        return {"config": dataclasses.asdict(self.config), "bytes": self.nbytes,
                "facts": self.facts, "rows": rows, "targets": self.targets()}


def _section_of(key: str) -> str:
    return next((row.section for row in _ROWS if row.key == key), key)


def held(value: float | None, op: str, limit: float, margin: float = 0.0) -> bool | None:
    """Whether ``value op limit`` holds with ``margin`` to spare (``>=``: value at least
    limit x (1 + margin); ``<=``: at most limit x (1 - margin)); None without a value. A
    limit of 0 gets the margin in absolute terms."""
    if value is None:
        return None
    if op == ">=":
        return value >= (limit * (1 + margin) if limit else margin)
    return value <= (limit * (1 - margin) if limit else -margin)


def label_of(text: str, config: BenchConfig) -> str:
    """A row or target label with the configured leaf counts and size filled in."""
    return text.format(*config.leaf_counts, mb=config.leaves_mb) if "{" in text else text


def format_table(result: BenchResult) -> str:
    """The human-readable report: rows (median seconds, GB/s), then targets."""
    config = result.config
    facts = result.facts
    lines = [f"jaxckpt bench: {_size(result.nbytes.get('jax'))} state in {config.leaves} leaves "
             f"(float32 + bfloat16), {config.many_leaves} leaves for the many-leaves rows; "
             f"{config.repeats} round(s), medians",
             f"directory {facts.get('directory')}; reads: {facts.get('reads')}; "
             f"{facts.get('cpus')} CPUs; load average at start {facts.get('load_start')}, "
             f"end {facts.get('load_end')}", ""]
    table = []
    for row in _ROWS:
        if row.section not in config.sections:
            continue
        median = result.median(row.key)
        label = label_of(row.label, config)
        if median is None:
            why = result.unavailable.get(row.key) or result.unavailable.get(row.section, "-")
            table.append([label, "unavailable", "", why])
            continue
        nbytes = result.nbytes.get(row.nbytes_of) if row.nbytes_of else None
        rate = f"{nbytes / median / 1e9:.2f}" if nbytes else ""
        spread = result.samples[row.key]
        note = "" if len(spread) < 2 else f"range {min(spread):.3f}-{max(spread):.3f}"
        table.append([label, f"{median:.3f} s", rate, note])
    lines += _columns(table, ["ROW", "MEDIAN", "GB/s", "NOTE"])
    lines.append("")
    lines += _columns([_target_line(target) for target in result.targets()],
                      ["TARGET (median of per-round ratios)", "VALUE", "SPREAD", "GOAL", "MET",
                       f"MET +{MARGIN:.0%}", "NOTE"])
    for key in ("train", "memory", "aux", "hf_memory", "multiprocess"):
        if key in facts:
            lines.append(f"{key}: {json.dumps(facts[key], default=str)}")
    return "\n".join(lines)


def _target_line(target: dict[str, Any]) -> list[str]:
    """One line of the targets table."""
    percent = "minus 1" in target["target"]

    def shown(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}" if percent else f"{value:.2f}"

    spread = target.get("spread")
    limit = f"{target['limit']:.0%}" if percent else f"{target['limit']:g}"
    verdict = {None: "n/a", True: "yes", False: "NO"}
    return [target["target"], shown(target["value"]),
            f"{shown(spread[0])}-{shown(spread[1])}" if spread else "",
            f"{target['op']} {limit}", verdict[target["met"]],
            verdict[target.get("met_with_margin", target["met"])], target.get("note", "")]


def _columns(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip()
            for r in [header, *rows]]


def _size(nbytes: int | None) -> str:
    if not nbytes:
        return "?"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / _MiB:.1f} MiB"


# ------------------------------------------------------------------------- measurement


def _release_freed_memory() -> None:
    """Hand the memory this process freed back to the system (glibc's ``malloc_trim``;
    nothing elsewhere). Buffers numpy freed stay in malloc's heap, faulted in already
    (often as huge pages, which numpy asks for from 4 MiB on), and the next row's
    ``np.empty`` gets them back without a page fault: a read floor after a row that freed
    as many bytes measured reading into recycled memory, not into new memory, where a
    restore reads into maps of its own (``zarr_io.fresh_blocks``) and faults every page
    (docs/performance.md, Eighth round)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return
    trim(0)


def _settle() -> None:
    """Before a timed row: the previous row's garbage, freed memory, dirty pages and the
    discards of the files it deleted (ext4 -o discard) are not this row's cost."""
    gc.collect()
    _release_freed_memory()
    os.sync()


def _host_copies(arrays: list[Any]) -> list[np.ndarray]:
    return [np.array(a, copy=True) for a in arrays]


def _timed(action: Callable[[], Any], *, settle: bool = True) -> float:
    """Seconds ``action`` takes; first a settle (collect, hand freed memory back) unless
    ``settle`` is false (the object-store rows time without one)."""
    if settle:
        _settle()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _drop_page_cache() -> bool:
    """Write back dirty pages and evict the page cache (root only), so a read comes from
    the disk. False when the kernel refuses (not root, or a container)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _traced_peak(action: Callable[[], Any]) -> int:
    """Peak bytes of Python and numpy allocations made during ``action`` (numpy reports its
    buffers to tracemalloc; RSS cannot show a peak that reuses freed memory)."""
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _random_bytes(nbytes: int, seed: int) -> np.ndarray:
    """Incompressible data (random float32 values; no compression is applied anyway)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(-(-nbytes // 4), dtype=np.float32).view(np.uint8)[:nbytes]


def _leaf_arrays(data: np.ndarray, leaves: int) -> list[np.ndarray]:
    """Split ``data`` into ``leaves`` arrays, every fourth one bfloat16, float32 otherwise."""
    import ml_dtypes

    per = data.size // leaves
    out = []
    for index in range(leaves):
        dtype = np.dtype(ml_dtypes.bfloat16) if index % 4 == 3 else np.dtype(np.float32)
        count = max(1, per // dtype.itemsize)
        chunk = data[index * per:index * per + count * dtype.itemsize]
        out.append(chunk.view(dtype))
    return out


def _jax_state(arrays: list[np.ndarray]) -> dict[str, Any]:
    """A two-level param-like tree of jax.Arrays (``{"layer_00017": {"w": ...}}``), each
    the output of a computation, as a training step's state is: XLA's own buffers. (Arrays
    made by ``jnp.asarray`` from numpy wrote to disk 15-20% slower with O_DIRECT here, 1 GiB
    in 64 leaves, for reasons of their memory, not of the writer: docs/performance.md,
    Seventh round, item 6.)"""
    import jax
    import jax.numpy as jnp

    state = {f"layer_{index:05d}": {"w": jnp.asarray(array) + 0}
             for index, array in enumerate(arrays)}
    return jax.block_until_ready(state)


def _abstract(state: Any) -> Any:
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def _tree_bytes(state: Any) -> int:
    import jax

    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(state))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Library warnings (DCP's single-process notice, Orbax deprecations) are not results."""
    import logging

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = logging.getLogger("absl").level
        logging.getLogger("absl").setLevel(logging.ERROR)
        try:
            yield
        finally:
            logging.getLogger("absl").setLevel(previous)


class _Bench:
    """One run: the states, the long-lived managers, one method per group of rows that uses
    them (the auxiliary-item rows need only the state: ``_aux_rows``)."""

    def __init__(self, config: BenchConfig, workdir: str, result: BenchResult,
                 log: Callable[[str], None]):
        self.config = config
        self.workdir = workdir
        self.result = result
        self.log = log
        self.cold = True
        self._counter = 0
        self._closers: list[Callable[[], None]] = []
        self.direct_refused: str | None = None
        """Why the O_DIRECT floor rows cannot run here ("" when they can), once asked."""

    def fresh(self, name: str) -> str:
        self._counter += 1
        return os.path.join(self.workdir, f"{name}-{self._counter:04d}")

    def before_read(self) -> None:
        if self.cold:
            self.cold = _drop_page_cache()

    def close(self) -> None:
        for closer in reversed(self._closers):
            with contextlib.suppress(Exception):
                closer()

    # --- state ---------------------------------------------------------------------------
    def build_states(self) -> None:
        config = self.config
        data = _random_bytes(config.size_mb * _MiB, seed=0)
        self.arrays = _leaf_arrays(data, config.leaves)
        self.state = _jax_state(self.arrays)
        self.arrays = [np.asarray(leaf["w"]) for leaf in self.state.values()]  # zero-copy views
        self.result.nbytes["jax"] = sum(a.nbytes for a in self.arrays)
        self.many_state = None
        if "many" in config.sections and config.many_leaves:
            self.many_state = _jax_state(_leaf_arrays(data, config.many_leaves))
        del data
        # Reused buffers are aligned whole blocks, so the O_DIRECT floor writes from them.
        from jaxckpt.backends.orbax.zarr_io import aligned_blocks

        self.blocks = [aligned_blocks(a.nbytes) for a in self.arrays]
        self.reused = [block[:a.nbytes].view(a.dtype).reshape(a.shape)
                       for block, a in zip(self.blocks, self.arrays, strict=True)]

    # --- floors, Orbax defaults, jaxckpt on the main state ----------------------------------
    def floors(self) -> None:
        result = self.result
        result.add("copy", _timed(lambda: [np.array(a, copy=True) for a in self.arrays]))

        def copy_reused() -> None:
            for a, b in zip(self.arrays, self.reused, strict=True):
                np.copyto(b, a)

        result.add("copy_reused", _timed(copy_reused))
        path = self.fresh("raw")
        result.add("write", _timed(lambda: _raw_write(path, self.arrays)))
        self.before_read()
        result.add("read", _timed(lambda: _raw_read(path, self.result.nbytes["jax"])))
        os.unlink(path)
        # The same bytes the way Orbax lays them out: one file per leaf, written and read
        # by several threads. On this kind of machine that is faster than one stream, and
        # much steadier when other processes use the disk.
        directory = self.fresh("raw-files")
        os.makedirs(directory)
        paths = [os.path.join(directory, str(i)) for i in range(len(self.arrays))]
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            result.add("write_files", _timed(lambda: list(pool.map(
                lambda i: _raw_write(paths[i], [self.arrays[i]]), range(len(paths))))))
            self.before_read()
            result.add("read_files", _timed(lambda: list(pool.map(
                lambda i: _raw_read(paths[i], self.arrays[i].nbytes), range(len(paths))))))
            shutil.rmtree(directory)
            # And with O_DIRECT (what OrbaxBackend's native I/O uses): the device copies
            # from aligned memory, no page cache. Skipped where the filesystem refuses it.
            os.makedirs(directory)
            if self.direct_refused is None:
                self.direct_refused = _direct_refused(directory)
            if self.direct_refused:
                for key in ("write_direct", "read_direct", "read_direct_numpy"):
                    result.unavailable[key] = self.direct_refused
            else:
                self.direct_floors(pool, paths)
        shutil.rmtree(directory)

    def direct_floors(self, pool: concurrent.futures.Executor, paths: list[str]) -> None:
        """The ``O_DIRECT`` floors: written on ``pool`` from the reused buffers filled by
        the copy row, read on as many threads as a restore reads with (``_READ_THREADS``)
        into the memory a restore reads into; then the same read into numpy's memory,
        shown but not a floor: its huge pages are cheap only when freed moments before
        (docs/performance.md, "Tenth round (rawread)")."""
        result = self.result
        result.add("write_direct", _timed(lambda: list(pool.map(
            lambda i: _raw_write_direct(paths[i], self.blocks[i]), range(len(paths))))))
        sizes = [block.nbytes for block in self.blocks]
        with concurrent.futures.ThreadPoolExecutor(max_workers=_READ_THREADS) as readers:

            def read_all(numpy_memory: bool) -> list[np.ndarray]:
                read = functools.partial(_raw_read_direct, numpy_memory=numpy_memory)
                return list(readers.map(read, paths, sizes))

            for key, numpy_memory in (("read_direct", False), ("read_direct_numpy", True)):
                self.before_read()
                result.add(key, _timed(functools.partial(read_all, numpy_memory)))

    def orbax_defaults(self, state: Any, prefix: str) -> None:
        import orbax.checkpoint as ocp

        directory = self.fresh(f"orbax{prefix}")
        manager = ocp.CheckpointManager(directory)  # every option at its default
        try:
            _settle()
            start = time.perf_counter()
            manager.save(0, args=ocp.args.StandardSave(state))
            blocking = time.perf_counter() - start
            manager.wait_until_finished()
            total = time.perf_counter() - start
            if not prefix:
                self.result.add("orbax_blocking", blocking)
            self.result.add(f"{prefix}orbax_save", total)
            like = _abstract(state)
            self.before_read()
            self.result.add(f"{prefix}orbax_restore", _timed(
                lambda: manager.restore(0, args=ocp.args.StandardRestore(like))))
        finally:
            manager.close()
            shutil.rmtree(directory, ignore_errors=True)

    def jaxckpt_manager(self, name: str) -> Any:
        import jaxckpt

        manager = getattr(self, f"_manager_{name}", None)
        if manager is None:
            from ..backend_hooks import TimedBackend

            backend = TimedBackend()
            self._closers.append(backend.close)
            manager = jaxckpt.CheckpointManager(
                os.path.join(self.workdir, f"jaxckpt-{name}"),
                recover=jaxckpt.RecoverConfig(keep_last_n=1), mode="async",
                backend=backend, preemption_signals=())
            setattr(self, f"_manager_{name}", manager)
            self._closers.append(manager.close)
            setattr(self, f"_step_{name}", 0)
        return manager

    def jaxckpt_save(self, manager: Any, name: str, state: Any, *, mode: str) -> Any:
        import jaxckpt

        step = getattr(self, f"_step_{name}")
        setattr(self, f"_step_{name}", step + 1)
        _settle()
        report = manager.save(jaxckpt.StepInfo(0, step, step), state, mode=mode)
        report.wait()
        manager.wait()  # retention of the previous checkpoint is not the next row's cost
        return report

    def jaxckpt_rows(self, state: Any, prefix: str) -> None:
        from jaxckpt.core.layout import STATE_DIR

        name = prefix or "main"
        manager = self.jaxckpt_manager(name)
        if getattr(self, f"_step_{name}") == 0:  # first save: buffers, caches, directories
            self.jaxckpt_save(manager, name, state, mode="async")
        report = self.jaxckpt_save(manager, name, state, mode="sync")
        self.result.add(f"{prefix}jx_sync", report.total_s)
        if not prefix:  # the same save in its two parts: the backend's write, the rest
            write_s = manager.backend.write_s[-1]
            self.result.add("jx_write", write_s)
            self.result.add("jx_commit", report.total_s - write_s)
        report = self.jaxckpt_save(manager, name, state, mode="async")
        self.result.add(f"{prefix}jx_blocking", report.blocking_s)
        if not prefix:
            self.result.add("jx_async", report.total_s)
        like = _abstract(state)
        if prefix:
            self.before_read()
            self.result.add(f"{prefix}jx_restore", _timed(lambda: manager.restore(like)))
            return
        # The restore, the backend's read and a bare read of the very same files take turns
        # going first. Each must produce the state in fresh memory, and on this kind of VM
        # what fresh memory costs swings from one moment to the next (page faults: 0.1 to
        # 2.4 s per GiB, the "fresh_memory" row), so the figures to compare are the ones
        # taken side by side.
        files = _files_under(os.path.join(report.path, STATE_DIR))
        bare = _raw_read_direct if self.direct_refused == "" else _raw_read  # "": it works
        with concurrent.futures.ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
            rows = [("jx_restore", lambda: manager.restore(like)),
                    ("jx_read", lambda: manager.backend.read(
                        os.path.join(report.path, STATE_DIR), like)),
                    ("jx_read_bare", lambda: _read_all(pool, bare, files))]
            self._restore_turn = getattr(self, "_restore_turn", -1) + 1
            for key, action in rows[::-1] if self._restore_turn % 2 else rows:
                self.before_read()
                self.result.add(key, _timed(action))
        self.result.add("fresh_memory", _timed(lambda: _touch_fresh(self.result.nbytes["jax"])))
        self.before_read()
        self.result.add("jx_verify", _timed(
            lambda: manager.store.verify(report.path, checksums=True)))

    # --- torch ---------------------------------------------------------------------------
    def torch_rows(self) -> None:
        try:
            import torch
            import torch.distributed.checkpoint as dcp
        except ImportError as error:
            self.result.unavailable["torch"] = f"torch not installed ({error})"
            return
        if not hasattr(self, "torch_state"):
            self.torch_state = {f"layer_{i:05d}": _to_torch(torch, a)
                                for i, a in enumerate(self.arrays)}
            self.result.nbytes["torch"] = sum(t.numel() * t.element_size()
                                              for t in self.torch_state.values())
        state = self.torch_state
        result = self.result
        path = self.fresh("torch.pt")

        def torch_save() -> None:
            torch.save(state, path)
            fsync_file(path)

        result.add("torch_save", _timed(torch_save))
        directory = self.fresh("dcp")
        # Written while torch.save's file and the previous round's copy still exist, as the
        # manager's saves are (its last checkpoint is kept until the new one commits): on
        # this VM a write into blocks freed a moment before runs up to 3x faster than one
        # into blocks never written (Eighth round (d)), so both sides get the same disk.
        result.add("dcp_save", _timed(lambda: dcp.save(state, checkpoint_id=directory)))
        os.unlink(path)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        self.before_read()
        result.add("dcp_load", _timed(lambda: dcp.load(target, checkpoint_id=directory)))
        previous, self._dcp_previous = getattr(self, "_dcp_previous", None), directory
        if previous is not None:
            shutil.rmtree(previous)
        self._closers.append(lambda: shutil.rmtree(directory, ignore_errors=True))
        directory = self.fresh("dcp-async")
        _settle()
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=directory)
        result.add("dcp_blocking", time.perf_counter() - start)
        (future.upload_completion if hasattr(future, "upload_completion") else future).result()
        result.add("dcp_async", time.perf_counter() - start)
        shutil.rmtree(directory)
        self.dcp_manager_rows(state, target)

    def dcp_manager_rows(self, state: dict[str, Any], target: dict[str, Any]) -> None:
        import jaxckpt

        try:
            import torch_bridge

            manager_class = torch_bridge.DcpCheckpointManager
        except Exception as error:  # noqa: BLE001 - being written elsewhere; say why
            for key in ("dcpm_blocking", "dcpm_async", "dcpm_restore"):
                self.result.unavailable[key] = f"torch_bridge.DcpCheckpointManager: {error!r}"
            return
        manager = getattr(self, "_dcp_manager", None)
        if manager is None:
            manager = manager_class(os.path.join(self.workdir, "dcp-manager"),
                                    recover=jaxckpt.RecoverConfig(keep_last_n=1), mode="async")
            self._dcp_manager = manager
            self._dcp_step = 0
            self._closers.append(manager.close)
            manager.save(jaxckpt.StepInfo(0, 0, 0), state).wait()  # warm-up: staging memory
            manager.wait()
        self._dcp_step += 1
        step = self._dcp_step
        _settle()
        report = manager.save(jaxckpt.StepInfo(0, step, step), state)
        report.wait()
        manager.wait()
        assert report.total_s is not None  # set when the save finished (waited for above)
        self.result.add("dcpm_blocking", report.blocking_s)
        self.result.add("dcpm_async", report.total_s)
        self._dcp_step += 1
        step = self._dcp_step
        _settle()
        report = manager.save(jaxckpt.StepInfo(0, step, step), state, mode="sync")
        report.wait()
        manager.wait()
        assert report.total_s is not None  # set when the save finished (waited for above)
        self.result.add("dcpm_sync", report.total_s)
        self.before_read()
        self.result.add("dcpm_restore", _timed(lambda: manager.restore(target)))

    # --- Hugging Face --------------------------------------------------------------------
    def hf_rows(self) -> None:
        try:
            export_hf = _export_hf()
            from safetensors.numpy import load_file, save_file
        except Exception as error:  # noqa: BLE001 - being written elsewhere; say why
            self.result.unavailable["hf"] = f"torch_bridge.export_hf: {error!r}"
            return
        if not hasattr(self, "hf_params"):
            self.hf_config, self.hf_params = _llama_params(self.config.size_mb * _MiB)
            self.result.nbytes["hf"] = _tree_bytes(self.hf_params)
        shard = self.config.hf_shard_mb * _MiB
        out = self.fresh("hf")

        def export(directory: str) -> None:
            export_hf(self.hf_params, directory, arch="llama", config=self.hf_config,
                      max_shard_bytes=shard)

        self.result.add("hf_export", _timed(lambda: export(out)))
        shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
        # The same tensors, file by file, as safetensors itself writes them.
        tensors = {name: {k: np.array(v) for k, v in load_file(os.path.join(out, name)).items()}
                   for name in shards}
        baseline = self.fresh("safetensors")
        os.makedirs(baseline)

        def safetensors_save(directory: str) -> None:
            for name, items in tensors.items():
                file = os.path.join(directory, name)
                save_file(items, file, metadata={"format": "pt"})
                fsync_file(file)

        self.result.add("st_save", _timed(lambda: safetensors_save(baseline)))
        if "hf_memory" not in self.result.facts:  # once: tracing slows the calls it watches
            export_peak = _traced_peak(lambda: export(self.fresh("hf")))
            baseline_peak = _traced_peak(lambda: safetensors_save(baseline))
            self.result.facts["hf_memory"] = {
                "shard_mib": self.config.hf_shard_mb, "files": len(shards),
                "export_peak_mib": round(export_peak / _MiB, 1),
                "safetensors_peak_mib": round(baseline_peak / _MiB, 1)}
            self.result.checks.append({
                "target": "HF export peak extra memory / shard size", "op": "<=",
                "value": export_peak / shard, "limit": 1.5, "met": export_peak <= 1.5 * shard,
                "note": "peak of numpy/Python allocations during export_hf (tracemalloc)"})
        tensors.clear()  # frees the copies; the closure above keeps the (now empty) dict
        for directory in os.listdir(self.workdir):
            if directory.startswith(("hf-", "safetensors-")):
                shutil.rmtree(os.path.join(self.workdir, directory), ignore_errors=True)

    # --- training loop -------------------------------------------------------------------
    def train_rows(self) -> None:
        """Each run in its own fresh process (``_train_in_process``), the variants taking
        turns: a user's training process does not hold this benchmark's other states, and
        in one long-lived process the runs inherited its memory churn (on this VM, freed
        memory goes back to the host and costs faults again when reused)."""
        config = self.config
        facts: dict[str, Any] = {"sizes": list(config.train_sizes), "batch": config.train_batch,
                                 "steps": config.train_steps, "save_every": config.save_every,
                                 "process": "a fresh process per run"}
        variants = [("train_plain", "none"), ("train_raw", "raw"), ("train_ckpt", "jaxckpt"),
                    ("train_ckpt_orbax_io", "jaxckpt-orbax-io")]
        blocking = []
        for round_index in range(config.repeats):
            runs = {}
            for key, saver in variants[::-1] if round_index % 2 else variants:
                runs[key] = _train_in_process(config, saver, self.fresh("train"))
                self.result.add(key, runs[key]["loop_s"])
            ckpt = runs["train_ckpt"]
            blocking.append(sum(ckpt["blocking_s"]) / runs["train_plain"]["loop_s"])
            facts.update(state_bytes=ckpt["state_bytes"], saves_per_run=len(ckpt["blocking_s"]))
        plain_s = self.result.median("train_plain")
        assert plain_s is not None  # added every round above
        facts["step_ms"] = round(1000 * plain_s / max(1, config.train_steps - 1), 2)
        facts["blocking_share_of_loop"] = round(statistics.median(blocking), 4)
        self.result.facts["train"] = facts

    # --- host memory over repeated saves -------------------------------------------------
    def memory_rows(self) -> None:
        name = "memory"
        manager = self.jaxckpt_manager(name)
        rss = []
        step_state = self.state
        for _ in range(self.config.memory_saves):
            # A changed leaf per save, as in training (the arrays are new every step).
            first = next(iter(step_state))
            step_state = {**step_state, first: {"w": step_state[first]["w"] + 0}}
            self.jaxckpt_save(manager, name, step_state, mode="async")
            gc.collect()
            rss.append(_rss())
        settle = min(4, len(rss) - 1)
        growth = rss[-1] - rss[settle]
        # "Flat": allocator noise of a few MiB is not growth; a leak of one staged copy per
        # save (the failure this guards against) would be a whole state's worth.
        limit = max(16 * _MiB, self.result.nbytes["jax"] // 50)
        self.result.facts["memory"] = {
            "saves": len(rss),
            "rss_mib_sampled": [round(r / _MiB) for r in rss[::max(1, len(rss) // 10)]],
            f"growth_mib_after_save_{settle + 1}": round(growth / _MiB, 1),
            "max_minus_min_mib": round((max(rss[settle:]) - min(rss[settle:])) / _MiB, 1)}
        self.result.checks.append({
            "target": f"RSS growth over {len(rss)} async saves, MiB", "op": "<=",
            "value": growth / _MiB, "limit": limit / _MiB, "met": growth <= limit,
            "note": f"from save {settle + 1} to save {len(rss)}; limit max(16 MiB, 2% of "
                    f"the state)"})


# ------------------------------------------------------------------- auxiliary items


def _aux_rows(state: dict[str, Any], workdir: str, result: BenchResult) -> None:
    """A GRPO-style reference policy as a versioned item (``items=``), updated every
    ``every`` steps: bytes written and blocking time on saves where it did not change,
    against saves where it did. Half the state is the policy, half the reference."""
    import jaxckpt

    every = 4
    keys = list(state)
    half = max(1, len(keys) // 2)
    policy = {k: state[k] for k in keys[:half]}
    reference = {k: state[k] for k in keys[half:]}
    policy_bytes, reference_bytes = _tree_bytes(policy), _tree_bytes(reference)
    manager = jaxckpt.CheckpointManager(
        os.path.join(workdir, "jaxckpt-aux"),
        recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=1), keep_last_n=1),
        mode="async", items={"ref": jaxckpt.Every(steps=every)}, preemption_signals=())
    changed: list[tuple[int, float]] = []
    unchanged: list[tuple[int, float]] = []
    try:
        for index in range(2 * every):
            step = jaxckpt.StepInfo(0, index, index)
            report = manager.save(step, policy, items={"ref": reference})
            report.wait()
            manager.wait()
            # Version v = (step + 1) // every is new at step 0 and when (step+1) % every == 0.
            fresh = index == 0 or (index + 1) % every == 0
            assert report.bytes is not None  # set when the save finished (waited for above)
            (changed if fresh else unchanged).append((report.bytes, report.blocking_s))
    finally:
        manager.close()
    rewritten = statistics.median(b for b, _ in unchanged) - policy_bytes
    result.facts["aux"] = {
        "policy_mib": round(policy_bytes / _MiB, 1),
        "reference_mib": round(reference_bytes / _MiB, 1), "reference_every": every,
        "mib_written_when_reference_changed": [round(b / _MiB, 1) for b, _ in changed],
        "mib_written_when_unchanged": [round(b / _MiB, 1) for b, _ in unchanged],
        "blocking_s_changed": [round(t, 4) for _, t in changed],
        "blocking_s_unchanged": [round(t, 4) for _, t in unchanged]}
    share = max(0.0, rewritten) / reference_bytes
    result.checks.append({
        "target": "unchanged reference item: bytes rewritten / its size", "op": "<=",
        "value": share, "limit": 0.01, "met": share <= 0.01,
        "note": f"{rewritten / 1024:.0f} KiB a save beyond the policy's bytes: driver, "
                "tree and manifest metadata"})


def _train_manager(saver: str, root: str, every: int) -> tuple[Any, Any]:
    """The manager and backend of a "jaxckpt" / "jaxckpt-orbax-io" training run, async saves
    every ``every`` steps; (None, None) for the other savers."""
    if saver not in ("jaxckpt", "jaxckpt-orbax-io"):
        return None, None
    import jaxckpt
    from jaxckpt.backends.orbax.backend import OrbaxBackend

    os.makedirs(root, exist_ok=True)
    backend = OrbaxBackend(native_io=saver == "jaxckpt")
    manager = jaxckpt.CheckpointManager(
        root, recover=jaxckpt.RecoverConfig(every=jaxckpt.Every(steps=every), keep_last_n=1),
        mode="async", preemption_signals=(), backend=backend)
    return manager, backend


def _host_arrays(state: Any) -> list[np.ndarray]:
    """The leaves of a jax state as host arrays, typed PRNG keys as their key data. jax.Arrays
    are immutable: their host views need no copy on CPU."""
    import jax

    leaves = [jax.random.key_data(leaf)
              if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf
              for leaf in jax.tree.leaves(state)]
    return [np.asarray(leaf) for leaf in leaves]


def _train_loop(config: BenchConfig, saver: str, root: str) -> dict[str, Any]:
    """jaxckpt.tools.demo's training loop (the reference MLP with Adam on SyntheticLoader
    batches, the loss fetched every step) with a choice of checkpointing:

    - "none": no checkpoints;
    - "jaxckpt": ``CheckpointManager.maybe_save`` after every step with the state as a
      function (built only when a save is due), async saves every ``save_every`` steps
      (what a user writes);
    - "jaxckpt-orbax-io": the same with ``OrbaxBackend(native_io=False)``: Orbax and
      tensorstore write the arrays, the commit reads them back to checksum them;
    - "raw": every ``save_every`` steps a background thread writes the state's bytes to one
      file and fsyncs it (the least any async checkpoint must do: the floor).

    Times the loop from the end of step 0 (compiled) to the end of the last step, so start-up
    and the final wait for the last save are not counted on either side.
    """
    import concurrent.futures

    from flax import nnx

    import jaxckpt

    from ..demo import build_training

    steps, every = config.train_steps, config.save_every
    loader, model, optimizer, train_step = build_training(
        config.train_sizes, seed=0, batch_size=config.train_batch, steps_per_epoch=steps,
        learning_rate=1e-3)

    manager, backend = _train_manager(saver, root, every)
    writer = None
    pending: concurrent.futures.Future[None] | None = None
    blocking: list[float] = []
    state_bytes = 0
    last_report = None
    os.makedirs(root, exist_ok=True)
    if saver == "raw":
        writer = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    def raw_save(arrays: list[np.ndarray], index: int) -> None:
        _raw_write(os.path.join(root, f"state-{index % 2}"), arrays)

    start = 0.0
    try:
        for index in range(steps):
            step = jaxckpt.StepInfo(0, index, index, steps)
            x, y = loader.next_batch()
            float(train_step(model, optimizer, x, y))
            if manager is not None:
                for report in manager.maybe_save(step, lambda: nnx.state((model, optimizer)),
                                                 stateful={"loader": loader}):
                    blocking.append(report.blocking_s)
                    last_report = report
            elif writer is not None and (index + 1) % every == 0:
                began = time.perf_counter()
                if pending is not None:
                    pending.result()  # one save in flight, as the manager does
                arrays = _host_arrays(nnx.state((model, optimizer)))
                state_bytes = sum(a.nbytes for a in arrays)
                pending = writer.submit(raw_save, arrays, index)
                blocking.append(time.perf_counter() - began)
            if index == 0:
                start = time.perf_counter()
        loop_s = time.perf_counter() - start
    finally:
        if manager is not None:
            manager.close()
        if backend is not None:
            backend.close()
        if writer is not None:
            writer.shutdown(wait=True)
    if last_report is not None:
        state_bytes = last_report.bytes or 0  # known once closed: every save committed
    return {"loop_s": loop_s, "blocking_s": blocking, "state_bytes": state_bytes}


_TRAIN_FIELDS = ("train_steps", "train_sizes", "train_batch", "save_every")


def _train_in_process(config: BenchConfig, saver: str, root: str) -> dict[str, Any]:
    """``_train_loop`` run in a new Python process (same interpreter and environment);
    its result comes back as JSON on the last line of its output."""
    import subprocess

    job = {"saver": saver, "root": root,
           "config": {name: getattr(config, name) for name in _TRAIN_FIELDS}}
    # The child imports this very jaxckpt, installed or not.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inherited = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=package_parent + (os.pathsep + inherited
                                                         if inherited else ""))
    done = subprocess.run(
        [sys.executable, "-c", "from jaxckpt.tools.bench import _train_worker; _train_worker()"],
        input=json.dumps(job), capture_output=True, text=True, check=False, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the training-loop run ({saver}) failed with exit code "
                           f"{done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def _train_worker() -> None:
    """The child side of ``_train_in_process``: a job as JSON on stdin, the result as one
    JSON line on stdout."""
    job = json.load(sys.stdin)
    fields = job["config"]
    fields["train_sizes"] = tuple(fields["train_sizes"])
    with _quiet():
        result = _train_loop(BenchConfig(**fields), job["saver"], job["root"])
    print(json.dumps(result), flush=True)


def _to_torch(torch: Any, array: np.ndarray) -> Any:
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))


def _export_hf() -> Callable[..., Any]:
    import torch_bridge

    try:
        return torch_bridge.export_hf
    except AttributeError:  # not re-exported yet by torch_bridge/__init__
        from torch_bridge.hf import export_hf

        return export_hf


def _llama_params(nbytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Llama config whose float32 params total about ``nbytes``, and random params in
    jaxckpt.llm's layout (numpy leaves: the export's cost, not a device transfer's)."""
    import jax
    from flax import nnx

    from jaxckpt.llm import from_config, params_of

    # Per layer about 12 hidden^2 params (attention 4, gated MLP 3 x 8/3), plus 16 hidden^2
    # for embedding and LM head with vocab = 8 hidden: four layers make 64 hidden^2.
    layers = 4
    hidden = 64 * max(1, round(math.sqrt(nbytes / 4 / 64) / 64))
    vocab = 8 * hidden
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "hidden_size": hidden, "intermediate_size": max(64, hidden * 8 // 3 // 64 * 64),
              "num_hidden_layers": layers, "num_attention_heads": max(1, hidden // 64),
              "num_key_value_heads": max(1, hidden // 64), "vocab_size": vocab,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "rope_theta": 10000.0}
    abstract = nnx.eval_shape(lambda: from_config(config, rngs=nnx.Rngs(0)))
    shapes = params_of(abstract)
    rng = np.random.default_rng(1)
    params = jax.tree.map(
        lambda leaf: rng.standard_normal(leaf.shape, dtype=np.float32) * 0.02, shapes)
    return config, params


# ------------------------------------------------------------------------------ runner


def run_bench(config: BenchConfig, *, log: Callable[[str], None] | None = None) -> BenchResult:
    """Run every selected row ``config.repeats`` times (see the module docstring)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with requires_extra("jax", "jaxckpt bench"):
        from jax.tree_util import tree_leaves as jax_leaves

    from . import rows_leaves as bench_rows_leaves  # imports this package: not at the top

    result = BenchResult(config=config)
    parent = config.directory or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="jaxckpt-bench-", dir=parent)
    result.facts.update(directory=workdir, cpus=os.cpu_count(),
                        load_start=round(os.getloadavg()[0], 2))
    bench = _Bench(config, workdir, result, log)
    sections = config.sections
    try:
        with _quiet():
            bench.cold = _drop_page_cache()
            result.facts["reads"] = ("cold (page cache dropped before each read)" if bench.cold
                                     else "warm: drop_caches is not permitted here, every "
                                          "read row is warm alike")
            log("jaxckpt bench: building the states")
            bench.build_states()
            for round_index in range(config.repeats):
                log(f"jaxckpt bench: round {round_index + 1} of {config.repeats}")
                if "jax" in sections:
                    bench.floors()
                    bench.orbax_defaults(bench.state, "")
                    bench.jaxckpt_rows(bench.state, "")
                if "many" in sections and bench.many_state is not None:
                    many = jax_leaves(bench.many_state)
                    result.add("many_copy", _timed(functools.partial(_host_copies, many)))
                    bench.orbax_defaults(bench.many_state, "many_")
                    bench.jaxckpt_rows(bench.many_state, "many_")
                if "leaves" in sections:
                    bench_rows_leaves.leaves_rows(bench, round_index)
                if "first" in sections:
                    bench_rows_leaves.first_save_rows(bench)
                if "torch" in sections:
                    bench.torch_rows()
                if "hf" in sections:
                    bench.hf_rows()
                if "local" in sections:
                    local_tier_rows(bench.state, workdir, result)
            if "train" in sections:
                log("jaxckpt bench: training loop")
                bench.train_rows()
            if "memory" in sections:
                log(f"jaxckpt bench: host memory over {config.memory_saves} saves")
                bench.memory_rows()
            if "aux" in sections:
                _aux_rows(bench.state, workdir, result)
            if "multiprocess" in sections:
                from .multiprocess import measure

                measure(config.size_mb, workdir, result, log)
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    result.derive_floors()
    result.facts["load_end"] = round(os.getloadavg()[0], 2)
    return result
