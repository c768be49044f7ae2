"""DcpBackend and DcpCheckpointManager in one process: save -> restore -> compare, staging,
errors, RNG backward compatibility, data-loader resume, and independence from jax."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

from jaxckpt import (
    CheckpointCorruptError,
    CheckpointWarning,
    CheckpointWriteError,
    CodecError,
    ConfigError,
    Every,
    ExportConfig,
    RecoverConfig,
    StepInfo,
    TreeMismatchError,
)
from jaxckpt.backends.base import Backend, WriteHandle
from jaxckpt.core import codec
from jaxckpt.core.manifest import DEFER_CHECKSUMS_OVER
from torch_bridge import DcpBackend, DcpCheckpointManager
from torch_bridge.dcp import backend as dcp_backend

from support import paths

REPO = str(paths.REPO)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
          torch.int32, torch.int8, torch.uint8, torch.bool]


# ----------------------------------------------------------------------------- helpers


class Net(nn.Module):
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(5, hidden)
        self.norm = nn.BatchNorm1d(hidden)  # buffers, including an int64 counter
        self.fc2 = nn.Linear(hidden, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


class Tally:
    """A user Stateful object mixing a tensor and JSON values."""

    def __init__(self):
        self.total = torch.zeros(3, dtype=torch.float64)
        self.count = 0
        self.tags = ["start"]

    def state_dict(self):
        return {"total": self.total, "count": self.count, "tags": list(self.tags)}

    def load_state_dict(self, state):
        self.total.copy_(state["total"])
        self.count = state["count"]
        self.tags = list(state["tags"])


def batch(step: int):
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 5, generator=generator), torch.randn(6, 2, generator=generator)


def train_step(model, optimizer, scheduler, step: int) -> None:
    x, y = batch(step)
    loss = (model(x) - y).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()


def make(seed: int, hidden: int = 8, steps: int = 0):
    torch.manual_seed(seed)
    model = Net(hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(steps):
        train_step(model, optimizer, scheduler, step)
    return model, optimizer, scheduler


def sample(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(4, 3, generator=generator) < 0.5
    if dtype.is_floating_point:
        return torch.randn(4, 3, generator=generator).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (4, 3), generator=generator, dtype=dtype)


def assert_bitwise(actual, expected, path="$"):
    """Equal structure, types, dtypes, shapes and bytes (NaN-safe, -0.0-safe)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        view = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(view(actual), view(expected)), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), path
        for key in expected:
            assert_bitwise(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bitwise(a, e, f"{path}[{index}]")
    else:
        assert type(actual) is type(expected) and actual == expected, (path, actual, expected)


def snapshot(model, optimizer, scheduler):
    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "scheduler": scheduler.state_dict()})


def manager(root, **options):
    return DcpCheckpointManager(root, recover=RecoverConfig(every=Every(steps=1)), **options)


INFO = StepInfo(0, 3, 3, None)


# ----------------------------------------------------------------------------- battery


def test_is_a_backend():
    backend = DcpBackend()
    assert isinstance(backend, Backend)
    assert backend.name == "dcp" and backend.supports_async is True
    assert (backend.process_index, backend.process_count) == (0, 1)
    assert backend.async_checkpointer == "thread"  # CPU only: no checkpoint process
    assert backend.versions()["torch"] == torch.__version__
    backend.close()


