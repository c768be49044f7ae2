"""The object-store rows of the torch benchmark: ``DcpCheckpointManager`` saving to and
restoring from an ``s3://`` or ``gs://`` root, against a raw upload and download of the same
bytes through the same client (the root's ``Storage``: one object, sent in parts on several
threads where the store takes parts).

Owns: ``dcp_remote_rows`` (median and spread of each row over ``repeats`` runs),
``format_rows`` and ``main`` (``python -m jaxckpt.tools.bench.dcp_remote ROOT``; the
endpoint and credentials come from the standard environment, as for the CLI). The root
should be a scratch prefix: the rows write below it and delete what they wrote.

Must not import: jax, orbax. torch and torch_bridge are imported when the rows run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from .results import report, row_line, target_row
from .timing import _timed

__all__ = ["dcp_remote_rows", "format_rows", "main"]

#: The throughput ratio (raw transfer time / manager time) each comparison should reach.
TARGET = 0.8
ROWS = ("raw_upload", "dcpm_save", "raw_download", "dcpm_restore")
LABELS = {"raw_upload": "raw upload (Storage.write)",
          "dcpm_save": "DcpCheckpointManager save (sync)",
          "raw_download": "raw download (Storage.read)",
          "dcpm_restore": "DcpCheckpointManager restore"}


def _summary(times: list[float], nbytes: int) -> dict[str, Any]:
    median = statistics.median(times)
    return {"median_s": median, "min_s": min(times), "max_s": max(times),
            "mib_per_s": nbytes / median / 2**20, "rounds": len(times), "samples_s": times}


def dcp_remote_rows(root: str, storage_options: Mapping[str, Any] | None = None, *,
                    nbytes: int = 64 << 20, tensors: int = 16,
                    repeats: int = 5) -> dict[str, Any]:
    """Each row's median, min and max seconds and MiB/s over ``repeats`` runs (after one
    warm-up round, not counted), the bytes, and the ratios save/upload and
    restore/download (throughput; 1.0 is as fast as raw)."""
    import torch

    from jaxckpt import Every, RecoverConfig, StepInfo
    from jaxckpt.storage.url import parse_root
    from torch_bridge import DcpCheckpointManager

    base = f"{root.rstrip('/')}/bench-{uuid.uuid4().hex[:8]}"
    kind, storage = parse_root(base, storage_options)
    if isinstance(storage, str):
        raise ValueError(f"{root!r}: the object-store rows need an s3:// or gs:// root, "
                         f"not a {kind} path")
    data = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    state = {f"t{i:03d}": torch.from_numpy(part.copy())
             for i, part in enumerate(np.array_split(data, tensors))}
    like = {name: torch.empty_like(tensor) for name, tensor in state.items()}
    blob = data.tobytes()
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    try:
        with DcpCheckpointManager(f"{base}/ckpt", storage_options=storage_options,
                                  recover=RecoverConfig(every=Every(steps=1), keep_last_n=None),
                                  mode="sync", preemption_signals=()) as mgr:
            # Round 0 warms both sides up and is not counted: a process's first saves are
            # slower (connections, DCP's planner caches) and moved the median
            # (benchmarks/results/dcp-s3-restore_cpu2core_2026-11-25.md); the first save
            # is the JAX bench's own row ("first"), not this one's.
            for step in range(repeats + 1):
                raw = f"{base}/raw/{step}"
                info = StepInfo(0, step, step)
                took = times if step else {row: [] for row in ROWS}
                # Each callable runs at once, inside this iteration: binding late is fine.
                took["raw_upload"].append(_timed(lambda: storage.write(raw, blob), settle=False))  # noqa: B023
                took["dcpm_save"].append(_timed(lambda: mgr.save(info, state), settle=False))  # noqa: B023
                # The save's housekeeping (retention's listings) runs in the background after
                # save() returns: let it end, so that its requests share moto with neither
                # the raw download nor the restore timed next.
                mgr.wait()
                took["raw_download"].append(_timed(lambda: storage.read(raw), settle=False))  # noqa: B023
                took["dcpm_restore"].append(
                    _timed(lambda: mgr.restore(like, step=step), settle=False))  # noqa: B023
        if not all(torch.equal(like[name], state[name]) for name in state):
            raise AssertionError("the restored tensors differ from the saved ones")
    finally:
        storage.delete_prefix(base)
    rows = {row: _summary(values, nbytes) for row, values in times.items()}
    return {"root": root, "nbytes": nbytes, "repeats": repeats, "rows": rows,
            "save_vs_upload": rows["dcpm_save"]["mib_per_s"] / rows["raw_upload"]["mib_per_s"],
            "restore_vs_download": (rows["dcpm_restore"]["mib_per_s"]
                                    / rows["raw_download"]["mib_per_s"])}


def format_rows(result: Mapping[str, Any]) -> str:
    """The rows as ``jaxckpt bench`` prints every section (``results.report``)."""
    header = [f"DCP on {result['root']}: {result['nbytes'] / 2**20:.0f} MiB; "
              f"{result['repeats']} round(s), medians"]
    rows = [row_line(LABELS[row], result["rows"][row]["samples_s"], result["nbytes"])
            for row in ROWS]
    targets = [{**target_row(label, [result[key]], ">=", TARGET, "throughput, of the medians"),
                "spread": None}
               for label, key in (("save / raw upload", "save_vs_upload"),
                                  ("restore / raw download", "restore_vs_download"))]
    return report(header, rows, targets, target_title="TARGET")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxckpt.tools.bench.dcp_remote",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="a scratch s3:// or gs:// prefix")
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(format_rows(dcp_remote_rows(args.root, nbytes=args.mib << 20,
                                      repeats=args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
