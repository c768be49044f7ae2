"""peft adapters exported as peft writes them, or merged as merge_and_unload() leaves them.

A tiny Llama with a LoRA adapter (r=4 on q_proj and v_proj), trained one step so that B is
nonzero; each export is compared with peft's own ``save_pretrained`` and loaded back.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from transformers import AutoModelForCausalLM  # noqa: E402

import torch_bridge  # noqa: E402
from jaxckpt import Every, ExportConfig, StepInfo  # noqa: E402
from jaxckpt.errors import ConfigError  # noqa: E402
from torch_bridge.hf import INDEX_FILE  # noqa: E402

from support.hf_dirs import assert_same_directory, tensors_of  # noqa: E402

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, bos_token_id=0,
            eos_token_id=1, pad_token_id=2)
IDS = torch.arange(12).reshape(1, 12) % 64


def fresh_base():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()


@pytest.fixture(scope="module")
def peft_model():
    model = peft.get_peft_model(fresh_base(),
                                peft.LoraConfig(r=4, lora_alpha=8,
                                                target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(IDS, labels=IDS).loss.backward()
    optimizer.step()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.lora_B["default"].weight.abs().sum() > 0  # trained: the adapter does something
    return model.eval()


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_adapter_export_is_what_peft_save_pretrained_writes(peft_model, tmp_path):
    before = weights(peft_model)
    exporter = torch_bridge.hf_exporter(params_of="model")
    staged = exporter.stage({"model": peft_model})
    try:  # the staged copy is the model at staging time, whatever training does next
        with torch.no_grad():
            for parameter in peft_model.parameters():
                parameter.add_(1.0)
        os.makedirs(tmp_path / "ours")
        assert exporter(staged, str(tmp_path / "ours")) > 0
    finally:
        peft_model.load_state_dict(before)
    peft_model.save_pretrained(tmp_path / "ref")
    assert "adapter_model.safetensors" in os.listdir(tmp_path / "ours")
    assert_same_directory(tmp_path / "ours", tmp_path / "ref", ["adapter_config.json"])
    with open(tmp_path / "ours" / "README.md") as a, open(tmp_path / "ref" / "README.md") as b:
        assert a.read() == b.read()
    names = list(tensors_of(tmp_path / "ours"))
    assert all(".default." not in name for name in names)  # peft drops the adapter name
    loaded = peft.PeftModel.from_pretrained(fresh_base(), tmp_path / "ours").eval()
    assert torch.equal(logits(loaded), logits(peft_model))
    assert not torch.equal(logits(loaded), logits(fresh_base()))
    after = weights(peft_model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_merged_export_equals_merge_and_unload_and_leaves_the_model_alone(peft_model, tmp_path):
    before = weights(peft_model)
    limit = sum(p.numel() * p.element_size() for p in peft_model.parameters()) // 3
    torch_bridge.export_hf(peft_model, tmp_path / "ours", merge_adapters=True,
                           max_shard_bytes=limit)
    merged = copy.deepcopy(peft_model).merge_and_unload()
    merged.save_pretrained(tmp_path / "ref", max_shard_size=limit)
    assert os.path.exists(tmp_path / "ours" / INDEX_FILE)  # total_parameters: no LoRA factors
    assert_same_directory(tmp_path / "ours", tmp_path / "ref",
                          ["config.json", "generation_config.json", INDEX_FILE])
    q_proj = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(tensors_of(tmp_path / "ours")[f"{q_proj}.weight"][1],
                           before[f"base_model.model.{q_proj}.base_layer.weight"])  # merged
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(loaded) is transformers.LlamaForCausalLM
    assert torch.equal(logits(loaded), logits(merged))
    # The training model is still the PeftModel it was, its weights bitwise unchanged.
    assert isinstance(peft_model, peft.PeftModel)
    assert not peft_model.base_model.model.model.layers[0].self_attn.q_proj.merged
    after = weights(peft_model)
    assert list(after) == list(before)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_half_precision_conv1d_and_embedding_merges_match_peft_bitwise(tmp_path):
    # GPT-2's Conv1D (fan_in_fan_out) and a LoRA'd embedding, bfloat16 base with float32
    # adapters (peft's autocast): each path of peft's merge, its casts included.
    torch.manual_seed(1)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=64, bos_token_id=0,
        eos_token_id=1)).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=4, target_modules=["c_attn", "wte"], fan_in_fan_out=True))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.normal_()
    torch_bridge.export_hf(model, tmp_path / "ours", merge_adapters=True)
    copy.deepcopy(model).merge_and_unload().save_pretrained(tmp_path / "ref")
    assert_same_directory(tmp_path / "ours", tmp_path / "ref", ["config.json"])


def test_wrapped_peft_models_export_as_the_bare_one(peft_model, tmp_path):
    import torch.distributed as dist

    torch_bridge.export_hf(peft_model, tmp_path / "bare")
    torch_bridge.export_hf(torch.compile(peft_model), tmp_path / "compiled")  # never run
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(peft_model)
        torch_bridge.export_hf(ddp, tmp_path / "ddp_merged", merge_adapters=True)
    finally:
        dist.destroy_process_group()
    torch_bridge.export_hf(peft_model, tmp_path / "merged", merge_adapters=True)
    for ours, reference in (("compiled", "bare"), ("ddp_merged", "merged")):
        assert sorted(os.listdir(tmp_path / ours)) == sorted(os.listdir(tmp_path / reference))
        mine, theirs = tensors_of(tmp_path / ours), tensors_of(tmp_path / reference)
        assert sorted(mine) == sorted(theirs)
        assert all(torch.equal(mine[key][1], theirs[key][1]) for key in mine)


def test_peft_model_without_peft_installed_names_the_extra(peft_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # what `import peft` sees when it is absent
    with pytest.raises(ImportError, match=r"pip install 'jaxckpt\[peft\]'"):
        torch_bridge.export_hf(peft_model, tmp_path / "out")


def test_merge_adapters_needs_a_model_with_lora_adapters(peft_model, tmp_path):
    with pytest.raises(ConfigError, match=r"merge_adapters=True.*no peft adapters"):
        torch_bridge.export_hf(fresh_base(), tmp_path / "plain", merge_adapters=True)
    ia3 = peft.get_peft_model(fresh_base(), peft.IA3Config(target_modules=["q_proj", "v_proj"],
                                                           feedforward_modules=[]))
    with pytest.raises(ConfigError, match=r"merge_adapters=True cannot merge .*IA3"):
        torch_bridge.export_hf(ia3, tmp_path / "ia3", merge_adapters=True)
    with pytest.raises(ConfigError, match="drop dtype="):
        torch_bridge.export_hf(peft_model, tmp_path / "cast", dtype="bfloat16")
    assert not any(os.listdir(tmp_path))


def test_manager_exports_the_merged_model_in_the_background(peft_model, tmp_path):
    before = weights(peft_model)
    expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    export = ExportConfig(every=Every(steps=1), mode="async", exporter=torch_bridge.hf_exporter(
        params_of="model", merge_adapters=True))
    try:
        with torch_bridge.DcpCheckpointManager(tmp_path / "root", export=export) as mgr:
            (report,) = mgr.maybe_save(StepInfo(0, 3, 3), {"model": peft_model})
            # The training thread may change the model as soon as maybe_save returns.
            with torch.no_grad():
                for parameter in peft_model.parameters():
                    parameter.add_(1.0)
            report.wait()
            ((step, path),) = mgr.store.export_entries()
        assert step == 3
        loaded = AutoModelForCausalLM.from_pretrained(path)
        for name, tensor in loaded.state_dict().items():
            assert torch.equal(tensor, expected[name]), name
    finally:
        peft_model.load_state_dict(before)
