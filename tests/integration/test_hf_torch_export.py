"""PyTorch models exported to Hugging Face format: what save_pretrained writes, any architecture.

Tiny models built from configs (no hub access); each export is compared with
``model.save_pretrained`` of the same model and loaded back with transformers.
"""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

from transformers import AutoModelForCausalLM  # noqa: E402

import torch_bridge  # noqa: E402
from jaxckpt import Every, ExportConfig, StepInfo  # noqa: E402
from jaxckpt.errors import ConfigError  # noqa: E402
from torch_bridge.hf import INDEX_FILE, SINGLE_FILE  # noqa: E402

from support.hf_dirs import assert_loads_as, assert_same_directory, tensors_of  # noqa: E402

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, bos_token_id=0,
            eos_token_id=1, pad_token_id=2)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64,
                                            n_positions=64, bos_token_id=0, eos_token_id=1),
    "mistral": lambda: transformers.MistralConfig(**TINY),  # no Flax table in torch_bridge
    "phi3": lambda: transformers.Phi3Config(**TINY),  # no Flax table; fused qkv in torch
    # q/k/v biases, and tied embeddings as small Qwen2 models have them
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
}
IDS = torch.arange(12).reshape(1, 12) % 64


@pytest.fixture(scope="module")
def models():
    built = {}
    for name, make in CONFIGS.items():
        torch.manual_seed(len(built))
        built[name] = AutoModelForCausalLM.from_config(make()).eval()
    return built


def small_shard(model) -> int:
    """A max shard size that splits the model into a few files."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) // 3


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_export_writes_what_save_pretrained_writes_in_shards(models, arch, tmp_path):
    model = models[arch]
    limit = small_shard(model)
    written = torch_bridge.export_hf(model, tmp_path / "ours", max_shard_bytes=limit)
    model.save_pretrained(tmp_path / "ref", safe_serialization=True, max_shard_size=limit)
    assert written > 0
    assert os.path.exists(tmp_path / "ours" / INDEX_FILE)
    assert_same_directory(tmp_path / "ours", tmp_path / "ref")
    assert_loads_as(model, tmp_path / "ours", IDS)


def test_tied_embeddings_are_written_once_as_transformers_writes_them(models, tmp_path):
    model = models["gpt2"]
    assert model.lm_head.weight is model.transformer.wte.weight
    torch_bridge.export_hf(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "ref", safe_serialization=True)
    assert os.listdir(tmp_path / "ours").count(SINGLE_FILE) == 1
    assert "lm_head.weight" not in tensors_of(tmp_path / "ours")
    assert_same_directory(tmp_path / "ours", tmp_path / "ref")
    assert_loads_as(model, tmp_path / "ours", IDS)


def test_compiled_model_exports_without_the_compile_prefix(models, tmp_path):
    model = models["llama"]
    torch_bridge.export_hf(torch.compile(model), tmp_path / "ours")  # never run: no compile
    model.save_pretrained(tmp_path / "ref", safe_serialization=True)
    assert_same_directory(tmp_path / "ours", tmp_path / "ref")


def test_ddp_model_exports_without_the_module_prefix(models, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(models["mistral"])
        torch_bridge.export_hf(ddp, tmp_path / "ours")
    finally:
        dist.destroy_process_group()
    models["mistral"].save_pretrained(tmp_path / "ref", safe_serialization=True)
    assert_same_directory(tmp_path / "ours", tmp_path / "ref")


def test_state_dict_with_config_exports_and_without_config_is_refused(models, tmp_path):
    model = models["gpt2"]  # tied: the state dict holds the embedding under two names
    with pytest.raises(ConfigError, match="needs config="):
        torch_bridge.export_hf(model.state_dict(), tmp_path / "refused")
    assert not os.path.exists(tmp_path / "refused")
    config = model.config.to_dict()
    config["architectures"] = ["GPT2LMHeadModel"]
    torch_bridge.export_hf(model.state_dict(), tmp_path / "ours", config=config)
    model.save_pretrained(tmp_path / "ref", safe_serialization=True)
    assert_same_directory(tmp_path / "ours", tmp_path / "ref")
    assert_loads_as(model, tmp_path / "ours", IDS)


def test_dtype_casts_tensors_and_config(models, tmp_path):
    model = models["phi3"]
    torch_bridge.export_hf(model, tmp_path / "ours", dtype="bfloat16")
    with open(tmp_path / "ours" / "config.json") as handle:
        assert json.load(handle)["dtype"] == "bfloat16"
    expected = model.state_dict()
    for key, (_, tensor, _) in tensors_of(tmp_path / "ours").items():
        assert torch.equal(tensor, expected[key].to(torch.bfloat16)), key


def test_flax_export_without_arch_names_what_is_missing(tmp_path):
    import numpy as np

    with pytest.raises(ConfigError, match="needs arch="):
        torch_bridge.export_hf({"w": np.zeros(2)}, tmp_path / "out")


def test_manager_exports_a_staged_copy_in_the_background(models, tmp_path):
    model = models["llama"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    export = ExportConfig(every=Every(steps=1), mode="async",
                          exporter=torch_bridge.hf_exporter(params_of="model"))
    try:
        with torch_bridge.DcpCheckpointManager(tmp_path / "root", export=export) as mgr:
            (report,) = mgr.maybe_save(StepInfo(0, 3, 3), {"model": model, "optim": optimizer})
            # The training thread may change the model as soon as maybe_save returns.
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1.0)
            report.wait()
            ((step, path),) = mgr.store.export_entries()
        assert step == 3
        loaded = AutoModelForCausalLM.from_pretrained(path)
        for name, tensor in loaded.state_dict().items():
            assert torch.equal(tensor, before[name]), name
    finally:
        model.load_state_dict(before)


def test_flax_exporter_given_a_torch_model_says_to_drop_arch(models, tmp_path):
    # The call of issue 30, which failed deep in numpy ("Cannot interpret 'torch.float32'").
    model = models["llama"]
    exporter = torch_bridge.hf_exporter(arch="llama", config=model.config, params_of="model")
    with pytest.raises(ConfigError, match=r"drop arch=.*hf_exporter\(params_of='model'\)"):
        exporter({"model": model.state_dict()}, str(tmp_path))
