"""Staging overlapped with training: an async DCP save started on one reused worker thread.

Owns: ``StagingOverlap``: with it attached to a ``DcpBackend`` an async ``write`` returns at
once and the worker builds the state dicts, plans and copies the tensors to host memory
while the training loop goes on; ``fence`` blocks until that copy is finished. Whoever
attaches it must fence before anything changes the saved tensors (``fence_before_step``:
an optimizer step pre-hook; ``StagingFence`` installs those hooks and the forward pre-hooks
of modules holding buffers); the next write and ``close`` wait for the whole save anyway.
``single_process``: where an integration may attach one.

Must not import: jax, orbax.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["StagingFence", "StagingOverlap", "attach", "detach", "fence_before_step",
           "single_process"]


class StagingOverlap:
    """One worker thread (kept between saves) and the event set once the current save's
    host copy is made (or its staging failed: the error stays on the write's handle).

    Concurrency contract: ``submit`` is called from the backend's writing thread with no
    other save in flight; ``fence`` from any thread, any number of times."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._staged = threading.Event()
        self._staged.set()

    def submit(self, stage: Callable[[], Any]) -> Future[None]:
        """Run ``stage`` (returns DCP's upload future, or None when nothing is left to wait
        for) on the worker; the returned future finishes when the upload does."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="jaxckpt-dcp-stage")
        self._staged.clear()
        return self._executor.submit(self._run, stage)

    def _run(self, stage: Callable[[], Any]) -> None:
        try:
            upload = stage()
        finally:
            self._staged.set()
        if upload is not None:
            upload.result()

    def fence(self, timeout_s: float | None = None) -> bool:
        """Block until the in-flight save's host copy is made; False on a timeout."""
        return self._staged.wait(timeout_s)

    def close(self) -> None:
        """Stop the worker once its job is done. Idempotent."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def attach(backend: Any) -> StagingOverlap:
    """Make ``backend``'s async writes overlap their staging (the one attached already, if
    any); the caller fences before the saved tensors change.

    Args:
        backend: a ``torch_bridge.DcpBackend``.
    """
    current = getattr(backend, "_overlap", None)
    if current is None:
        current = StagingOverlap()
        backend._overlap = current
    return current


def detach(backend: Any) -> None:
    """Stage ``backend``'s next writes on the calling thread again (after any in flight).

    Args:
        backend: a ``torch_bridge.DcpBackend``.
    """
    current = getattr(backend, "_overlap", None)
    if current is not None:
        current.fence()
        backend._overlap = None
        current.close()


def single_process() -> bool:
    """Whether this run has no process group of more than one process: where an
    integration may attach a ``StagingOverlap``. Several processes stage on the training
    thread: DCP's collectives (and FSDP's state-dict gathers) on a worker could interleave
    with the step's own collectives in a different order on each rank."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def fence_before_step(optimizer: Any, staging: StagingOverlap) -> Any:
    """Hook ``optimizer.step`` so that no update starts before ``staging``'s copy is made;
    returns the hook's handle (``.remove()``). A step given a closure (Lightning runs the
    forward and backward in one, inside ``step``) waits after each call of the closure,
    so the forward and backward still overlap the copy; a step without one waits at once.

    Args:
        optimizer: a ``torch.optim.Optimizer``, or a wrapper of one in ``.optimizer``
            (accelerate's ``AcceleratedOptimizer``): the optimizer inside is hooked.
        staging: the ``StagingOverlap`` attached to the backend that saves its tensors.
    """
    optimizer = innermost_optimizer(optimizer)
    def before_step(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # torch hands the hook step's arguments with the optimizer first: (self, closure?)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            staging.fence()
            return None

        def fenced() -> Any:  # torch's optimizers call it before they change anything
            result = closure()
            staging.fence()
            return result
        if "closure" in kwargs:
            return args, {**kwargs, "closure": fenced}
        return (args[0], fenced, *args[2:]), kwargs

    return optimizer.register_step_pre_hook(before_step)


def innermost_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside wrappers that keep it in ``.optimizer`` (accelerate's
    ``AcceleratedOptimizer`` has no step hooks of its own); TypeError when there is none."""
    inner = optimizer
    while not hasattr(inner, "_optimizer_step_pre_hooks") and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if not hasattr(inner, "_optimizer_step_pre_hooks"):
        raise TypeError(f"{type(optimizer).__qualname__} is not a torch.optim.Optimizer (nor "
                        "a wrapper of one in .optimizer): its steps cannot wait for a save's "
                        "staging copy. Save with mode='sync', or do not overlap the staging.")
    return inner


class StagingFence:
    """The hooks that make a training loop wait for a save's staging copy before the saved
    tensors change: each optimizer's update (``fence_before_step``: after the closure, when
    the step is given one, so the forward and backward overlap the copy) and the forward of
    each module holding saved buffers (BatchNorm's statistics change in its forward).
    Tensors changed in place elsewhere between a save and the next update (an EMA updated
    before the step, weights edited by hand) are not fenced: such a loop saves without the
    overlap.

    Concurrency contract: installed and removed on the training thread; the hooks run there.
    """

    def __init__(self, staging: StagingOverlap) -> None:
        self._staging = staging
        self._hooked: dict[int, Any] = {}  # id of an optimizer or module -> hook handle
        self._objects: list[Any] = []  # keeps the hooked objects (and so their ids) alive

    def install(self, optimizers: Any, modules: Any = ()) -> None:
        """Hook the given optimizers, and the submodules of ``modules`` that hold saved
        buffers, not hooked yet (a second call with the same objects does nothing).

        Args:
            optimizers: torch optimizers (or wrappers of one, see ``innermost_optimizer``).
            modules: ``nn.Module``s whose forward may change saved buffers.
        """
        for optimizer in optimizers:
            inner = innermost_optimizer(optimizer)
            if id(inner) not in self._hooked:
                self._hook(inner, fence_before_step(inner, self._staging))
        for module in modules:
            for owner in module.modules():
                if id(owner) not in self._hooked and any(
                        buffer is not None and name not in owner._non_persistent_buffers_set
                        for name, buffer in owner._buffers.items()):
                    self._hook(owner, owner.register_forward_pre_hook(self._wait))

    def _hook(self, owner: Any, handle: Any) -> None:
        self._hooked[id(owner)] = handle
        self._objects.append(owner)

    def _wait(self, *_: Any) -> None:
        self._staging.fence()

    def remove(self) -> None:
        """Remove every hook. Idempotent."""
        hooked, self._hooked, self._objects = self._hooked, {}, []
        for handle in hooked.values():
            handle.remove()