def test_checkpoint_process_only_with_a_process_group():
    # DCP's checkpoint process joins the default group: "auto" on a lone CUDA process must
    # stay on the thread writer, and asking for the process without a group is refused.
    from torch_bridge.dcp.backend import _has_process_checkpointer, _resolve_checkpointer

    assert _resolve_checkpointer("auto", True, False) == "thread"
    assert _resolve_checkpointer("auto", False, True) == "thread"
    if _has_process_checkpointer():
        assert _resolve_checkpointer("auto", True, True) == "process"
    with pytest.raises(ConfigError, match="init_process_group"):
        _resolve_checkpointer("process", True, False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_roundtrip_is_bitwise_for_every_kind_of_entry(tmp_path, mode):
    model, optimizer, scheduler = make(seed=0, steps=3)
    tally = Tally()
    tally.total += 1.5
    tally.count, tally.tags = 7, ["a", "b"]
    tensors = {str(dtype): sample(dtype, seed=i) for i, dtype in enumerate(DTYPES)}
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "tally": tally,
             "tensors": tensors, "ema": sample(torch.bfloat16, seed=99),
             "note": {"epoch": 3, "ratio": 0.25, "pair": (1, "x"), "none": None}}
    expected = snapshot(model, optimizer, scheduler)
    expected.update(tally=copy.deepcopy(tally.state_dict()), tensors=copy.deepcopy(tensors),
                    ema=state["ema"].clone(), note=copy.deepcopy(state["note"]))
    twin = make(seed=0, steps=3)  # the same run, continuing without a checkpoint

    reports = []
    with manager(tmp_path, mode=mode, on_report=reports.append) as mgr:
        report = mgr.save(INFO, state)
        # The caller may change everything once save() returned: staging made a copy.
        train_step(model, optimizer, scheduler, 3)
        for tensor in [*tensors.values(), state["ema"], tally.total]:
            tensor.zero_()
        tally.count = -1
        mgr.wait()
    assert reports == [report] and report.mode == mode and report.error is None
    assert 0 < report.blocking_s <= report.total_s
    assert report.bytes > sum(t.numel() * t.element_size() for t in tensors.values())

    fresh_model, fresh_optimizer, fresh_scheduler = make(seed=1)  # other init, no Adam state
    like = {"model": fresh_model, "optimizer": fresh_optimizer, "scheduler": fresh_scheduler,
            "tally": Tally(), "tensors": {k: torch.zeros_like(v) for k, v in tensors.items()},
            "ema": torch.zeros(4, 3, dtype=torch.bfloat16), "note": {}}
    ema_object = like["ema"]
    with manager(tmp_path) as mgr:
        recovered = mgr.recover(like)
    assert recovered.state is like and recovered.step_info == INFO
    assert like["ema"] is ema_object  # tensors load in place
    actual = snapshot(fresh_model, fresh_optimizer, fresh_scheduler)
    actual.update(tally=like["tally"].state_dict(), tensors=like["tensors"], ema=like["ema"],
                  note=like["note"])
    assert_bitwise(actual, expected)
    # ...and training goes on exactly as it would have without the checkpoint.
    train_step(fresh_model, fresh_optimizer, fresh_scheduler, 3)
    train_step(*twin, 3)
    assert_bitwise(snapshot(fresh_model, fresh_optimizer, fresh_scheduler), snapshot(*twin))


