"""The arguments of ``CheckpointManager`` and of its calls, checked before anything happens.

Owns: the ``ConfigError`` messages for a bad root, config, backend, callback, timeout,
preemption signal list, ``on_preemption`` or ``StepInfo`` (the configs check their own
fields).

Must not import: jax, orbax, torch, or any part of the manager.

Concurrency contract: pure functions of their arguments.
"""

from __future__ import annotations

import os
from typing import Any

from jaxckpt.backends.base import check_backend
from jaxckpt.config import ExportConfig, RecoverConfig, StepInfo
from jaxckpt.errors import ConfigError

__all__ = ["check_arguments", "check_incremental", "check_step_info", "check_signals"]


def check_arguments(root: Any, *, recover: Any, export: Any, backend: Any, on_report: Any,
                     on_write_error: Any, commit_timeout_s: Any,
                     preemption_signals: Any, on_preemption: Any = "exit") -> tuple[int, ...]:
    """``ConfigError`` for the first bad argument of ``CheckpointManager``; returns the
    preemption signals as a tuple."""
    if not isinstance(root, (str, os.PathLike)):
        raise ConfigError(f"root must be a path (str or os.PathLike), got {root!r}.")
    if not isinstance(recover, RecoverConfig):
        raise ConfigError(f"recover must be a jaxckpt.RecoverConfig, got {type(recover).__name__}.")
    if export is not None and not isinstance(export, ExportConfig):
        raise ConfigError(f"export must be a jaxckpt.ExportConfig or None, got "
                          f"{type(export).__name__}.")
    if on_write_error not in ("raise", "warn"):
        raise ConfigError(f"on_write_error must be 'raise' or 'warn', got {on_write_error!r}.")
    if on_report is not None and not callable(on_report):
        raise ConfigError(f"on_report must be callable(report) or None, got {on_report!r}.")
    if (isinstance(commit_timeout_s, bool) or not isinstance(commit_timeout_s, (int, float))
            or not commit_timeout_s > 0):
        raise ConfigError(f"commit_timeout_s must be a positive number of seconds, got "
                          f"{commit_timeout_s!r}.")
    signals = check_signals(preemption_signals)
    if on_preemption not in ("exit", "continue"):
        raise ConfigError(
            f"on_preemption must be 'exit' (end the process as the preemption signal would, "
            f"once its checkpoint committed) or 'continue' (return to the loop, which stops "
            f"on mgr.preempted), got {on_preemption!r}.")
    if backend is not None:
        check_backend(backend)
        check_incremental(recover, backend)
    return signals


def check_incremental(recover: RecoverConfig, backend: Any) -> None:
    """``ConfigError`` for ``RecoverConfig(incremental=True)`` with a backend that cannot
    refer to an earlier checkpoint's files (``BackendFeatures.incremental`` False)."""
    if recover.incremental and not backend.features.incremental:
        raise ConfigError(
            f"RecoverConfig.incremental=True needs a backend that writes incrementally, and "
            f"the {backend.name!r} backend does not. Fix: set incremental=False, or use a "
            f"backend whose features.incremental is True (the Orbax backend, DcpBackend).")


def check_step_info(step_info: Any) -> None:
    if not isinstance(step_info, StepInfo):
        raise ConfigError(f"step_info must be a jaxckpt.StepInfo, got {type(step_info).__name__} "
                          f"{step_info!r}. Write StepInfo(epoch, epoch_step, global_step, "
                          f"steps_per_epoch).")


def check_signals(signals: Any) -> tuple[int, ...]:
    """``preemption_signals`` as a tuple of signal numbers, or ``ConfigError``."""
    try:
        values = tuple(signals)
    except TypeError:
        values = None
    if values is None or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"preemption_signals must be a tuple of signal numbers, got {signals!r}. "
                          f"Write e.g. (signal.SIGTERM,), or () to leave signals alone.")
    return values
