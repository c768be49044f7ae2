"""DcpBackend's incremental writes: a tensor whose bytes equal the base's record of it is not
written again; the new checkpoint's DCP records point into the base's data file, which the
handle names in ``references``; reads follow exactly those references (anything else is
refused, naming the record), and the tensors come back bit-exact; the base is a real
checkpoint committed by DcpCheckpointManager. Through the manager with
``RecoverConfig(incremental=True)``: on s3 (moto), async; a peft LoRA Llama with AdamW whose
saves write the changed bytes + 5% at most, with retention keeping the shared file; two
ranks (gloo) each deciding for their own records."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from jaxckpt import CheckpointCorruptError, Every, RecoverConfig, StepInfo  # noqa: E402
from jaxckpt.backends.base import IncrementalBase  # noqa: E402
from jaxckpt.commit.store import CheckpointStore  # noqa: E402
from jaxckpt.core.layout import STATE_DIR, ref_key, step_dirname  # noqa: E402
from jaxckpt.tools import cli  # noqa: E402
from torch_bridge import DcpBackend, DcpCheckpointManager  # noqa: E402
from torch_bridge.dcp.incremental import CONTENT_FILE  # noqa: E402
from torch_bridge.dcp.saved_tensors import SavedTensors  # noqa: E402


def frozen_model(seed: int = 0):
    """A model whose first (large) layer is frozen, with AdamW over the rest."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, optimizer


