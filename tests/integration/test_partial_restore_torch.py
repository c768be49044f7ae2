"""Partial restore with DcpCheckpointManager: only the model of a checkpoint of model,
optimizer and scheduler is loaded, and DCP reads only its tensors (observed through the
storage reader DCP is given); a key of like that was never saved is named in the error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jaxckpt import Every, RecoverConfig, StepInfo, TreeMismatchError
from torch_bridge import DcpCheckpointManager
from torch_bridge.dcp import metadata as dcp_metadata

INFO = StepInfo(0, 3, 3, None)


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 64)
        self.body = nn.Linear(64, 64)


class Net(Backbone):
    """The backbone and a head: a fine-tuning job keeps the backbone, brings a new head."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 2)

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.embed(x)))))


def trained(seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 5)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}


def manager(root):
    return DcpCheckpointManager(root, recover=RecoverConfig(every=Every(steps=1)),
                                preemption_signals=())


@pytest.fixture
def dcp_reads(monkeypatch):
    """(key, bytes) of every tensor DCP reads from storage through the backend's reader."""
    seen: list[tuple[str, int]] = []
    real = dcp_metadata.safe_reader

    def counting_reader(directory):
        reader = real(directory)
        read_data = reader.read_data

        def recording(plan, planner):
            for item in plan.items:
                index = item.storage_index
                seen.append((index.fqn, reader.storage_data[index].length))
            return read_data(plan, planner)

        reader.read_data = recording
        return reader

    monkeypatch.setattr(dcp_metadata, "safe_reader", counting_reader)
    return seen


def test_model_only_restore_reads_only_the_model(tmp_path, dcp_reads):
    state = trained()
    with manager(tmp_path) as mgr:
        mgr.save(INFO, state, mode="sync")
    torch.manual_seed(9)
    fresh = Net()  # evaluation: no optimizer, no scheduler
    dcp_reads.clear()
    with manager(tmp_path) as mgr:
        restored = mgr.restore({"model": fresh}, partial=True)
    assert list(restored.state) == ["model"] and restored.state["model"] is fresh
    for key, value in state["model"].state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    keys = {key for key, _ in dcp_reads}
    assert keys == {f"model/{key}" for key in fresh.state_dict()}
    optimizer_bytes = sum(t.numel() * t.element_size()
                          for s in state["optimizer"].state.values() for t in s.values())
    assert sum(size for _, size in dcp_reads) < optimizer_bytes  # Adam's moments: 2x params


def test_partial_restore_into_part_of_a_module(tmp_path, dcp_reads):
    state = trained()
    with manager(tmp_path) as mgr:
        mgr.save(INFO, state, mode="sync")
    backbone = Backbone()
    dcp_reads.clear()
    with manager(tmp_path) as mgr:
        mgr.restore({"model": backbone}, partial=True)
    assert torch.equal(backbone.body.weight, state["model"].body.weight)
    assert not any(key.startswith("model/head") for key, _ in dcp_reads)


def test_a_key_never_saved_is_named(tmp_path):
    state = trained()
    with manager(tmp_path) as mgr:
        mgr.save(INFO, {"model": state["model"], "optimizer": state["optimizer"]}, mode="sync")
    with manager(tmp_path) as mgr:
        with pytest.raises(TreeMismatchError) as raised:
            mgr.restore({"model": Net(), "scheduler": state["scheduler"],
                         "extra": torch.zeros(3)}, partial=True)
        message = str(raised.value)
        assert "state['scheduler']: missing from checkpoint" in message
        assert "state['extra']: missing from checkpoint" in message
        assert "not in like" not in message
        # Without partial=True, the entries like leaves out are mismatches, and the fix says so.
        with pytest.raises(TreeMismatchError, match="pass partial=True"):
            mgr.restore({"model": Net()})


def test_recover_partial_returns_the_step_and_restores_only_like(tmp_path):
    state = trained()
    with manager(tmp_path) as mgr:
        mgr.save(INFO, state, mode="sync")
    fresh = trained(seed=3)
    scheduler_before = fresh["scheduler"].state_dict()
    with manager(tmp_path) as mgr:
        recovered = mgr.recover({"model": fresh["model"]}, partial=True)
    assert recovered.step_info == INFO
    assert torch.equal(fresh["model"].head.weight, state["model"].head.weight)
    assert fresh["scheduler"].state_dict() == scheduler_before
