"""The one result type of ``jaxckpt bench``: rows, targets, ``BenchResult`` and its table.

Owns: ``_Row`` and ``_Target`` (what each row measures, what each target compares),
``_ROWS`` and ``_TARGETS`` (every local section's), ``BenchResult`` (seconds per row and
round, facts, checks; ``to_json``), ``held`` (a target with its margin), and the text every
section prints (``report`` of ``row_line``s and ``target_row``s; ``format_table`` for a
``BenchResult``; ``--scale``, ``--root`` and the DCP object-store rows use the same).

A ratio is computed within each round (rows of one round ran side by side), then the
median over rounds is reported with its spread.

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any

from .config import BenchConfig, _MiB
from .local import LOCAL_ROWS, LOCAL_TARGETS
from .rows_back import BACK_PHASES
from .rows_incremental import INCREMENTAL_ROWS, INCREMENTAL_TARGETS

__all__ = ["MARGIN", "BenchResult", "format_table", "held", "label_of", "report", "row_line",
           "target_row"]


#: A target holds only with this margin on the median: a ">= 0.8" target needs 0.88, a
#: "<= 1.5" one 1.35. A target met only on a lucky run is not met.
MARGIN = 0.10



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


#: The "back" section's rows: each restarted process's whole time and its phases, then the
#: raw read of jaxckpt's files (``rows_back``).
BACK_ROWS: tuple[_Row, ...] = tuple(
    _Row(key=f"back_{who}_{key}", label=f"restart with {name}: {what}", section="back",
         nbytes_of="jax" if key == "restore" else None)
    for who, name in (("jaxckpt", "jaxckpt"), ("orbax", "Orbax"))
    for key, what in (("total", "process start to first step done"), *(
        (key, f"  {what}") for key, what in BACK_PHASES))) + (
    _Row(key="back_floor", label="restart: raw read of jaxckpt's files (floor)",
         section="back", nbytes_of="jax"),)

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
    *(_Row(key=f"{key}_{name}", label=f"fresh process, {what}: {row}", section="first",
           nbytes_of="leaves")
      for name, what in (("few", "{0} leaves ({mb} MiB)"), ("many", "{2} leaves, same bytes"))
      for key, row in (("first_save", "first save"), ("second_save", "second save"),
                       ("first_restore", "first restore (new manager)"))),
    *BACK_ROWS,
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
    _Row(key="hf_dcp_baseline", label="dcp.load into a meta-built model + save_pretrained",
         section="hf", nbytes_of="hf_dcp"),
    _Row(key="hf_dcp_export", label="jaxckpt export-hf of a DcpCheckpointManager root",
         section="hf", nbytes_of="hf_dcp"),
    _Row(key="hf_save_pretrained",
         label="transformers Llama: save_pretrained (safetensors) + fsync, same shard size",
         section="hf", nbytes_of="hf_torch"),
    _Row(key="hf_torch_export", label="  torch_bridge.export_hf of the same model",
         section="hf", nbytes_of="hf_torch"),
    _Row(key="hf_host_copy", label="  host copy of its tensors (detach().to('cpu', copy=True))",
         section="hf", nbytes_of="hf_torch"),
    _Row(key="hf_export_blocking",
         label="  DcpCheckpointManager async HF export: maybe_save blocks", section="hf"),
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
) + tuple(_Row(key=key, label=label, section="local") for key, label in LOCAL_ROWS) + tuple(
    _Row(key=key, label=label, section="incremental",
         nbytes_of=None if key.endswith("blocking") else
         "incremental_all" if "_all_" in key else "incremental")
    for key, label in INCREMENTAL_ROWS)

_TARGETS: tuple[_Target, ...] = (
    _Target(label="async blocking / host copy", numerator="jx_blocking", denominator="copy",
            op="<=", limit=1.5),
    _Target(label="sync save throughput / raw write", numerator="jx_sync",
            denominator="write_best", op=">=", limit=0.8, invert=True),
    _Target(label="sync save throughput / Orbax defaults", numerator="jx_sync",
            denominator="orbax_save", op=">=", limit=2.0, invert=True),
    _Target(label="async save throughput / raw write", numerator="jx_async",
            denominator="write_best", op=">=", limit=0.8, invert=True),
    _Target(label="sync save / O_DIRECT floor, {size} MiB in {n} leaves", numerator="jx_sync",
            denominator="write_direct", op=">=", limit=0.9, invert=True,
            note="durable, committed; floor: a file per leaf, 4 threads, fsync"),
    _Target(label="async save / O_DIRECT floor, {size} MiB in {n} leaves",
            numerator="jx_async", denominator="write_direct", op=">=", limit=0.9,
            invert=True, note="total time to the durable commit"),
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
    _Target(label="fresh process: {2} leaves first save / {0} leaves, same bytes",
            numerator="first_save_many", denominator="first_save_few", op="<=", limit=2.0,
            note="each in a fresh process: manager made, sync save committed"),
    _Target(label="fresh process: {2} leaves first restore / {0} leaves, same bytes",
            numerator="first_restore_many", denominator="first_restore_few", op="<=",
            limit=2.0, note="a new manager after the saves, in the same process"),
    _Target(label="back to training: jaxckpt restart / Orbax restart, whole process",
            numerator="back_jaxckpt_total", denominator="back_orbax_total", op="<=",
            limit=0.8, note="process start to first step done, both restoring the state"),
    _Target(label="back to training: jaxckpt restore phase / raw read of its files",
            numerator="back_jaxckpt_restore", denominator="back_floor", op="<=", limit=1.2,
            note="manager made, checkpoint found, read, verified, on the device"),
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
    _Target(label="export-hf from a DCP root throughput / dcp.load + save_pretrained",
            numerator="hf_dcp_export", denominator="hf_dcp_baseline", op=">=", limit=1.0,
            invert=True, note="export-hf also verifies the step's checksums first"),
    _Target(label="torch HF export throughput / save_pretrained", numerator="hf_torch_export",
            denominator="hf_save_pretrained", op=">=", limit=1.0, invert=True,
            note="same model and shard size; both fsynced"),
    _Target(label="async HF export blocking / host copy of its tensors",
            numerator="hf_export_blocking", denominator="hf_host_copy", op="<=", limit=1.5),
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
) + tuple(_Target(**target) for target in LOCAL_TARGETS + INCREMENTAL_TARGETS)


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
            row = target_row(label_of(target.label, self.config), self.ratios(target),
                             target.op, target.limit, target.note)
            if row["value"] is None:
                missing = [k for k in (target.numerator, target.denominator)
                           if not self.samples.get(k)]
                row["note"] = "; ".join(self.unavailable.get(k)
                                        or self.unavailable.get(_section_of(k), "")
                                        for k in missing).strip("; ")
            rows.append(row)
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
    """A row or target label with the configured leaf counts and sizes filled in ({0}-{2}
    and {mb}: the "leaves" section's; {size} and {n}: the main state's MiB and leaves)."""
    if "{" not in text:
        return text
    return text.format(*config.leaf_counts, mb=config.leaves_mb, size=config.size_mb,
                       n=config.leaves)


def format_table(result: BenchResult) -> str:
    """The human-readable report: rows (median seconds, GB/s), then targets."""
    config = result.config
    facts = result.facts
    header = [f"jaxckpt bench: {_size(result.nbytes.get('jax'))} state in {config.leaves} "
              f"leaves (float32 + bfloat16), {config.many_leaves} leaves for the many-leaves "
              f"rows; {config.repeats} round(s), medians",
              f"directory {facts.get('directory')}; reads: {facts.get('reads')}; "
              f"{facts.get('cpus')} CPUs; load average at start {facts.get('load_start')}, "
              f"end {facts.get('load_end')}"]
    table = []
    for row in _ROWS:
        if row.section not in config.sections:
            continue
        why = result.unavailable.get(row.key) or result.unavailable.get(row.section, "-")
        table.append(row_line(label_of(row.label, config), result.samples.get(row.key),
                              result.nbytes.get(row.nbytes_of) if row.nbytes_of else None, why))
    footer = [f"{key}: {json.dumps(facts[key], default=str)}"
              for key in ("train", "memory", "aux", "hf_memory", "hf_torch_memory",
                            "multiprocess", "incremental") if key in facts]
    return report(header, table, result.targets(), footer)


def target_row(label: str, values: list[float], op: str, limit: float, note: str = "", *,
               worst: bool = False) -> dict[str, Any]:
    """A target as every section reports it: the median of ``values`` (per-round ratios;
    with ``worst``, the largest), their spread, whether it holds, plain and with
    ``MARGIN``; the keys of ``BenchResult.targets``' entries."""
    value = (max(values) if worst else statistics.median(values)) if values else None
    return {"target": label, "value": value,
            "spread": [min(values), max(values)] if values else None, "op": op,
            "limit": limit, "met": held(value, op, limit),
            "met_with_margin": held(value, op, limit, MARGIN), "note": note}