def counting_torch_loads(monkeypatch) -> list[object]:
    """Every torch.load call from now on (DCP's reader looks it up at each call)."""
    calls: list[object] = []
    real = torch.load

    def counted(*args, **kwargs):
        calls.append(args[0] if args else kwargs.get("f"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    return calls


def test_a_restore_copies_every_tensor_record_without_torch_load(tmp_path, monkeypatch):
    # A record of one contiguous tensor is copied from the file straight into the live
    # tensor (_dcp_records proves its layout), not unpickled by torch.load and copied again.
    model, optimizer, scheduler = make(seed=0, steps=2)
    tensors = {str(dtype): sample(dtype, seed=i) for i, dtype in enumerate(DTYPES)}
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
             "tensors": tensors, "scalar": torch.tensor(4.5, dtype=torch.float64)}
    expected = snapshot(model, optimizer, scheduler)
    expected.update(tensors=copy.deepcopy(tensors), scalar=state["scalar"].clone())
    with manager(tmp_path, mode="sync") as mgr:
        mgr.save(INFO, state)
    fresh_model, fresh_optimizer, fresh_scheduler = make(seed=1)
    like = {"model": fresh_model, "optimizer": fresh_optimizer, "scheduler": fresh_scheduler,
            "tensors": {k: torch.zeros_like(v) for k, v in tensors.items()},
            "scalar": torch.zeros((), dtype=torch.float64)}
    loads = counting_torch_loads(monkeypatch)
    with manager(tmp_path) as mgr:
        mgr.recover(like)
    assert loads == []
    actual = snapshot(fresh_model, fresh_optimizer, fresh_scheduler)
    actual.update(tensors=like["tensors"], scalar=like["scalar"])
    assert_bitwise(actual, expected)


def test_a_record_whose_layout_is_not_proven_is_left_to_torch_load(tmp_path, monkeypatch):
    # A transposed tensor owns its whole storage, so DCP saves it as it is: non-contiguous.
    # Only its record goes through DCP's own path; the values arrive either way.
    transposed = torch.randn(6, 4).t()
    plain = torch.randn(5, 3)
    assert not transposed.is_contiguous()
    with manager(tmp_path, mode="sync") as mgr:
        mgr.save(INFO, {"t": transposed, "p": plain})
    like = {"t": torch.zeros(4, 6), "p": torch.zeros(5, 3)}
    loads = counting_torch_loads(monkeypatch)
    with manager(tmp_path) as mgr:
        mgr.restore(like)
    assert len(loads) == 1
    assert torch.equal(like["t"], transposed) and torch.equal(like["p"], plain)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_commit_reads_no_dcp_file_back_and_every_one_is_fsynced(tmp_path, mode,
                                                                    monkeypatch):
    # DCP's writer checksums each file's bytes as it writes them and fsyncs the file: the
    # commit takes those checksums instead of a second pass over the data (the sync save
    # cost twice the bytes of a bare dcp.save), and the manifest still matches the disk.
    from jaxckpt.storage import posix as storage_module

    summed: list[str] = []
    real_checksum = storage_module.PosixStorage.checksum
    monkeypatch.setattr(storage_module.PosixStorage, "checksum", lambda self, path, *a, **kw:
                        summed.append(path) or real_checksum(self, path, *a, **kw))
    fsynced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        fsynced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    model, optimizer, scheduler = make(seed=0, steps=2)
    big = torch.randn(300_000, generator=torch.Generator().manual_seed(4))
    with manager(tmp_path, mode=mode) as mgr:
        mgr.save(INFO, {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                        "big": big})
        mgr.wait()
        by_commit = list(summed)
        assert mgr.store.verify(mgr.store.step_path(3), checksums=True) == []
    state_dir = tmp_path / "recover" / "step_00000003" / "state"
    assert sorted(p.name for p in state_dir.iterdir()) == [".metadata", "__0_0.distcp",
                                                            "objects.json"]
    assert not [p for p in by_commit if p.endswith((".distcp", ".metadata"))], by_commit
    assert any(p.endswith("objects.json") for p in by_commit)  # the seam is the right one
    # Durable before the marker: each data file was fsynced (under its staging name).
    for name in ("__0_0.distcp", ".metadata"):
        assert any(p.endswith(f"/{name}") or p.endswith(f"/{name}.tmp") for p in fsynced), (
            name, fsynced)


def test_layout_keeps_non_tensor_values_out_of_dcp(tmp_path):
    model, optimizer, scheduler = make(seed=0, steps=2)
    with manager(tmp_path) as mgr:
        report = mgr.save(INFO, {"model": model, "optimizer": optimizer, "scheduler": scheduler},
                          mode="sync")
    files = sorted(os.listdir(os.path.join(report.path, "state")))
    assert files == [".metadata", "__0_0.distcp", "objects.json"]
    with open(os.path.join(report.path, "state", "objects.json")) as stream:
        objects = json.load(stream)
    entries = objects["entries"]
    assert {k: v["kind"] for k, v in entries.items()} == {
        "model": "module", "optimizer": "optimizer", "scheduler": "state_dict"}
    assert entries["optimizer"]["module"] == "model"
    keys = {t["key"] for entry in entries.values() for t in entry["tensors"]}
    assert {"model/fc1.weight", "model/norm.num_batches_tracked",
            "optimizer/state/fc1.weight/exp_avg", "optimizer/state/fc1.weight/step"} <= keys
    lr = codec.decode(entries["optimizer"]["skeleton"])["param_groups"][0]["lr"]
    assert lr == optimizer.param_groups[0]["lr"] == 0.005  # JSON, not a pickle inside DCP
    assert codec.decode(entries["scheduler"]["skeleton"])["last_epoch"] == 2


def test_async_directory_appears_only_when_complete(tmp_path):
    backend = DcpBackend()
    directory = str(tmp_path / "state")
    handle = backend.write(directory, {"w": torch.ones(1000)}, asynchronous=True)
    assert isinstance(handle, WriteHandle)
    # Published by the first wait() after DCP finished (the manager's commit thread).
    assert not os.path.exists(directory) and os.path.isdir(tmp_path / ".tmp-state")
    handle.wait()
    assert os.path.isfile(os.path.join(directory, ".metadata"))
    assert not os.path.exists(tmp_path / ".tmp-state")
    handle.wait()  # idempotent
    like = {"w": torch.zeros(1000)}
    assert torch.equal(backend.read(directory, like)["w"], torch.ones(1000))
    backend.close()


def test_only_one_save_in_flight(tmp_path):
    backend = DcpBackend()
    first = backend.write(str(tmp_path / "a"), {"w": torch.ones(10)}, asynchronous=True)
    second = backend.write(str(tmp_path / "b"), {"w": torch.zeros(10)}, asynchronous=True)
    assert first.done() and os.path.isdir(tmp_path / "a")  # finished before the second began
    second.wait()
    backend.close()
    assert second.done()


def test_saving_a_fresh_optimizer_does_not_change_training(tmp_path):
    # DCP's get_optimizer_state_dict initialises an empty optimizer by a zero-lr step
    # (Adam's step would become 1); the backend undoes that on save and on restore.
    model, optimizer, scheduler = make(seed=0)
    twin = make(seed=0)
    with manager(tmp_path) as mgr:
        mgr.save(INFO, {"model": model, "optimizer": optimizer}, mode="sync")
    assert not optimizer.state
    train_step(model, optimizer, scheduler, 0)
    train_step(*twin, 0)
    assert_bitwise(snapshot(model, optimizer, scheduler), snapshot(*twin))
    # Restoring that checkpoint into a trained optimizer empties its state again.
    with manager(tmp_path) as mgr:
        mgr.recover({"model": model, "optimizer": optimizer})
    assert not optimizer.state


def test_two_optimizers_pair_with_the_smallest_module_holding_their_params(tmp_path):
    torch.manual_seed(0)
    model = Net()
    body = torch.optim.SGD(model.fc1.parameters(), lr=0.1, momentum=0.9)
    head = torch.optim.Adam(model.fc2.parameters(), lr=0.01)
    x, y = batch(0)
    (model(x) - y).square().mean().backward()
    body.step()
    head.step()
    state = {"model": model, "fc2": model.fc2, "body": body, "head": head}
    expected = copy.deepcopy({"body": body.state_dict(), "head": head.state_dict()})
    with manager(tmp_path) as mgr:
        mgr.save(INFO, state, mode="sync")
    torch.manual_seed(1)
    other = Net()
    like = {"model": other, "fc2": other.fc2,
            "body": torch.optim.SGD(other.fc1.parameters(), lr=0.1, momentum=0.9),
            "head": torch.optim.Adam(other.fc2.parameters(), lr=0.01)}
    with manager(tmp_path) as mgr:
        mgr.recover(like)
    with open(os.path.join(mgr.store.step_path(3), "state", "objects.json")) as stream:
        entries = json.load(stream)["entries"]
    assert (entries["body"]["module"], entries["head"]["module"]) == ("model", "fc2")
    assert_bitwise({"body": like["body"].state_dict(), "head": like["head"].state_dict()},
                   expected)
    assert_bitwise(other.state_dict(), model.state_dict())


def test_auxiliary_item_rides_along_and_each_checkpoint_restores_its_version(tmp_path):
    # A GRPO-style reference policy updated every 4 steps, written by the same DCP backend.
    model, optimizer, scheduler = make(seed=0)
    reference = copy.deepcopy(model)  # version v = updates so far = (global_step + 1) // 4
    versions = {0: copy.deepcopy(reference.state_dict())}
    config = RecoverConfig(every=Every(steps=1), keep_last_n=None)
    with DcpCheckpointManager(tmp_path, recover=config, mode="async",
                              items={"ref": Every(steps=4)}) as mgr:
        info = StepInfo(0, 0, 0, None)
        for step in range(6):
            train_step(model, optimizer, scheduler, step)
            if (step + 1) % 4 == 0:
                reference.load_state_dict(model.state_dict())
                versions[(step + 1) // 4] = copy.deepcopy(reference.state_dict())
            mgr.save(info, {"model": model, "optimizer": optimizer},
                     items={"ref": {"policy": reference}})
            info = info.next()
        mgr.wait()
    assert len(os.listdir(os.path.join(tmp_path, "recover", "items", "ref"))) == 2
    for step, version in ((5, 1), (2, 0)):
        like_ref = Net()
        with DcpCheckpointManager(tmp_path, recover=config) as mgr:
            recovered = mgr.restore(_like_model_and_optimizer(), step=step,
                                    items={"ref": {"policy": like_ref}})
        assert recovered.items["ref"]["policy"] is like_ref
        assert_bitwise(like_ref.state_dict(), versions[version])


def test_a_local_tier_takes_the_frequent_saves_and_recover_reads_the_newest(tmp_path):
    # DcpCheckpointManager passes local= through to CheckpointManager (jaxckpt.manager.local_tier).
    from jaxckpt import LocalTier

    model, optimizer, scheduler = make(seed=0)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}

    def open_manager():
        return DcpCheckpointManager(
            tmp_path / "durable", recover=RecoverConfig(every=Every(steps=4)), mode="async",
            local=LocalTier(tmp_path / "local", every=Every(steps=2)), preemption_signals=())

    with open_manager() as mgr:
        info, saved = StepInfo(0, 0, 0, None), []
        for step in range(6):
            train_step(model, optimizer, scheduler, step)
            saved += [(r.tier, r.step) for r in mgr.maybe_save(info, state)]
            info = info.next()
        mgr.wait()
    assert saved == [("local", 1), ("durable", 3), ("local", 5)]
    expected = snapshot(model, optimizer, scheduler)
    fresh = make(seed=1)
    with open_manager() as mgr:
        names = ("model", "optimizer", "scheduler")
        recovered = mgr.recover(dict(zip(names, fresh, strict=True)))
    assert (recovered.tier, recovered.step_info.global_step) == ("local", 5)
    assert_bitwise(snapshot(*fresh), expected)


def test_damaged_data_of_a_requested_step_leaves_the_live_tensors_untouched(tmp_path):
    # DCP loads into the caller's own tensors and could not take a read back, so every
    # checksum, large data files included, is checked before anything is read.
    config = RecoverConfig(every=Every(steps=1), keep_last_n=None)
    generator = torch.Generator().manual_seed(0)
    with DcpCheckpointManager(tmp_path, recover=config, mode="sync") as mgr:
        for step in (0, 1):
            mgr.save(StepInfo(0, step, step), {"big": torch.randn(512, 1024, generator=generator)})
    step_dir = tmp_path / "recover" / "step_00000001"
    (data,) = step_dir.rglob("*.distcp")
    assert data.stat().st_size > DEFER_CHECKSUMS_OVER
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    data.write_bytes(bytes(damaged))
    live = torch.zeros(512, 1024)
    with DcpCheckpointManager(tmp_path, recover=config) as mgr:
        with pytest.raises(CheckpointCorruptError, match=rf"{data.name}: crc32"):
            mgr.restore({"big": live}, step=1)
        assert torch.count_nonzero(live) == 0
        with pytest.warns(CheckpointWarning, match=rf"step_00000001.*{data.name}: crc32"):
            recovered = mgr.recover({"big": live})
    assert recovered.step_info.global_step == 0 and recovered.state["big"] is live
    expected = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))
    assert torch.equal(live, expected)