def train(model, optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(4, 256, generator=generator)
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def bitwise(model, optimizer) -> dict[str, bytes]:
    out = {f"model/{k}": v.contiguous().view(torch.uint8).numpy().tobytes()
           for k, v in model.state_dict().items()}
    for index, moments in optimizer.state_dict()["state"].items():
        for name, value in moments.items():
            out[f"opt/{index}/{name}"] = value.contiguous().reshape(-1).view(
                torch.uint8).numpy().tobytes()
    return out


class FirstSaveHashes(DcpBackend):
    """DcpBackend given an empty base where none is passed, as the manager of an incremental
    run passes one to its first save: the checkpoint records its tensors' hashes."""

    def write(self, directory, state, *, asynchronous, base=None):
        if base is None:
            recover_dir = os.path.dirname(os.path.dirname(directory.rstrip("/")))
            if "://" in directory:
                recover_dir = directory.rstrip("/").rsplit("/", 2)[0]
            base = IncrementalBase(step=-1, directory="", recover_dir=recover_dir, files={})
        return super().write(directory, state, asynchronous=asynchronous, base=base)


def committed_base(root: str | CheckpointStore, step: int) -> IncrementalBase:
    store = CheckpointStore(root) if isinstance(root, str) else root
    path = os.path.join(store.recover_dir, step_dirname(step))
    manifest = store.read_manifest(path)
    assert manifest is not None
    files = {ref_key(step, rel): entry for rel, entry in manifest.files.items()}
    return IncrementalBase(step=step, directory=os.path.join(path, STATE_DIR),
                           recover_dir=store.recover_dir, files=files)


@pytest.fixture
def first(tmp_path):
    """(root, model, optimizer, base): one committed checkpoint at step 1."""
    root = str(tmp_path / "run")
    model, optimizer = frozen_model()
    train(model, optimizer, 0)
    backend = FirstSaveHashes()
    with DcpCheckpointManager(root, backend=backend,
                              recover=RecoverConfig(every=Every(steps=1))) as mgr:
        mgr.save(StepInfo(0, 1, 1, None), {"model": model, "optimizer": optimizer})
        mgr.wait()
    backend.close()
    return root, model, optimizer, committed_base(root, 1)


def written_bytes(handle) -> int:
    return sum(entry["size"] for rel, entry in handle.checksums.items()
               if rel.endswith(".distcp"))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_unchanged_tensor_is_referred_to_and_reads_back_bitwise(first, asynchronous):
    root, model, optimizer, base = first
    train(model, optimizer, 1)
    expected = bitwise(model, optimizer)
    directory = os.path.join(base.recover_dir, step_dirname(2), STATE_DIR)
    backend = DcpBackend(async_checkpointer="thread")
    try:
        handle = backend.write(directory, {"model": model, "optimizer": optimizer},
                               asynchronous=asynchronous, base=base)
        handle.wait()
        (key,) = handle.references
        assert key == ref_key(1, "state/__0_0.distcp")
        assert handle.references[key] == base.files[key]
        frozen = sum(t.numel() * t.element_size() for t in model[0].parameters())
        assert written_bytes(handle) < frozen / 8  # only the trained layer and its moments
        content = json.loads(open(os.path.join(directory, CONTENT_FILE), "rb").read())
        paths = {r["fqn"]: r["path"] for r in content["records"]}
        assert paths["model/0.weight"] == "../../" + key
        assert paths["model/2.weight"] == "__0_0.distcp"

        fresh, fresh_optimizer = frozen_model(seed=5)
        train(fresh, fresh_optimizer, 0)
        backend.read(directory, {"model": fresh, "optimizer": fresh_optimizer},
                     references=handle.references)
        assert bitwise(fresh, fresh_optimizer) == expected
        saved = SavedTensors(directory, references=handle.references)  # export-hf's reader
        (weight,) = [t for t in saved.tensors("model") if t.key == "model/0.weight"]
        assert torch.equal(saved.read(weight), model[0].weight)
        with pytest.raises(CheckpointCorruptError, match="model/0.weight"):
            SavedTensors(directory).read(weight)

        # A third save against the second: the frozen layer still names its physical owner.
        third = committed_like(handle, base, directory, step=2)
        train(model, optimizer, 2)
        handle3 = backend.write(os.path.join(base.recover_dir, step_dirname(3), STATE_DIR),
                                {"model": model, "optimizer": optimizer},
                                asynchronous=asynchronous, base=third)
        handle3.wait()
        assert set(handle3.references) == {key}

        with pytest.raises(CheckpointCorruptError, match="model/0.weight"):
            backend.read(directory, {"model": fresh, "optimizer": fresh_optimizer},
                         references={})
    finally:
        backend.close()


def committed_like(handle, base, directory, *, step: int) -> IncrementalBase:
    """The IncrementalBase the manager would build from the checkpoint ``handle`` wrote."""
    files = {ref_key(step, f"{STATE_DIR}/{rel}"): entry for rel, entry in handle.checksums.items()}
    files.update(handle.references or {})
    return IncrementalBase(step=step, directory=directory, recover_dir=base.recover_dir,
                           files=files)


def test_a_base_without_hashes_is_written_again_and_records_them(tmp_path):
    model, optimizer = frozen_model()
    root = str(tmp_path / "run")
    with DcpCheckpointManager(root, recover=RecoverConfig(every=Every(steps=1))) as mgr:
        mgr.save(StepInfo(0, 1, 1, None), {"model": model, "optimizer": optimizer})
        mgr.wait()  # a plain save: no content.json
    base = committed_base(root, 1)
    assert not os.path.exists(os.path.join(base.directory, CONTENT_FILE))
    directory = os.path.join(base.recover_dir, step_dirname(2), STATE_DIR)
    backend = DcpBackend()
    try:
        handle = backend.write(directory, {"model": model, "optimizer": optimizer},
                               asynchronous=False, base=base)
        assert handle.references is None
        assert os.path.exists(os.path.join(directory, CONTENT_FILE))
    finally:
        backend.close()


def test_a_changed_tensor_and_a_missing_base_file_are_written_again(first):
    root, model, optimizer, base = first
    with torch.no_grad():
        model[0].weight[0, 0] += 1.0  # the frozen layer changes after all
    directory = os.path.join(base.recover_dir, step_dirname(2), STATE_DIR)
    gone = IncrementalBase(step=1, directory=base.directory, recover_dir=base.recover_dir,
                           files={})  # the base's files were deleted by hand
    backend = DcpBackend()
    try:
        handle = backend.write(directory, {"model": model, "optimizer": optimizer},
                               asynchronous=False, base=base)
        assert handle.references is not None  # the bias did not change
        assert "model/0.weight" not in open(os.path.join(directory, CONTENT_FILE)).read().split(
            "../../")[-1]
        handle2 = backend.write(os.path.join(base.recover_dir, step_dirname(3), STATE_DIR),
                                {"model": model, "optimizer": optimizer},
                                asynchronous=False, base=gone)
        assert handle2.references is None
    finally:
        backend.close()


def test_a_changed_tensor_is_written_at_once_unless_its_probe_matches(first):
    """The frozen weight changes in one element between the probe's windows: its probe
    equals the base's, so it waits for its full hash and goes to a data file of its own
    (``__0_h0.distcp``); the bias changes where the probe sees it and is written at once
    (``__0_0.distcp``); the untouched layer is referred to. All read back bitwise."""
    root, model, optimizer, base = first
    with torch.no_grad():
        model[0].weight.view(-1)[500] += 1.0  # bytes 2000..2003: between windows 0 and 1
        model[0].bias[0] += 1.0
    expected = bitwise(model, optimizer)
    directory = os.path.join(base.recover_dir, step_dirname(2), STATE_DIR)
    backend = DcpBackend()
    try:
        handle = backend.write(directory, {"model": model, "optimizer": optimizer},
                               asynchronous=False, base=base)
        records = json.loads(open(os.path.join(directory, CONTENT_FILE), "rb").read())
        paths = {r["fqn"]: r["path"] for r in records["records"]}
        assert paths["model/0.weight"] == "__0_h0.distcp"
        assert paths["model/0.bias"] == "__0_0.distcp"
        assert paths["model/2.weight"] == "../../" + ref_key(1, "state/__0_0.distcp")
        fresh, fresh_optimizer = frozen_model(seed=5)
        train(fresh, fresh_optimizer, 0)
        backend.read(directory, {"model": fresh, "optimizer": fresh_optimizer},
                     references=handle.references)
        assert bitwise(fresh, fresh_optimizer) == expected
    finally:
        backend.close()


def test_on_an_object_store_records_point_into_the_earlier_object():
    pytest.importorskip("moto")
    from support.s3_server import moto_s3

    with moto_s3("jaxckpt-inc") as options:
        root = "s3://jaxckpt-inc/runs/incremental"
        model, optimizer = frozen_model()
        state = {"model": model, "optimizer": optimizer}
        config = RecoverConfig(every=Every(steps=1), incremental=True)
        storage_options = {**options, "lease_s": 3.0, "heartbeat_s": 0.5}
        with DcpCheckpointManager(root, recover=config, storage_options=storage_options,
                                  mode="async") as mgr:
            for step in (1, 2):
                train(model, optimizer, step)
                mgr.save(StepInfo(0, step, step, None), state)
            mgr.wait()
            expected = bitwise(model, optimizer)
            store = mgr.store
            refs = store.read_manifest(store.step_path(2)).refs
            assert set(refs) == {ref_key(1, "state/__0_0.distcp")}
            assert store.verify(store.step_path(2)) == []
            fresh, fresh_optimizer = frozen_model(seed=5)
            train(fresh, fresh_optimizer, 0)
            mgr.restore({"model": fresh, "optimizer": fresh_optimizer}, step=2)
            assert bitwise(fresh, fresh_optimizer) == expected
            directory = f"{store.step_path(2)}/{STATE_DIR}"  # export-hf's reader
            saved = SavedTensors(directory, store.storage, references=refs)
            (weight,) = [t for t in saved.tensors("model") if t.key == "model/0.weight"]
            assert torch.equal(saved.read(weight), model[0].weight)


_TWO_RANKS = '''
import json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, os.path.join(os.environ["JAXCKPT_REPO"], "tests", "integration"))
from test_dcp_incremental import (FirstSaveHashes, bitwise, committed_base, frozen_model,
                                  train, written_bytes)
from jaxckpt import Every, RecoverConfig, StepInfo
from jaxckpt.core.layout import STATE_DIR, step_dirname
from torch_bridge import DcpBackend, DcpCheckpointManager

index, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index,
                        world_size=2)
model, optimizer = frozen_model()
train(model, optimizer, 0)
state = {"model": model, "optimizer": optimizer}
backend = FirstSaveHashes(async_checkpointer="thread")
with DcpCheckpointManager(root, backend=backend,
                          recover=RecoverConfig(every=Every(steps=1))) as mgr:
    mgr.save(StepInfo(0, 1, 1, None), state)
    mgr.wait()
base = committed_base(root, 1)
train(model, optimizer, 1)
expected = bitwise(model, optimizer)
directory = os.path.join(base.recover_dir, step_dirname(2), STATE_DIR)
handle = backend.write(directory, state, asynchronous=True, base=base)
handle.wait()
mine = dict(handle.references or {})
everyone = [None, None]
dist.all_gather_object(everyone, mine)
references = {key: entry for found in everyone for key, entry in found.items()}
fresh, fresh_optimizer = frozen_model(seed=5)
train(fresh, fresh_optimizer, 0)
backend.read(directory, {"model": fresh, "optimizer": fresh_optimizer},
             references=references)
assert bitwise(fresh, fresh_optimizer) == expected
print("RESULT " + json.dumps({"refs": sorted(mine), "wrote": written_bytes(handle)}))
backend.close()
dist.destroy_process_group()
print("worker ok", flush=True)
'''


def test_two_ranks_each_keep_their_own_unchanged_tensors(tmp_path):
    from support import paths
    from support.two_processes import run_two_workers

    os.environ.setdefault("JAXCKPT_REPO", str(paths.REPO))
    _, outputs = run_two_workers(_TWO_RANKS, tmp_path, timeout=120)
    results = [json.loads(line.removeprefix("RESULT ")) for output in outputs
               for line in output.splitlines() if line.startswith("RESULT ")]
    assert len(results) == 2
    # DCP writes a replicated tensor once, on one rank; the rank that wrote the frozen
    # weight at step 1 refers to its own file now, and together they write little.
    refs = {key for result in results for key in result["refs"]}
    assert refs and all(key.startswith("step_00000001/state/__") for key in refs)
    assert sum(result["wrote"] for result in results) < 256 * 256 * 4 / 8


# ------------------------------------------------------------ through the manager (#32)

LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=64,
             bos_token_id=0, eos_token_id=1, pad_token_id=2)


