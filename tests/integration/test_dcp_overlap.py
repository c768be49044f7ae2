"""``dcp.overlap.fence_before_step``: a step given a closure waits after the closure (the
forward and backward overlap the copy), a step without one waits before anything."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from torch_bridge.dcp.overlap import StagingOverlap, fence_before_step  # noqa: E402


@pytest.mark.parametrize("call", ["closure=", "positional", "none"])
def test_the_update_waits_for_the_copy_and_the_closure_does_not(call):
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    events: list[str] = []
    optimizer.register_step_post_hook(lambda *_: events.append("step"))
    release = threading.Event()
    staging = StagingOverlap()
    try:
        def stage() -> None:
            release.wait(10)
            events.append("staged")

        hook = fence_before_step(optimizer, staging)
        staging.submit(stage)

        def closure() -> torch.Tensor:
            events.append("closure")
            release.set()  # the copy may end only once the closure has run
            optimizer.zero_grad()
            loss = (weight * 2).sum()
            loss.backward()
            return loss

        if call == "none":
            release.set()
            closure()
            optimizer.step()
        elif call == "positional":
            optimizer.step(closure)
        else:
            optimizer.step(closure=closure)
        assert events == ["closure", "staged", "step"]
        hook.remove()
        optimizer.step()
        assert events[-1] == "step" and events.count("staged") == 1
    finally:
        release.set()
        staging.close()


def test_a_hand_loop_opting_in_saves_the_state_of_its_save_step(tmp_path):
    """``DcpCheckpointManager.overlap_staging``: ``maybe_save`` returns before the (slowed)
    copy is made, the next forward of the BatchNorm model and the next update wait for it,
    and the checkpoint holds the weights, statistics, AdamW and scheduler state of the save
    step bit for bit."""
    import time

    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from jaxckpt import Every, RecoverConfig, StepInfo
    from torch_bridge import DcpBackend, DcpCheckpointManager

    events: list[str] = []

    class SlowStager(DefaultStager):
        def stage(self, state_dict, **kwargs):
            time.sleep(0.3)
            events.append("staged")
            return super().stage(state_dict, **kwargs)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                    torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        return {"model": model, "optimizer": optimizer, "scheduler": scheduler}

    state = build()
    model, optimizer = state["model"], state["optimizer"]
    model.register_forward_pre_hook(lambda *_: events.append("forward"))
    optimizer.register_step_post_hook(lambda *_: events.append("step"))
    backend = DcpBackend(async_checkpointer="thread")
    backend._stager = SlowStager(StagingOptions(False, False, False, False))
    expected: dict[str, torch.Tensor] = {}
    with DcpCheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=3)),
                              mode="async", backend=backend) as mgr:
        assert mgr.overlap_staging(state["optimizer"], state["model"]) is True
        # after the fence's hook on the BatchNorm: runs once its wait is over
        model[1].register_forward_pre_hook(lambda *_: events.append("batchnorm"))
        for index in range(4):
            loss = model(torch.randn(5, 4)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state["scheduler"].step()
            if index == 2:
                expected = {k: v.clone() for k, v in model.state_dict().items()}
                expected.update({f"adam.{i}.{k}": v.clone() for i, s in
                                 optimizer.state_dict()["state"].items() for k, v in s.items()})
                events.append("save")
            mgr.maybe_save(StepInfo(0, index, index), state)
    backend.close()
    # the save returned at once; the next forward started, and waited at the BatchNorm
    # (its buffers are saved) for the copy, before the update
    assert events == (["forward", "batchnorm", "step"] * 3
                      + ["save", "forward", "staged", "batchnorm", "step"])
    restored = build()
    with DcpCheckpointManager(tmp_path) as mgr:
        assert mgr.recover(restored).step_info.global_step == 2
    got = dict(restored["model"].state_dict())
    got.update({f"adam.{i}.{k}": v for i, s in
                restored["optimizer"].state_dict()["state"].items() for k, v in s.items()})
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert restored["scheduler"].last_epoch == 3


def test_overlap_staging_refuses_what_is_not_an_optimizer(tmp_path):
    from torch_bridge import DcpCheckpointManager

    with DcpCheckpointManager(tmp_path) as mgr, pytest.raises(TypeError, match="Optimizer"):
        mgr.overlap_staging(torch.nn.Linear(2, 2))