def _like_model_and_optimizer():
    model, optimizer, _ = make(seed=3)
    return {"model": model, "optimizer": optimizer}


# ------------------------------------------------------------------------------ errors


def test_mismatch_lists_every_problem_at_once(tmp_path):
    model, optimizer, scheduler = make(seed=0, steps=1)
    with manager(tmp_path) as mgr:
        mgr.save(INFO, {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                        "ema": torch.zeros(3)}, mode="sync")
    wide, wide_optimizer, _ = make(seed=0, hidden=9)
    like = {"model": wide, "optimizer": wide_optimizer, "ema": torch.zeros(3, dtype=torch.int32),
            "extra": torch.zeros(2)}
    with manager(tmp_path) as mgr, pytest.raises(TreeMismatchError) as caught:
        mgr.recover(like)
    text = str(caught.value)
    for fragment in ["state['model']['fc1.weight']: expected shape (9, 5) float32, checkpoint "
                     "has shape (8, 5) float32",
                     "state['optimizer']['state']['fc2.weight']['exp_avg']: expected shape (2, 9)",
                     "state['ema']: expected shape (3,) int32, checkpoint has shape (3,) float32",
                     "state['extra']: missing from checkpoint",
                     "state['scheduler']: not in like (checkpoint has a state_dict)"]:
        assert fragment in text
    assert len(caught.value.problems) > 5
    assert wide.fc1.weight.shape == (9, 5)  # nothing was loaded


