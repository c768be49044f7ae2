"""Staging overlapped with training: an async DCP save started on one reused worker thread.

Owns: ``StagingOverlap``: with it attached to a ``DcpBackend`` an async ``write`` returns at
once and the worker builds the state dicts, plans and copies the tensors to host memory
while the training loop goes on; ``fence`` blocks until that copy is finished. Whoever
attaches it must fence before anything changes the saved tensors (``fence_before_step``:
an optimizer step pre-hook); the next write and ``close`` wait for the whole save anyway.
``single_process``: where an integration may attach one.

Must not import: jax, orbax.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["StagingOverlap", "attach", "detach", "fence_before_step", "single_process"]


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
        optimizer: a ``torch.optim.Optimizer`` (anything with ``register_step_pre_hook``).
        staging: the ``StagingOverlap`` attached to the backend that saves its tensors.
    """
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
