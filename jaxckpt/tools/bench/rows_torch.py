"""The "torch" and "hf" rows of ``jaxckpt bench``: torch.save, DCP and the Hugging Face export.

Owns: ``_TorchRows`` (the torch copy of the state, the long-lived ``DcpCheckpointManager``
and the Llama params, kept across rounds): torch.save, dcp.save/load/async_save and the
manager's saves and restore on the same tensors; ``export_hf`` against safetensors writing
the same shards, and its peak memory.

Must not import at module level: torch, torch_bridge, jax (without them the rows read
"unavailable" and the JAX rows still run).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxckpt.storage.posix import fsync_file

from .config import _MiB
from .states import _llama_params, _tree_bytes
from .timing import _settle, _timed, _traced_peak

if TYPE_CHECKING:
    from .rows import _Bench


class _TorchRows:
    """The torch and HF rows of one run, on ``bench``'s arrays and directory.

    Args:
        bench: the run (its arrays, result, fresh directories, cold reads, closers).
    """

    def __init__(self, bench: _Bench) -> None:
        self.bench = bench
        self.config = bench.config
        self.result = bench.result

    def torch_rows(self) -> None:
        try:
            import torch
            import torch.distributed.checkpoint as dcp
        except ImportError as error:
            self.result.unavailable["torch"] = f"torch not installed ({error})"
            return
        if not hasattr(self, "torch_state"):
            self.torch_state = {f"layer_{i:05d}": _to_torch(torch, a)
                                for i, a in enumerate(self.bench.arrays)}
            self.result.nbytes["torch"] = sum(t.numel() * t.element_size()
                                              for t in self.torch_state.values())
        state = self.torch_state
        result = self.result
        path = self.bench.fresh("torch.pt")

        def torch_save() -> None:
            torch.save(state, path)
            fsync_file(path)

        result.add("torch_save", _timed(torch_save))
        directory = self.bench.fresh("dcp")
        # Written while torch.save's file and the previous round's copy still exist, as the
        # manager's saves are (its last checkpoint is kept until the new one commits): where
        # a write lands changes what it costs, so both sides get the same disk
        # (benchmarks/results/dcp-sync-save_cpu2core_2026-11-25.md).
        result.add("dcp_save", _timed(lambda: dcp.save(state, checkpoint_id=directory)))
        os.unlink(path)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        self.bench.before_read()
        result.add("dcp_load", _timed(lambda: dcp.load(target, checkpoint_id=directory)))
        previous, self._dcp_previous = getattr(self, "_dcp_previous", None), directory
        if previous is not None:
            shutil.rmtree(previous)
        self.bench.closers.append(lambda: shutil.rmtree(directory, ignore_errors=True))
        directory = self.bench.fresh("dcp-async")
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
            manager = manager_class(os.path.join(self.bench.workdir, "dcp-manager"),
                                    recover=jaxckpt.RecoverConfig(keep_last_n=1), mode="async")
            self._dcp_manager = manager
            self._dcp_step = 0
            self.bench.closers.append(manager.close)
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
        self.bench.before_read()
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
        out = self.bench.fresh("hf")

        def export(directory: str) -> None:
            export_hf(self.hf_params, directory, arch="llama", config=self.hf_config,
                      max_shard_bytes=shard)

        self.result.add("hf_export", _timed(lambda: export(out)))
        shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
        # The same tensors, file by file, as safetensors itself writes them.
        tensors = {name: {k: np.array(v) for k, v in load_file(os.path.join(out, name)).items()}
                   for name in shards}
        baseline = self.bench.fresh("safetensors")
        os.makedirs(baseline)

        def safetensors_save(directory: str) -> None:
            for name, items in tensors.items():
                file = os.path.join(directory, name)
                save_file(items, file, metadata={"format": "pt"})
                fsync_file(file)

        self.result.add("st_save", _timed(lambda: safetensors_save(baseline)))
        if "hf_memory" not in self.result.facts:  # once: tracing slows the calls it watches
            export_peak = _traced_peak(lambda: export(self.bench.fresh("hf")))
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
        for directory in os.listdir(self.bench.workdir):
            if directory.startswith(("hf-", "safetensors-")):
                shutil.rmtree(os.path.join(self.bench.workdir, directory), ignore_errors=True)


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
