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
