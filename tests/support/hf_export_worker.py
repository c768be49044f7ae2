"""A tiny transformers Llama trained under DcpCheckpointManager with async Hugging Face exports.

Used by test_torch_export_kill: run as a script (``ROOT STEPS HANG_AT``) it trains to STEPS
from the latest checkpoint under ROOT, saving every 2 steps and exporting every 2 steps with
``torch_bridge.hf_exporter(params_of="model")``'s own writer; the export of step HANG_AT
prints ``WRITING <step> <temp dir>`` once its first tensor is on disk and then waits (the
test SIGKILLs it there: a kill in the middle of writing an export, at a known point). The
test imports ``train`` for the rerun. Lines on stdout: ``RESUMED <step>``, ``WRITING ...``,
``DONE``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
from typing import Any

import torch
import transformers

import torch_bridge
from jaxckpt import Every, ExportConfig, RecoverConfig, StepInfo
from torch_bridge.hf.torch_export import StagedModel, TorchHFExporter, write_staged

CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
#: Small enough that the export is several files, so the kill leaves a part of them.
SHARD_BYTES = 16 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class PausingExporter(TorchHFExporter):
    """The HF exporter's own staging and writer; only the export of step ``hang_at`` pauses
    after its first tensor, announcing where it writes."""

    hang_at: int = -1
    """The global step whose export pauses; -1: none."""

    def __call__(self, state: Any, out_dir: str) -> int:
        staged = state if isinstance(state, StagedModel) else self.stage(state)
        found = re.search(r"globalstep(\d+)", out_dir)
        step = int(found.group(1)) if found else -1

        def progress(done: int, total: int) -> None:
            if step == self.hang_at:
                print(f"WRITING {step} {out_dir}", flush=True)
                threading.Event().wait()  # until SIGKILLed

        assert self.max_shard_bytes is not None
        return write_staged(staged, out_dir, max_shard_bytes=self.max_shard_bytes,
                            provenance=None, progress=progress)


def train(root: str, steps: int, hang_at: int = -1) -> Any:
    """Train to ``steps`` (resuming from ``root``'s latest checkpoint); return the model."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    exporter = PausingExporter(params_of="model", max_shard_bytes=SHARD_BYTES, hang_at=hang_at)
    export = ExportConfig(every=Every(steps=2), exporter=exporter, mode="async")
    state = {"model": model, "optim": optimizer}
    ids = torch.arange(16).reshape(2, 8) % CONFIG["vocab_size"]
    with torch_bridge.DcpCheckpointManager(root, recover=RecoverConfig(every=Every(steps=2)),
                                           export=export) as manager:
        recovered = manager.recover(state)
        info = StepInfo(0, 0, 0) if recovered is None else recovered.step_info.next()
        if recovered is not None:
            print(f"RESUMED {recovered.step_info.global_step}", flush=True)
        while info.global_step < steps:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            manager.maybe_save(info, state)
            info = info.next()
    print("DONE", flush=True)
    return model


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
