"""One rank of a 2-rank FSDP2 (gloo, CPU) job exporting tiny transformers models to Hugging
Face format (launched by tests/integration/test_hf_torch_export_fsdp.py through
``support.harness``: arguments ``INDEX STORE_FILE OUT_DIR``, the process group meeting
through a file, so no port can be taken by another process in between).

Each rank builds the models of ``build`` (the test builds the same, unsharded, for its
references), shards each decoder layer and the root with ``fully_shard``, then: exports
each with ``torch_bridge.export_hf``; exports a different model on each rank (which must fail
on both); and exports the Llama once through a ``DcpCheckpointManager`` in async mode,
changing its parameters right after ``maybe_save`` returns. Prints ``RESULT {json}`` lines,
then "worker ok". Imports torch and transformers at import time, the library in ``main``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from typing import Any

import torch
import transformers

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, bos_token_id=0,
            eos_token_id=1, pad_token_id=2)
NAMES = ("llama", "gpt2")


def build(name: str) -> Any:
    """The tiny model ``name``, the same on every call (its own seed)."""
    torch.manual_seed(NAMES.index(name) + 7)
    config = (transformers.LlamaConfig(**TINY) if name == "llama" else
              transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64,
                                      n_positions=64, bos_token_id=0, eos_token_id=1))
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def small_shard(model: Any) -> int:
    """A max shard size that splits the model into a few files (the unsharded model's)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) // 3


def _sharded(name: str, mesh: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    model = build(name)
    layers = model.model.layers if name == "llama" else model.transformer.h
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main(index: int, store_file: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import torch_bridge
    from jaxckpt import Every, ExportConfig, StepInfo
    from jaxckpt.errors import ConfigError

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=index,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,))
    models = {name: _sharded(name, mesh) for name in NAMES}
    limits = {"llama": small_shard(build("llama")), "gpt2": None}
    for name, model in models.items():
        written = torch_bridge.export_hf(model, os.path.join(out, name),
                                         max_shard_bytes=limits[name])
        # Every rank returns once rank 0 has published the directory.
        print("RESULT " + json.dumps({"rank": index, "name": name, "written": written,
                                      "listed": os.path.isdir(os.path.join(out, name))}))
    try:  # rank 0 exports the Llama, rank 1 the GPT-2: both ranks must refuse
        torch_bridge.export_hf(models[NAMES[index]], os.path.join(out, "mismatch"))
        print("RESULT " + json.dumps({"rank": index, "mismatch": "exported"}))
    except ConfigError as exc:
        print("RESULT " + json.dumps({"rank": index, "mismatch": str(exc)}))
    model = models["llama"]
    export = ExportConfig(every=Every(steps=1), mode="async",
                          exporter=torch_bridge.hf_exporter(params_of="model"))
    with torch_bridge.DcpCheckpointManager(os.path.join(out, "root"), export=export) as mgr:
        (report,) = mgr.maybe_save(StepInfo(0, 3, 3), {"model": model})
        with torch.no_grad():  # the loop goes on while rank 0 writes the staged copy
            for parameter in model.parameters():
                parameter.add_(1.0)
        report.wait()  # rank 0: the write; rank 1 writes nothing
        dist.barrier()
        entries = [[step, path] for step, path in mgr.store.export_entries()]
    print("RESULT " + json.dumps({"rank": index, "entries": entries,
                                  "error": repr(report.error)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from worker_lines import claim_stdout

    claim_stdout()  # gloo's chatter goes to stderr
    try:
        main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
        print("worker ok", flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