def test_optimizer_without_its_module_is_refused_naming_the_fix(tmp_path):
    model, optimizer, _ = make(seed=0, steps=1)
    with manager(tmp_path) as mgr, pytest.raises(ConfigError, match=r"\['optimizer'\].*"
                                                 r"state=\{'model': model, 'optimizer'"):
        mgr.save(INFO, {"optimizer": optimizer})


def test_unsupported_entry_is_refused_before_any_io(tmp_path):
    with manager(tmp_path) as mgr:
        with pytest.raises(TypeError, match=r"state\['lock'\] is a _thread.lock"):
            mgr.save(INFO, {"w": torch.ones(2), "lock": __import__("threading").Lock()})
        loader = torch.utils.data.DataLoader(list(range(4)))
        with pytest.raises(ConfigError, match=r"stateful=\{'data': loader\}"):
            mgr.save(INFO, {"w": torch.ones(2), "data": loader})
        with pytest.raises(CodecError, match=r"state\['note'\]\['when'\]"):
            mgr.save(INFO, {"note": {"when": object()}})
        assert mgr.committed_steps() == []


def test_background_write_failure_surfaces_from_the_next_call(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    def broken(self, plan, planner):
        raise OSError("disk full (injected)")

    model, optimizer, scheduler = make(seed=0, steps=1)
    state = {"model": model, "optimizer": optimizer}
    with manager(tmp_path, mode="async") as mgr:
        monkeypatch.setattr(FileSystemWriter, "write_data", broken)
        report = mgr.save(INFO, state)
        with pytest.raises(CheckpointWriteError, match="disk full"):
            mgr.wait()
        assert report.error is not None and mgr.committed_steps() == []
        monkeypatch.undo()
        mgr.save(INFO.next(), state)  # the next save works
        mgr.wait()
        assert mgr.committed_steps() == [4]


def test_manager_refuses_a_foreign_backend(tmp_path):
    with pytest.raises(ConfigError, match="torch_bridge.DcpBackend"):
        DcpCheckpointManager(tmp_path, backend=object())


# ------------------------------------------------------------------------------ RNG


class FakeCuda:
    """The RNG surface of torch.cuda on a machine with ``count`` GPUs (this one has none)."""

    def __init__(self, count: int):
        self.count = count
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(count)}

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def get_rng_state_all(self):
        return [self.states[i] for i in range(self.count)]

    def set_rng_state(self, state, device):
        self.states[device] = state.clone()

    def install(self, monkeypatch):
        for name in ("is_available", "device_count", "get_rng_state_all", "set_rng_state"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self


def test_rng_roundtrip_restores_cpu_generator():
    backend = DcpBackend()
    torch.manual_seed(5)
    saved = codec.decode(json.loads(json.dumps(codec.encode(backend.rng_state()))))
    expected = torch.rand(4)
    torch.manual_seed(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no CUDA here: no warning about it either
        backend.set_rng_state(saved)
    assert torch.equal(torch.rand(4), expected)
    assert "cuda" not in saved


def test_checkpoint_without_cuda_rng_restores_on_a_cuda_machine_with_a_warning(monkeypatch):
    backend = DcpBackend()
    torch.manual_seed(5)
    written_on_cpu = codec.decode(json.loads(json.dumps(codec.encode(backend.rng_state()))))
    expected = torch.rand(3)
    fake = FakeCuda(2).install(monkeypatch)
    with pytest.warns(CheckpointWarning, match="no CUDA RNG state"):
        backend.set_rng_state(written_on_cpu)
    assert torch.equal(torch.rand(3), expected)  # the CPU entry was still restored
    assert [int(s[0]) for s in fake.get_rng_state_all()] == [0, 1]  # CUDA untouched


def test_cuda_rng_of_every_device_roundtrips_in_one_entry(monkeypatch):
    backend = DcpBackend()
    fake = FakeCuda(2).install(monkeypatch)
    saved = codec.decode(json.loads(json.dumps(codec.encode(backend.rng_state()))))
    assert [int(s[0]) for s in saved["cuda"]] == [0, 1]
    fake.states = {i: torch.full((16,), 9, dtype=torch.uint8) for i in range(2)}
    backend.set_rng_state(saved)
    assert [int(s[0]) for s in fake.get_rng_state_all()] == [0, 1]
    with pytest.warns(CheckpointWarning, match="for 2 device.*sees 1"):
        dcp_backend._restore_cuda_rng(saved["cuda"], FakeCuda(1))
    with pytest.warns(CheckpointWarning, match="no torch CPU RNG state"):
        backend.set_rng_state({"cuda": saved["cuda"]})


# --------------------------------------------------------------------- data loaders


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own
def test_stateful_dataloader_resumes_with_identical_next_batches(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    data = list(range(10))

    def loader(seed):  # own generators: creating an iterator never draws from torch's RNG
        return StatefulDataLoader(data, batch_size=3,
                                  sampler=RandomSampler(data, generator=torch.Generator()
                                                        .manual_seed(seed)),
                                  generator=torch.Generator().manual_seed(seed + 1))

    def take(it_loader, count, iterator):
        out = []
        for _ in range(count):
            item = next(iterator, None)
            if item is None:  # next epoch
                iterator = iter(it_loader)
                item = next(iterator)
            out.append(item.tolist())
        return out, iterator

    model, optimizer, _ = make(seed=0)
    original = loader(0)
    _, iterator = take(original, 3, iter(original))
    with manager(tmp_path) as mgr:
        mgr.save(INFO, {"model": model}, stateful={"loader": original}, mode="sync")
    expected, _ = take(original, 6, iterator)  # the rest of epoch 0 and most of epoch 1

    restored = loader(123)
    with manager(tmp_path) as mgr:
        mgr.recover({"model": model}, stateful={"loader": restored})
    got, _ = take(restored, 6, iter(restored))
    assert got == expected
    assert sorted(sum(expected[:1], [])) != sorted(sum(got[1:2], []))  # not trivially equal


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_loader_without_generator_leaves_torch_rng_as_saved_after_recover_and_iter(tmp_path):
    # With no generator= the iterator draws its base seed from torch's global RNG as it is
    # made. recover() makes the restored iterator itself, before it restores the global RNG,
    # so the loop's next iter() returns it and draws nothing: dropout after a resume sees
    # the RNG the uninterrupted run had.
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = list(range(12))
    torch.manual_seed(3)
    original = StatefulDataLoader(data, batch_size=3, shuffle=True)
    iterator = iter(original)
    next(iterator)
    model, _, _ = make(seed=0)
    with manager(tmp_path) as mgr:
        mgr.save(INFO, {"model": model}, stateful={"loader": original}, mode="sync")
    at_save = torch.get_rng_state()
    expected = [batch.tolist() for batch in iterator]

    torch.manual_seed(7)
    restored = StatefulDataLoader(data, batch_size=3, shuffle=True)
    with manager(tmp_path) as mgr:
        mgr.recover({"model": model}, stateful={"loader": restored})
    resumed = iter(restored)
    assert torch.equal(torch.get_rng_state(), at_save)
    assert [batch.tolist() for batch in resumed] == expected


# --------------------------------------------------------------------- exports, jax


def test_async_export_gets_a_host_copy_taken_at_save_time(tmp_path):
    seen = {}

    def exporter(state, out_dir):
        seen.update(state)
        return 1

    model, optimizer, scheduler = make(seed=0, steps=1)
    expected = copy.deepcopy(model.state_dict())
    export = ExportConfig(every=Every(steps=1), exporter=exporter, mode="async")
    with DcpCheckpointManager(tmp_path, recover=RecoverConfig(mode="off"), export=export) as mgr:
        mgr.maybe_save(INFO, {"model": model, "optimizer": optimizer, "ema": torch.ones(2)})
        train_step(model, optimizer, scheduler, 1)
        mgr.wait()
    assert sorted(seen) == ["ema", "model"]  # model-only: no optimizer
    assert_bitwise(seen["model"], expected)


NO_JAX_SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    import torch_bridge
    before = sorted(m for m in ("torch", "jax") if m in sys.modules)
    import torch
    from jaxckpt import Every, RecoverConfig, StepInfo
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    root = tempfile.mkdtemp()
    config = RecoverConfig(every=Every(steps=1))
    with torch_bridge.DcpCheckpointManager(root, recover=config) as mgr:
        lazy = "torch.distributed.checkpoint" not in sys.modules
        mgr.save(StepInfo(0, 0, 0), {"model": model, "optimizer": optimizer})
    like = {"model": torch.nn.Linear(3, 2)}
    like["optimizer"] = torch.optim.Adam(like["model"].parameters())
    with torch_bridge.DcpCheckpointManager(root, recover=config) as mgr:
        restored = mgr.recover(like) is not None
    same = torch.equal(like["model"].weight, model.weight)
    heavy = sorted({m.split(".")[0] for m in sys.modules}
                   & {"jax", "jaxlib", "orbax", "flax", "optax"})
    print(json.dumps({"before": before, "lazy": lazy, "restored": restored, "same": same,
                      "heavy": heavy}))
""")


def test_torch_path_never_imports_jax():
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", NO_JAX_SCRIPT], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"before": [], "lazy": True, "restored": True, "same": True, "heavy": []}
