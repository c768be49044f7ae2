"""The torch-model rows of the "hf" section of ``jaxckpt bench``: a transformers Llama exported.

Owns: ``_TorchHFRows`` (the model, built once a run at ``size_mb``, and a long-lived
``DcpCheckpointManager`` whose only work is async HF exports): ``torch_bridge.export_hf``
against ``model.save_pretrained`` of the same model and shard size, the blocking time of an
async export against a host copy of the same tensors, and the export's peak extra memory
against its largest shard.

Must not import at module level: torch, transformers, torch_bridge, jax (without them the
rows read "unavailable" and the other rows still run).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import TYPE_CHECKING, Any

from jaxckpt.storage.posix import fsync_file

from .config import _MiB
from .states import _llama_config
from .timing import _rss_peak_growth, _settle, _timed

if TYPE_CHECKING:
    from .rows import _Bench

#: The rows this module adds; a failed import marks each "unavailable" with the reason.
TORCH_HF_ROWS = ("hf_torch_export", "hf_save_pretrained", "hf_export_blocking", "hf_host_copy")


class _TorchHFRows:
    """The torch HF export rows of one run, in ``bench``'s directory.

    Args:
        bench: the run (its config, result, fresh directories, closers).
    """

    def __init__(self, bench: _Bench) -> None:
        self.bench = bench
        self.result = bench.result
        self.shard = bench.config.hf_shard_mb * _MiB
        self.model: Any = None
        self.manager: Any = None
        self.step = 0
        self.rounds = 0

    def rows(self) -> None:
        """One round: the four timed rows, side by side; the memory check in the first."""
        try:
            import transformers  # noqa: F401 - the model's library, imported up front

            import torch_bridge
        except Exception as error:  # noqa: BLE001 - say why the rows are missing
            for key in TORCH_HF_ROWS:
                self.result.unavailable[key] = f"torch_bridge / transformers: {error!r}"
            return
        if self.model is None:
            self.model = _random_llama(self.bench.config.size_mb * _MiB)
            self.result.nbytes["hf_torch"] = sum(
                t.numel() * t.element_size() for t in self.model.state_dict().values())
        model, shard = self.model, self.shard
        ours, theirs = self.bench.fresh("hf-torch-export"), self.bench.fresh("hf-torch-pretrained")
        timed = {"hf_torch_export": lambda: torch_bridge.export_hf(model, ours,
                                                                   max_shard_bytes=shard),
                 "hf_save_pretrained": lambda: _save_pretrained(model, theirs, shard)}
        self.rounds += 1
        # The two writers take turns going first: the second writes where the first just
        # did (freed blocks, a disk still busy), which is not the second writer's doing.
        order = list(timed) if self.rounds % 2 else list(reversed(timed))
        try:
            for key in order:
                self.result.add(key, _timed(timed[key]))
            self._blocking_rows(torch_bridge)
            if "hf_torch_memory" not in self.result.facts:  # once: its settle is slow
                self._memory_check(torch_bridge, ours)
        finally:
            for directory in (ours, theirs):
                shutil.rmtree(directory, ignore_errors=True)

    def _blocking_rows(self, torch_bridge: Any) -> None:
        """``maybe_save`` of an async export (it blocks for the staging copy only), then a
        plain host copy of the same tensors."""
        import jaxckpt

        if self.manager is None:
            export = jaxckpt.ExportConfig(
                every=jaxckpt.Every(steps=1), mode="async", keep_last_n=1,
                exporter=torch_bridge.hf_exporter(params_of="model", max_shard_bytes=self.shard))
            self.manager = torch_bridge.DcpCheckpointManager(
                # Not "hf-...": the Flax rows delete those names after each round.
                os.path.join(self.bench.workdir, "torch-hf-manager"),
                recover=jaxckpt.RecoverConfig(mode="off"), export=export)
            self.bench.closers.append(self.manager.close)
            self._export(settle=False)  # warm-up: the first export imports what it needs
        self.result.add("hf_export_blocking", self._export())
        state = self.model.state_dict()
        self.result.add("hf_host_copy", _timed(
            lambda: {k: t.detach().to("cpu", copy=True) for k, t in state.items()}))

    def _export(self, *, settle: bool = True) -> float:
        """Seconds one ``maybe_save`` with an export due blocks; the export then finishes."""
        import jaxckpt

        self.step += 1
        step = jaxckpt.StepInfo(0, self.step, self.step)
        if settle:
            _settle()
        start = time.perf_counter()
        reports = self.manager.maybe_save(step, {"model": self.model})
        blocked = time.perf_counter() - start
        assert [r.kind for r in reports] == ["export"], reports
        self.manager.wait()
        return blocked

    def _memory_check(self, torch_bridge: Any, ours: str) -> None:
        """Peak resident-memory growth of one ``export_hf`` over the largest shard it wrote,
        and of the write alone (what the export does after staging its host copy)."""
        from torch_bridge.hf.torch_export import stage_torch, write_torch

        model, shard = self.model, self.shard
        again = self.bench.fresh("hf-torch-memory")
        peak = _rss_peak_growth(lambda: torch_bridge.export_hf(model, again,
                                                               max_shard_bytes=shard))
        shutil.rmtree(again, ignore_errors=True)
        os.makedirs(again)
        staged = [stage_torch(model, copy_tensors=False)]  # the model's own tensors, no copy
        write_peak = _rss_peak_growth(lambda: write_torch(
            staged[0], again, max_shard_bytes=shard, provenance=None, progress=None))
        staged.clear()
        shutil.rmtree(again, ignore_errors=True)
        largest = max(os.path.getsize(os.path.join(ours, name)) for name in os.listdir(ours)
                      if name.endswith(".safetensors"))
        model_mib = self.result.nbytes["hf_torch"] / _MiB
        self.result.facts["hf_torch_memory"] = {
            "model_mib": round(model_mib, 1), "largest_shard_mib": round(largest / _MiB, 1),
            "export_peak_mib": None if peak is None else round(peak / _MiB, 1),
            "write_only_peak_mib": None if write_peak is None else round(write_peak / _MiB, 1)}
        note = ("peak RSS growth during export_hf(model) (kernel high-water mark reset "
                "before, read after; freed memory handed back first); write alone: "
                f"{'n/a' if write_peak is None else f'{write_peak / largest:.2f}'}")
        self.result.checks.append({
            "target": "torch HF export peak extra memory / largest shard", "op": "<=",
            "value": None if peak is None else peak / largest, "limit": 1.5,
            "met": None if peak is None else peak <= 1.5 * largest,
            "note": note if peak is not None else "/proc/self/clear_refs not available"})


def _random_llama(nbytes: int) -> Any:
    """A ``transformers.LlamaForCausalLM`` of about ``nbytes`` float32 params, random values
    (made on the meta device, then filled: no init pass over the weights)."""
    import torch
    import transformers

    config = {k: v for k, v in _llama_config(nbytes).items()
              if k not in ("model_type", "architectures")}
    hf_config = transformers.LlamaConfig(**config)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_config)
    model = model.to_empty(device="cpu").eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.02, generator=generator)
    return model


def _save_pretrained(model: Any, directory: str, shard: int) -> None:
    """``save_pretrained`` as a user calls it for a durable copy: safetensors, the same shard
    limit, then every file fsynced (the export fsyncs its own). Its progress bar is off for
    the call: the bench prints a report, not bars."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        model.save_pretrained(directory, safe_serialization=True, max_shard_size=shard)
    finally:
        if shown:
            logging.enable_progress_bar()
    for name in os.listdir(directory):
        fsync_file(os.path.join(directory, name))
