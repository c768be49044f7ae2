"""The "hf" section's row of ``jaxckpt export-hf`` on a DcpCheckpointManager root.

Owns: ``row_export_hf_dcp``: a transformers Llama of about the run's size saved once by a
DcpCheckpointManager whose exporter records its config; each round times export-hf of that
root (checksums verified first, as the command does) against what a user writes without
jaxckpt: the model built on the meta device, ``dcp.load`` into it and ``save_pretrained``,
with the same shard size.

Must not import at module level: torch, transformers, torch_bridge, jax (the row reads
"unavailable" without them).
"""

from __future__ import annotations

import math
import os
import shutil
from typing import TYPE_CHECKING, Any

from .config import _MiB
from .timing import _timed

if TYPE_CHECKING:
    from .rows import _Bench

__all__ = ["row_export_hf_dcp"]


def _llama(torch: Any, transformers: Any, nbytes: int) -> Any:
    """A float32 LlamaForCausalLM of about ``nbytes`` (four layers, vocab 8 x hidden, as
    the hf section's Flax params), small random weights."""
    hidden = 64 * max(1, round(math.sqrt(nbytes / 4 / 64) / 64))
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=max(64, hidden * 8 // 3 // 64 * 64),
        num_hidden_layers=4, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64), vocab_size=8 * hidden,
        max_position_embeddings=2048, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.normal_(0.0, 0.02, generator=generator)
    return model


def row_export_hf_dcp(cfg: Any, bench: _Bench) -> None:
    """Rows ``hf_dcp_export`` and ``hf_dcp_baseline`` of one round.

    Args:
      cfg: the run's ``BenchConfig`` (``size_mb``, ``hf_shard_mb``).
      bench: the run (its result, fresh directories, cold reads, closers); the saved root
        is kept on it across rounds.
    """
    result = bench.result
    try:
        import torch
        import torch.distributed.checkpoint as dcp
        import transformers

        import jaxckpt
        import torch_bridge
        from jaxckpt.tools.hf_cli import export_checkpoint_to_hf
    except Exception as error:  # noqa: BLE001 - an extra is missing; say which
        for key in ("hf_dcp_export", "hf_dcp_baseline"):
            result.unavailable[key] = f"export-hf of a DCP root: {error!r}"
        return
    saved = getattr(bench, "hf_dcp_saved", None)
    if saved is None:
        model = _llama(torch, transformers, cfg.size_mb * _MiB)
        root = os.path.join(bench.workdir, "dcp-hf-root")
        exporter = torch_bridge.hf_exporter(params_of="model")
        with torch_bridge.DcpCheckpointManager(
                root, mode="sync", export=jaxckpt.ExportConfig(
                    exporter=exporter, every=jaxckpt.Every(steps=10**9))) as manager:
            manager.save(jaxckpt.StepInfo(0, 1, 1), {"model": model})
        saved = bench.hf_dcp_saved = (root, model.config)  # type: ignore[attr-defined]
        result.nbytes["hf_dcp"] = sum(t.numel() * t.element_size()
                                      for t in model.state_dict().values())
        bench.closers.append(lambda: shutil.rmtree(root, ignore_errors=True))
        del model
    root, config = saved
    shard = cfg.hf_shard_mb * _MiB
    out = bench.fresh("hf-dcp-out")
    bench.before_read()
    result.add("hf_dcp_export", _timed(lambda: export_checkpoint_to_hf(
        root, out, max_shard_bytes=shard, progress=False)))
    shutil.rmtree(out, ignore_errors=True)
    state_dir = os.path.join(root, "recover", "step_00000001", "state")
    baseline = bench.fresh("hf-dcp-baseline")

    def load_and_save() -> None:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        model = model.to_empty(device="cpu")
        dcp.load({f"model/{name}": tensor for name, tensor in model.state_dict().items()},
                 checkpoint_id=state_dir, no_dist=True)
        model.save_pretrained(baseline, safe_serialization=True, max_shard_size=shard)

    bench.before_read()
    result.add("hf_dcp_baseline", _timed(load_and_save))
    shutil.rmtree(baseline, ignore_errors=True)