def lora_run(seed: int = 0):
    """A tiny Llama whose base is frozen by peft (LoRA on q/v), with AdamW."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)),
        peft.LoraConfig(r=128, lora_alpha=128, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optimizer


def lora_step(model, optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 8), generator=generator)
    optimizer.zero_grad()
    model(ids, labels=ids).loss.backward()
    optimizer.step()


def snapshot(model, optimizer) -> dict[str, bytes]:
    return bitwise(model, optimizer)


@pytest.fixture
def counted(monkeypatch):
    """Bytes DCP's local writer writes (data files, .metadata, content.json), as a list
    whose one element grows."""
    from torch_bridge.dcp import local_writer

    total = [0]
    real = local_writer._ChecksummingStream.write

    def write(self, data):
        count = real(self, data)
        total[0] += count
        return count

    monkeypatch.setattr(local_writer._ChecksummingStream, "write", write)
    return total


def test_a_lora_run_writes_only_the_adapter_and_keeps_every_checkpoint_whole(tmp_path, counted,
                                                                             capsys):
    model, optimizer = lora_run()
    root = str(tmp_path / "run")
    config = RecoverConfig(incremental=True, keep_last_n=2, keep_every=Every(steps=5))
    saved, written = {}, {}
    with DcpCheckpointManager(root, recover=config) as mgr:
        for step in range(10):
            lora_step(model, optimizer, step)
            before = counted[0]
            mgr.save(StepInfo(0, step, step, None), {"model": model, "optimizer": optimizer},
                     mode="sync")
            written[step] = counted[0] - before
            saved[step] = snapshot(model, optimizer)
    trained = [p for p in model.parameters() if p.requires_grad]
    changed = sum(len(value) for key, value in saved[9].items()
                  if key.startswith("opt/")) + sum(p.numel() * 4 for p in trained)
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    assert written[0] > frozen
    store = CheckpointStore(root)
    kept = store.committed_steps()
    assert kept == [4, 8, 9]
    for step in range(1, 10):
        beside = 0
        if step in kept:  # objects.json, driver.json, COMMITTED: written whole by this save
            beside = sum(size for rel, size in store.storage.list_files(
                store.step_path(step)).items() if not rel.startswith("state/_")
                and rel not in ("state/.metadata", f"state/{CONTENT_FILE}"))
        assert written[step] + beside <= 1.05 * changed, (step, written[step], beside, changed)
    # Retention removed step 0, whose data file holds the frozen base every kept step uses.
    shared = ref_key(0, "state/__0_0.distcp")
    assert os.path.exists(os.path.join(store.recover_dir, shared))
    with DcpCheckpointManager(root, recover=config) as mgr:
        for step in kept:
            assert store.verify(store.step_path(step)) == []
            assert shared in store.read_manifest(store.step_path(step)).refs
            fresh, fresh_optimizer = lora_run(seed=7)
            lora_step(fresh, fresh_optimizer, 0)
            mgr.restore({"model": fresh, "optimizer": fresh_optimizer}, step=step)
            assert snapshot(fresh, fresh_optimizer) == saved[step], step
        alone, _ = lora_run(seed=8)  # a partial restore reads the frozen base from step 0
        mgr.restore({"model": alone}, step=kept[-1], partial=True)
        assert {k: v for k, v in snapshot(alone, torch.optim.SGD([torch.zeros(1)])).items()
                } == {k: v for k, v in saved[kept[-1]].items() if k.startswith("model/")}
    # info --tree says, per tensor, whether this checkpoint stores it or which step does.
    assert cli.main(["info", store.step_path(kept[-1]), "--tree"]) == 0
    table = {line.split()[0]: line.rstrip() for line in capsys.readouterr().out.splitlines()
             if line.startswith(("model/", "optimizer/"))}
    frozen_keys = [key for key, line in table.items() if "referenced from step 0" in line]
    assert frozen_keys and all("lora" not in key for key in frozen_keys), table
    assert all(line.endswith("stored") for key, line in table.items()
               if "lora_" in key), table


def test_a_flipped_bit_in_a_referenced_data_file_fails_verify_and_restore_up_front(tmp_path):
    """Steps 2 and 3 refer to step 1's data file for the frozen layer: a bit flipped there
    is named by ``verify`` of each of them, and a restore of step 3 refuses before it
    reads a tensor into the model."""
    root = str(tmp_path / "run")
    model, optimizer = frozen_model()
    config = RecoverConfig(incremental=True, keep_last_n=5)
    with DcpCheckpointManager(root, recover=config) as mgr:
        for step in (1, 2, 3):
            train(model, optimizer, step)
            mgr.save(StepInfo(0, step, step, None), {"model": model, "optimizer": optimizer},
                     mode="sync")
    store = CheckpointStore(root)
    key = ref_key(1, "state/__0_0.distcp")
    assert all(key in store.read_manifest(store.step_path(step)).refs for step in (2, 3))
    records = json.loads(open(os.path.join(store.step_path(1), STATE_DIR, CONTENT_FILE),
                              "rb").read())["records"]
    (frozen,) = [r for r in records if r["fqn"] == "model/0.weight"]
    with open(os.path.join(store.recover_dir, key), "r+b") as handle:
        handle.seek(frozen["offset"] + frozen["length"] // 2)
        byte = handle.read(1)
        handle.seek(frozen["offset"] + frozen["length"] // 2)
        handle.write(bytes([byte[0] ^ 0x04]))
    for step in (2, 3):
        (problem,) = store.verify(store.step_path(step))
        assert f"{key} (referenced from step 1)" in problem and "contents altered" in problem
    fresh, fresh_optimizer = frozen_model(seed=9)
    before = bitwise(fresh, fresh_optimizer)
    with DcpCheckpointManager(root, recover=config) as mgr, \
            pytest.raises(CheckpointCorruptError, match="referenced from step 1"):
        mgr.restore({"model": fresh, "optimizer": fresh_optimizer}, step=3)
    assert bitwise(fresh, fresh_optimizer) == before  # nothing was read into the model


def test_a_strided_tensor_is_hashed_without_a_probe_and_still_kept(tmp_path):
    """A tensor not in one piece (a transposed view) is copied by the hashing thread, gets
    no probe, and is still found unchanged by its hash at the next save."""
    recover = str(tmp_path / "recover")
    weight = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    state = {"m": {"t": weight.t(), "b": torch.ones(8)}}
    base = IncrementalBase(step=-1, directory="", recover_dir=recover, files={})
    backend = DcpBackend()
    try:
        first_dir = os.path.join(recover, step_dirname(1), STATE_DIR)
        handle = backend.write(first_dir, state, asynchronous=False, base=base)
        records = json.loads(open(os.path.join(first_dir, CONTENT_FILE), "rb").read())
        probes = {r["fqn"]: r["probe"] for r in records["records"]}
        assert probes["m/t"] is None and isinstance(probes["m/b"], str)
        second = committed_like(handle, base, first_dir, step=1)
        handle2 = backend.write(os.path.join(recover, step_dirname(2), STATE_DIR), state,
                                asynchronous=False, base=second)
        assert set(handle2.references) == {ref_key(1, "state/__0_0.distcp")}
    finally:
        backend.close()
