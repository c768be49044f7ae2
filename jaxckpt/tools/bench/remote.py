"""``jaxckpt bench --root s3://...``: checkpointing to an object store against the store's
own speed, measured through the same client.

Owns: the object-store rows. Each round uploads the state's bytes as plain objects (a PUT
per leaf through the manager's own ``Storage``, ``io_threads`` at once: the floor), saves
the state with a ``CheckpointManager`` (sync, to the committed marker), downloads the plain
objects (``read_threads`` at once), restores, then deletes both prefixes. The ratio (raw time
/ jaxckpt time) is taken per round; the median and spread are held against ``TARGET``.

Imports jax and boto3 when run (``run_remote_bench``); importing this module costs numpy.

Concurrency contract: called from one thread; writes only below the given root, under
fresh prefixes that it deletes at the end.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .results import report, row_line, target_row
from .timing import _timed

__all__ = ["TARGET", "RemoteBenchConfig", "format_remote", "run_remote_bench"]

#: The ratio (raw transfer time / jaxckpt time) each row should reach.
TARGET = 0.8
_MiB = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RemoteBenchConfig:
    """What to measure against an object-store root."""

    root: str
    """The ``s3://bucket/prefix`` or ``gs://bucket/prefix`` to write below (fresh prefixes,
    deleted at the end)."""
    size_mb: int = 256
    """Size of the state, MiB."""
    leaves: int = 8
    """Leaves of the state (float32 arrays of about ``size_mb / leaves`` MiB)."""
    repeats: int = 5
    """Rounds; ratios are medians over them, with the lowest and highest."""
    io_threads: int = 4
    """Plain uploads in flight at once (the manager's writer default, ``io_threads``)."""
    read_threads: int = 8
    """Plain downloads in flight at once (the manager's reader default,
    ``read_threads``)."""

    def __post_init__(self) -> None:
        for name in ("size_mb", "leaves", "repeats", "io_threads", "read_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RemoteBenchConfig.{name} must be an int >= 1, got {value!r}.")
        if "://" not in self.root:
            raise ValueError(f"RemoteBenchConfig.root must be an object-store URL "
                             f"(s3://BUCKET/PREFIX), got {self.root!r}.")


def run_remote_bench(config: RemoteBenchConfig,
                     storage_options: Mapping[str, Any] | None = None, *,
                     log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Run every round; returns seconds per row and round, the ratios and their summary."""
    from jaxckpt.core.extras import requires_extra

    with requires_extra("jax", "jaxckpt bench --root"):
        import jax

    import jaxckpt
    from jaxckpt.storage.url import parse_root

    _, storage = parse_root(config.root, storage_options)
    if isinstance(storage, str):
        raise ValueError(f"{config.root!r} is not an object-store root")
    rng = np.random.default_rng(0)
    per_leaf = config.size_mb * _MiB // config.leaves // 4
    state = {f"w{i}": jax.numpy.asarray(rng.standard_normal(per_leaf, np.float32))
             for i in range(config.leaves)}
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in state.items()}
    blobs = [np.asarray(v).tobytes() for v in state.values()]
    nbytes = sum(len(b) for b in blobs)
    seconds: dict[str, list[float]] = {"raw_upload": [], "save": [], "raw_download": [],
                                       "restore": []}

    def one_round(pool: concurrent.futures.ThreadPoolExecutor,
                  readers: concurrent.futures.ThreadPoolExecutor) -> None:
        raw = f"{config.root}/bench-raw-{uuid.uuid4().hex[:8]}"
        managed = f"{config.root}/bench-{uuid.uuid4().hex[:8]}"
        names = [f"{raw}/leaf_{i}" for i in range(len(blobs))]
        step = jaxckpt.StepInfo(0, 1, 1, None)
        try:
            seconds["raw_upload"].append(_timed(lambda: list(pool.map(
                storage.write, names, blobs)), settle=False))
            with jaxckpt.CheckpointManager(managed, storage_options=storage_options,
                                           preemption_signals=()) as mgr:
                seconds["save"].append(_timed(lambda: mgr.save(step, state, mode="sync"),
                                              settle=False))
                seconds["raw_download"].append(_timed(lambda: list(readers.map(
                    storage.read, names)), settle=False))
                seconds["restore"].append(_timed(lambda: jax.block_until_ready(
                    mgr.restore(like).state), settle=False))
        finally:
            storage.delete_prefix(raw)
            storage.delete_prefix(managed)

    with concurrent.futures.ThreadPoolExecutor(config.io_threads) as pool, \
            concurrent.futures.ThreadPoolExecutor(config.read_threads) as readers:
        for round_index in range(config.repeats):
            log(f"jaxckpt bench --root: round {round_index + 1} of {config.repeats}")
            one_round(pool, readers)
    ratios = {"save": [r / s for r, s in zip(seconds["raw_upload"], seconds["save"],
                                             strict=True)],
              "restore": [r / s for r, s in zip(seconds["raw_download"], seconds["restore"],
                                                strict=True)]}
    return {"root": config.root, "bytes": nbytes, "leaves": config.leaves,
            "repeats": config.repeats, "seconds": seconds, "ratios": ratios,
            "summary": {name: {"median": statistics.median(values), "min": min(values),
                               "max": max(values), "target": TARGET,
                               "met": statistics.median(values) >= TARGET}
                        for name, values in ratios.items()}}


#: The label of each row of the text report.
LABELS = {"raw_upload": "raw upload: a PUT per leaf (Storage.write), io_threads at once",
          "save": "jaxckpt sync save, committed",
          "raw_download": "raw download of the same objects, read_threads at once",
          "restore": "jaxckpt restore"}


def format_remote(result: dict[str, Any]) -> str:
    """The result as ``jaxckpt bench`` prints every section (``results.report``): each row's
    median seconds and GB/s with its range, then the ratios against their target."""
    header = [f"jaxckpt bench --root {result['root']}: {result['bytes'] / _MiB:.0f} MiB in "
              f"{result['leaves']} leaves; {result['repeats']} round(s), medians"]
    rows = [row_line(LABELS[row], result["seconds"][row], result["bytes"]) for row in LABELS]
    targets = [target_row(f"{name} throughput / raw {raw}", result["ratios"][name], ">=",
                          TARGET, "the same client, bytes and transfers in flight")
               for name, raw in (("save", "upload"), ("restore", "download"))]
    return report(header, rows, targets)


def bench_command(opts: Any) -> int:
    """``jaxckpt bench --root URL`` (the ``--size-mb``, ``--leaves``, ``--repeats``,
    ``--quick`` and ``--json`` flags of ``jaxckpt bench`` apply); returns the exit code."""
    import json
    import sys

    changes = {name: value for name, value in (
        ("size_mb", opts.size_mb), ("leaves", opts.leaves), ("repeats", opts.repeats))
        if value is not None}
    if opts.quick:
        changes = {"size_mb": 4, "leaves": 4, "repeats": 1, **changes}
    try:
        config = RemoteBenchConfig(root=opts.root.rstrip("/"), **changes)
    except ValueError as exc:
        print(f"jaxckpt bench: {exc}", file=sys.stderr)
        return 2
    from ..remote_cli import storage_options

    result = run_remote_bench(config, storage_options(opts),
                              log=lambda line: print(line, file=sys.stderr))
    print(json.dumps(result, indent=1) if opts.json else format_remote(result))
    return 0
