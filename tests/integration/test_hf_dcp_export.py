"""``jaxckpt export-hf`` on DcpCheckpointManager roots: what save_pretrained writes, from DCP files.

Tiny transformers models trained a step and saved by a DcpCheckpointManager whose exporter
recorded the model's config at save time; the CLI's export is compared with
``save_pretrained`` of the same model (files, shards, index, config, bitwise tensors) and
loaded back with ``from_pretrained``. Without a recorded config ``--config`` is required
(exit 2, named). Also an s3:// root (moto) and a root written before this change.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch_bridge  # noqa: E402
from jaxckpt import Every, ExportConfig, RecoverConfig, StepInfo  # noqa: E402
from jaxckpt.tools.cli import main  # noqa: E402
from torch_bridge.hf.torch_export import TORCH_EXPORTER_RECORD_FORMAT  # noqa: E402

from support.hf_dirs import assert_loads_as, assert_same_directory, tensors_of  # noqa: E402

DATA = Path(__file__).parent / "data"
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=1, pad_token_id=2),
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64,
                                            n_positions=64, bos_token_id=0, eos_token_id=1),
}
IDS = torch.arange(12).reshape(1, 12) % 64
NEVER = Every(steps=10**9)  # exports are not what these tests look at: only the record


def trained(arch: str):
    """(model, optimizer) after one AdamW step from a fixed seed."""
    torch.manual_seed(len(arch))
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(IDS, labels=IDS).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model.eval(), optimizer


def small_shard(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) // 3


def save(root, model, optimizer, step: int, *, record: bool = True, **options) -> None:
    export = (ExportConfig(exporter=torch_bridge.hf_exporter(params_of="model"), every=NEVER)
              if record else None)
    with torch_bridge.DcpCheckpointManager(root, export=export, mode="sync",
                                           recover=RecoverConfig(keep_last_n=None),
                                           **options) as mgr:
        mgr.save(StepInfo(0, step, step), {"model": model, "optimizer": optimizer})


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def run(request, tmp_path_factory):
    """A root with a recorded step 1 and step 2 (one more training step between), and
    save_pretrained of the model at each step."""
    base = tmp_path_factory.mktemp(request.param)
    model, optimizer = trained(request.param)
    root = str(base / "root")
    refs = {}
    for step in (1, 2):
        if step == 2:
            model.train()
            model(IDS, labels=IDS).loss.backward()
            optimizer.step()
            model.eval()
        save(root, model, optimizer, step)
        refs[step] = base / f"ref{step}"
        model.save_pretrained(refs[step], safe_serialization=True,
                              max_shard_size=small_shard(model))
    return request.param, model, root, refs


def test_export_of_a_dcp_root_is_what_save_pretrained_writes(run, tmp_path):
    arch, model, root, refs = run
    out = tmp_path / "out"
    assert main(["export-hf", root, str(out), "--max-shard-size", str(small_shard(model)),
                 "--no-progress"]) == 0
    assert os.path.exists(out / "model.safetensors.index.json")  # split into shards
    assert_same_directory(out, refs[2])
    assert_loads_as(model, out, IDS)
    if arch == "gpt2":  # tied: written once, under the name transformers keeps
        assert "lm_head.weight" not in tensors_of(out)
    with open(out / "jaxckpt_provenance.json") as handle:
        source = json.load(handle)["source"]
    assert source["params_of"] == "model" and source["global_step"] == 2


def test_step_flag_and_step_directory_export_that_step(run, tmp_path):
    arch, model, root, refs = run
    limit = str(small_shard(model))
    step_dir = os.path.join(root, "recover", "step_00000001")
    assert main(["export-hf", root, str(tmp_path / "a"), "--step", "1", "--max-shard-size",
                 limit, "--no-progress"]) == 0
    assert main(["export-hf", step_dir, str(tmp_path / "b"), "--max-shard-size", limit,
                 "--no-progress"]) == 0
    assert_same_directory(tmp_path / "a", refs[1])
    assert_same_directory(tmp_path / "b", refs[1])


def test_each_save_records_its_model_config_under_its_own_format(run):
    arch, model, root, refs = run
    driver = json.loads(Path(root, "recover", "step_00000002", "driver.json").read_text())
    record = driver["export"]
    assert record["format"] == TORCH_EXPORTER_RECORD_FORMAT
    assert record["params_of"] == "model"
    assert record["config"] == (refs[2] / "config.json").read_text()
    manifest = json.loads(Path(root, "recover", "step_00000002", "COMMITTED").read_text())
    assert "driver.json" in manifest["files"]  # covered by the commit's checksums


def test_without_a_recorded_config_export_needs_config(tmp_path, capsys):
    model, optimizer = trained("llama")
    root = str(tmp_path / "root")
    save(root, model, optimizer, 1, record=False)
    assert main(["export-hf", root, str(tmp_path / "out"), "--no-progress"]) == 2
    assert "--config" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
    model.save_pretrained(tmp_path / "ref", safe_serialization=True)
    assert main(["export-hf", root, str(tmp_path / "out"), "--config", str(tmp_path / "ref"),
                 "--no-progress"]) == 0
    assert_same_directory(tmp_path / "out", tmp_path / "ref")
    # The same refusal from a fresh process, as a user sees it.
    done = subprocess.run([sys.executable, "-m", "jaxckpt.tools.cli", "export-hf", root,
                           str(tmp_path / "again"), "--no-progress"],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 2, done.stderr
    assert "--config" in done.stderr


def test_several_modules_without_a_record_need_params_of(tmp_path, capsys):
    model, optimizer = trained("gpt2")
    root = str(tmp_path / "root")
    with torch_bridge.DcpCheckpointManager(root, mode="sync") as mgr:
        mgr.save(StepInfo(0, 1, 1), {"model": model, "probe": torch.nn.Linear(2, 2),
                                     "optimizer": optimizer})
    model.save_pretrained(tmp_path / "ref", safe_serialization=True)
    args = ["export-hf", root, str(tmp_path / "out"), "--config", str(tmp_path / "ref"),
            "--no-progress"]
    assert main(args) == 2
    assert "--params-of" in capsys.readouterr().err
    assert main([*args, "--params-of", "model"]) == 0
    assert_same_directory(tmp_path / "out", tmp_path / "ref")


def test_export_of_an_s3_root(tmp_path, monkeypatch):
    pytest.importorskip("moto")
    from support.s3_server import moto_s3, server_env

    model, optimizer = trained("gpt2")
    with moto_s3("jaxckpt-hf-dcp") as options:
        root = f"s3://jaxckpt-hf-dcp/runs/{uuid.uuid4().hex}"
        save(root, model, optimizer, 1, storage_options=options)
        for name, value in server_env(options, {}).items():
            monkeypatch.setenv(name, value)
        assert main(["export-hf", root, str(tmp_path / "out"), "--no-progress"]) == 0
    model.save_pretrained(tmp_path / "ref", safe_serialization=True)
    assert_same_directory(tmp_path / "out", tmp_path / "ref")
    assert_loads_as(model, tmp_path / "out", IDS)


def test_root_written_before_this_change_exports_with_config(tmp_path):
    """data/golden_dcp_root: a LlamaForCausalLM (hidden 16, 1 layer, seed 0) and its SGD
    optimizer saved at step 2 by the code of main at 0a0f25b, before export-hf read DCP
    roots (no export record); data/golden_dcp_config.json is that model's config.json.
    Never regenerate it."""
    root = tmp_path / "root"
    shutil.copytree(DATA / "golden_dcp_root", root)
    out = tmp_path / "out"
    assert main(["export-hf", str(root), str(out), "--no-progress"]) == 2
    assert main(["export-hf", str(root), str(out), "--config",
                 str(DATA / "golden_dcp_config.json"), "--no-progress"]) == 0
    # What the DCP restore puts into a model of that config is what the export holds.
    config = transformers.AutoConfig.from_pretrained(DATA / "golden_dcp_config.json")
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch_bridge.DcpCheckpointManager(str(root)) as mgr:
        mgr.restore({"model": model}, partial=True)
    reference = tmp_path / "ref"
    model.save_pretrained(reference, safe_serialization=True)
    assert_same_directory(out, reference)
    assert_loads_as(model, out, torch.arange(8).reshape(1, 8) % 32)


def test_tensors_are_read_one_at_a_time_as_the_shards_are_written(run, tmp_path, monkeypatch):
    """At each tensor written, at most one more has been read (the next one, prepared while
    this one is written): the model is never in memory whole."""
    from torch_bridge.dcp.saved_tensors import SavedTensors
    from torch_bridge.hf.dcp_export import export_dcp, recorded_export

    arch, model, root, refs = run
    step_dir = Path(root, "recover", "step_00000002")
    reads, ahead = [], []
    original = SavedTensors.read

    def counted(self, tensor):
        reads.append(tensor.key)
        return original(self, tensor)

    monkeypatch.setattr(SavedTensors, "read", counted)
    driver = json.loads((step_dir / "driver.json").read_text())
    export_dcp(str(step_dir / "state"), str(tmp_path / "out"), record=recorded_export(driver),
               max_shard_bytes=small_shard(model),
               progress=lambda done, total: ahead.append(len(reads) - len(ahead) - 1))
    assert len(reads) == len(tensors_of(refs[2])) == len(ahead)
    assert max(ahead) <= 1
    assert_same_directory(tmp_path / "out", refs[2])