def row_line(label: str, seconds: list[float] | None, nbytes: int | None = None,
             why: str = "-") -> list[str]:
    """One line of the rows table: the median of ``seconds`` (one per round), GB/s where
    the row moves ``nbytes``, the range over rounds; "unavailable" and ``why`` without
    any."""
    if not seconds:
        return [label, "unavailable", "", why]
    median = statistics.median(seconds)
    rate = f"{nbytes / median / 1e9:.2f}" if nbytes else ""
    note = "" if len(seconds) < 2 else f"range {min(seconds):.3f}-{max(seconds):.3f}"
    return [label, f"{median:.3f} s", rate, note]


def report(header: list[str], rows: list[list[str]], targets: list[dict[str, Any]],
           footer: list[str] | None = None, *,
           target_title: str = "TARGET (median of per-round ratios)") -> str:
    """The text every section of ``jaxckpt bench`` prints: ``header`` lines, the rows table
    (``row_line``s; none: no table), the targets table (``target_row``s), ``footer``
    lines."""
    lines = [*header, ""]
    if rows:
        lines += [*_columns(rows, ["ROW", "MEDIAN", "GB/s", "NOTE"]), ""]
    lines += _columns([_target_line(target) for target in targets],
                      [target_title, "VALUE", "SPREAD", "GOAL", "MET", f"MET +{MARGIN:.0%}",
                       "NOTE"])
    return "\n".join([*lines, *(footer or [])])


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
