"""FSDP2-sharded transformers models exported to Hugging Face format from 2 ranks (gloo, CPU).

One 2-process run (support/hf_fsdp_worker.py) exports a tiny Llama (in shards) and a GPT-2
(tied embeddings) with ``export_hf`` from both ranks, tries ranks that export different
models, and exports once through a ``DcpCheckpointManager`` in async mode; this side compares
each directory with ``save_pretrained`` of the same model, unsharded.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")


from torch_bridge.hf import INDEX_FILE  # noqa: E402

from support.harness import Worker, repo_env, run_all  # noqa: E402
from support.hf_dirs import assert_same_directory, tensors_of  # noqa: E402
from support.hf_fsdp_worker import build, small_shard  # noqa: E402
from support.paths import HF_FSDP_WORKER  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The 2-rank run: its output directory and each rank's RESULT records."""
    base = tmp_path_factory.mktemp("fsdp")
    out, store = base / "out", base / "process_group"
    workers = [Worker([sys.executable, str(HF_FSDP_WORKER), str(rank), str(store), str(out)],
                      env=repo_env(), timeout_s=120) for rank in range(2)]
    codes, outputs = run_all(workers)
    for code, output in zip(codes, outputs, strict=True):
        assert code == 0 and "worker ok" in output, output[-4000:]
    results = [[json.loads(line.removeprefix("RESULT ")) for line in output.splitlines()
                if line.startswith("RESULT ")] for output in outputs]
    return out, results


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_every_rank_exports_and_rank_0_writes_what_save_pretrained_writes(run, name,
                                                                          tmp_path):
    out, results = run
    model = build(name)
    limit = small_shard(model) if name == "llama" else "50GB"
    model.save_pretrained(tmp_path / "ref", safe_serialization=True, max_shard_size=limit)
    assert_same_directory(out / name, tmp_path / "ref")
    if name == "gpt2":
        assert "lm_head.weight" not in tensors_of(out / name)  # tied: written once
    else:
        assert os.path.exists(out / name / INDEX_FILE)
    mine = [[r for r in rank if r.get("name") == name][0] for rank in results]
    assert mine[0]["written"] > 0 and mine[1]["written"] == 0
    assert mine[1]["listed"]  # rank 1 returned after rank 0 published the directory


def test_ranks_exporting_different_models_both_refuse(run):
    out, results = run
    for rank in results:
        (message,) = [r["mismatch"] for r in rank if "mismatch" in r]
        assert "rank(s) [1] stage other tensors than rank 0" in message, message
    assert not os.path.exists(out / "mismatch")


def test_async_manager_export_is_staged_on_every_rank_and_listed_once(run, tmp_path):
    out, results = run
    records = [[r for r in rank if "entries" in r][0] for rank in results]
    assert [r["error"] for r in records] == ["None", "None"]
    entries = [r["entries"] for r in records]
    assert entries[0] == entries[1] and len(entries[0]) == 1
    ((step, path),) = entries[0]
    assert step == 3
    # The parameters changed right after maybe_save: the export is of the staged copy.
    build("llama").save_pretrained(tmp_path / "ref", safe_serialization=True)
    assert_same_directory(path, tmp_path / "ref")


def test_one_rank_fsdp_staged_copy_is_not_the_live_parameters(tmp_path):
    # On one rank (or replicated placements) full_tensor() returns the parameter's own
    # storage: the staged copy must still be a copy.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torch_bridge

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        model = build("gpt2")
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.transformer.h:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        exporter = torch_bridge.hf_exporter(params_of="model")
        staged = exporter.stage({"model": model})
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)
        (tmp_path / "ours").mkdir()
        assert exporter(staged, str(tmp_path / "ours")) > 0
    finally:
        dist.destroy_process_group()
    build("gpt2").save_pretrained(tmp_path / "ref", safe_serialization=True)
    assert_same_directory(tmp_path / "ours", tmp_path / "ref")
