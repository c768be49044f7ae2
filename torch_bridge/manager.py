"""DcpCheckpointManager: jaxckpt's CheckpointManager with the DCP backend plugged in.

Owns nothing of the policy: triggers, retention, the commit protocol, driver state (counters,
data-loader positions, Python/NumPy RNG), reports and recovery all come from
:class:`jaxckpt.CheckpointManager`. This module only builds a :class:`DcpBackend` (after
``torch.distributed`` is initialised, in a distributed run) and closes it with the manager,
and ``overlap_staging``: a loop's opt-in to staging saves while its next step runs.

Must not import: jax, orbax.
"""

from __future__ import annotations

import os
from typing import Any

from jaxckpt import CheckpointManager, ConfigError, ExportConfig, RecoverConfig
from torch_bridge.dcp import overlap
from torch_bridge.dcp.backend import DcpBackend

__all__ = ["DcpCheckpointManager"]


class DcpCheckpointManager(CheckpointManager):
    """Recovery checkpoints and exports of a PyTorch training run under ``root``.

    The same methods and semantics as :class:`jaxckpt.CheckpointManager`; the state is a dict
    of ``name -> nn.Module | Optimizer | LR scheduler | Stateful | tensor`` (see
    ``docs/torch.md``)::

        state = {"model": model, "optimizer": opt, "scheduler": sched}
        with DcpCheckpointManager(root, recover=RecoverConfig(every=Every(steps=500))) as mgr:
            recovered = mgr.recover(state, stateful={"loader": loader})  # loads in place
            info = recovered.step_info.next() if recovered else StepInfo(0, 0, 0, spe)
            ...
                mgr.maybe_save(info, state)           # returns once tensors are staged
            mgr.save(state=state, mode="sync")        # the final save: the last completed step

    ``recover(like, ...)`` takes the live state dict: modules, optimizers, schedulers and
    tensors are loaded in place and ``recovered.state`` is that same dict.

    In a distributed run, create the manager on every rank after
    ``torch.distributed.init_process_group`` (its constructor is a collective).
    ``backend`` defaults to ``DcpBackend()``, which this manager closes when it closes; pass
    your own ``DcpBackend(...)`` to choose DCP settings (you then close it).

    Args:
        root: a local path or an ``s3://``/``gs://`` URL, as for ``CheckpointManager``.
        recover: the recovery checkpoints' config (default ``RecoverConfig()``).
        export: the exports' config; None: no exports.
        mode: "sync", "async" or "auto".
        backend: a ``DcpBackend``; default ``DcpBackend()``, closed with the manager.
        options: every other keyword of ``CheckpointManager`` (``on_report``,
            ``on_write_error``, ``preemption_signals``, ``items``, ``local``...), unchanged.

    Concurrency contract: as :class:`jaxckpt.CheckpointManager` (one training thread; one
    background thread for commits; one job per root).
    """

    def __init__(self, root: str | os.PathLike[str], *, recover: RecoverConfig | None = None,
                 export: ExportConfig | None = None, mode: str = "auto",
                 backend: DcpBackend | None = None, **options: Any):
        """``options``: every other argument of :class:`jaxckpt.CheckpointManager`
        (``on_report``, ``on_write_error``, ``commit_timeout_s``, ``preemption_signals``,
        ``on_preemption``, ``items``, ``clock``...), passed through unchanged."""
        if backend is not None and not isinstance(backend, DcpBackend):
            raise ConfigError(f"DcpCheckpointManager(backend=...) must be a "
                              f"torch_bridge.DcpBackend, got {type(backend).__name__}. For "
                              f"other backends use jaxckpt.CheckpointManager(backend=...).")
        created = backend is None
        backend = DcpBackend() if backend is None else backend
        try:
            super().__init__(root, recover=recover, export=export, mode=mode, backend=backend,
                             **options)
        except BaseException:
            if created:
                backend.close()
            raise
        self._created_backend = created
        self._fence: overlap.StagingFence | None = None

    def overlap_staging(self, optimizers: Any, modules: Any = ()) -> bool:
        """Let async saves copy their tensors on a worker thread while the loop's next
        forward and backward run, instead of before ``maybe_save``/``save`` return.

        The loop must change the saved tensors only through these optimizers' ``step()`` (and
        module buffers in a forward): each step, and each forward of a module holding saved
        buffers, waits for the copy first. Schedulers, stateful objects and plain values in
        the state are read before the save call returns; modules, optimizers and tensors in
        the state are read on the worker. A loop that changes weights or tensors of the state
        in place elsewhere between a save and the next step (an EMA updated before the step)
        must not use this. Returns False, changing nothing, in a run of several processes:
        there DCP's collectives on a worker could interleave with the step's own in a
        different order on each rank.

        Args:
            optimizers: the optimizer, or a list of them, whose steps update the saved state
                (accelerate's prepared optimizers are accepted).
            modules: the model, or a list of modules, whose forward may change saved buffers
                (BatchNorm statistics); modules without buffers need not be given.
        """
        if not isinstance(self.backend, DcpBackend) or not overlap.single_process():
            return False
        optimizers = [optimizers] if not isinstance(optimizers, (list, tuple)) else optimizers
        modules = [modules] if not isinstance(modules, (list, tuple)) else modules
        for optimizer in optimizers:
            overlap.innermost_optimizer(optimizer)  # TypeError before anything is hooked
        if self._fence is None:
            self._fence = overlap.StagingFence(overlap.attach(self.backend))
        self._fence.install(optimizers, modules)
        return True

    def _shut_down(self) -> None:
        """``CheckpointManager``'s, then close the backend this manager created (before
        ``close`` may end the process by a pending preemption signal)."""
        try:
            super()._shut_down()
        finally:
            fence, self._fence = self._fence, None
            if fence is not None:
                fence.remove()
                if not self._created_backend:
                    overlap.detach(self.backend)  # the caller's backend: as it was given
            if self._created_backend:
                self.backend.close()  # idempotent
