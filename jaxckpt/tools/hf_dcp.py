"""``jaxckpt export-hf`` on a DcpCheckpointManager root: the step's DCP files to an HF directory.

Owns: the DCP branch of ``export_checkpoint_to_hf`` (``hf_cli``): the step's export record
(written by ``torch_bridge.hf_exporter(params_of=...)`` at save time) or the caller's
``config``; the writing itself is ``torch_bridge.hf.dcp_export``'s, through ``hf_cli``'s
``_write_out`` (the progress bar, an ``s3://`` / ``gs://`` out_dir staged locally then
published).

Must not import torch at import time: the bridge is imported when a DCP step is exported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jaxckpt.core.extras import requires_extra
from jaxckpt.core.layout import STATE_DIR

__all__ = ["DCP_BACKEND", "export_dcp_step"]

#: driver.json's "backend" of a checkpoint written by torch_bridge's DcpBackend.
DCP_BACKEND = "dcp"


def export_dcp_step(store: Any, step_dir: str, driver: Mapping[str, Any], out_dir: str, *,
                    target: Any, config: Any, params_of: str | None, dtype: Any,
                    max_shard_bytes: int | None, generation_config: Any, overwrite: bool,
                    progress: bool) -> int:
    """Export the committed DCP step ``step_dir`` of ``store`` (its driver.json ``driver``,
    read under the store's read lock, which the caller holds) into ``out_dir``; ``target``
    is the object store of a URL ``out_dir`` (``hf_cli._export_target``), else None.

    Args:
      store: the root's ``CheckpointStore``; step_dir: the step directory; driver: its
        driver.json.
      out_dir, target: where to write (a local directory, or a URL and its storage).
      config, params_of, dtype, max_shard_bytes, generation_config, overwrite: as
        ``torch_bridge.hf.dcp_export.export_dcp``; None takes what the step records.
      progress: show a progress bar on stderr.
    """
    from jaxckpt.storage.posix import PosixStorage

    from .hf_cli import _write_out

    feature = "jaxckpt export-hf of a DcpCheckpointManager root"
    with requires_extra("torch", feature), requires_extra("hf", feature):
        from torch_bridge.hf.dcp_export import export_dcp, recorded_export

    step_info = driver.get("step_info") or {}
    manifest = store.read_manifest(step_dir)
    # An incremental save's records may point into earlier steps' files (its refs).
    references = getattr(manifest, "refs", None) or {}

    def write(local_dir: str, bar: Any) -> int:
        return export_dcp(
            os.path.join(step_dir, STATE_DIR), local_dir,
            storage=None if isinstance(store.storage, PosixStorage) else store.storage,
            record=recorded_export(driver), config=config, params_of=params_of, dtype=dtype,
            max_shard_bytes=max_shard_bytes, generation_config=generation_config,
            overwrite=overwrite, progress=bar, references=references,
            provenance={"checkpoint": step_dir,
                        **{k: step_info[k] for k in ("epoch", "epoch_step", "global_step")
                           if k in step_info}})
    return _write_out(out_dir, target, progress, write)
