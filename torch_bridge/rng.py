"""The global RNGs of a PyTorch process, captured and restored in one place.

Owns: ``capture_rng``/``restore_rng`` (Python, NumPy, torch CPU and every CUDA device) and
their torch part ``capture_torch_rng``/``restore_torch_rng``, as values that jaxckpt's codec
stores exactly in JSON (tuples, NumPy arrays, bytes: no tensor, so that the state can sit in
a checkpoint's JSON part; never pickle). Used by ``DcpBackend`` (the torch part; Python's
and NumPy's are the manager's, from ``driver_state``), ``use_jaxckpt`` and
``JaxckptCheckpointIO``. Restoring also reads the
older encodings: torch states as tensors (DcpBackend's checkpoints before this module), and
the CPU state under ``"torch"`` (JaxckptCheckpointIO's).

Must not import: jax, orbax.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from jaxckpt.core.extras import requires_extra
from jaxckpt.errors import CheckpointWarning
from jaxckpt.manager import driver_state

with requires_extra("torch", "torch_bridge.rng"):
    import torch

__all__ = ["capture_rng", "restore_rng", "capture_torch_rng", "restore_torch_rng"]


def capture_torch_rng(cuda: Any = None) -> dict[str, Any]:
    """torch's generators: ``{"cpu": state}``, plus ``"cuda"``: every device's state in one
    list when CUDA is available (a restore elsewhere can see a device-count mismatch).

    Args:
        cuda: ``torch.cuda`` (None), or an object with its RNG functions (tests).
    """
    cuda = torch.cuda if cuda is None else cuda
    state: dict[str, Any] = {"cpu": _as_bytes(torch.get_rng_state())}
    if cuda.is_available():
        state["cuda"] = [_as_bytes(item) for item in cuda.get_rng_state_all()]
    return state


def capture_rng() -> dict[str, Any]:
    """Python's, NumPy's and torch's (CPU, every CUDA device) global RNG states."""
    return {**driver_state.global_rng_state(), **capture_torch_rng()}


def restore_rng(saved: Mapping[str, Any], where: str = "the checkpoint") -> None:
    """Set every global RNG to ``saved`` (what :func:`capture_rng` returned, or an older
    encoding); an entry missing warns and keeps that generator's state.

    Args:
        saved: the captured states.
        where: the checkpoint, named in the warnings.
    """
    driver_state.set_global_rng_state(saved, where, stacklevel=2)
    restore_torch_rng(saved, where)


def restore_torch_rng(saved: Any, where: str = "the checkpoint", cuda: Any = None) -> None:
    """Set torch's generators to ``saved`` (:func:`capture_torch_rng`'s result); without
    CUDA here its entry is ignored, with CUDA and no entry the devices keep their state.

    Args:
        saved: the captured states.
        where: the checkpoint, named in the warnings.
        cuda: ``torch.cuda`` (None), or an object with its RNG functions (tests).
    """
    cuda = torch.cuda if cuda is None else cuda
    if not isinstance(saved, Mapping):
        warnings.warn(f"{where}: the torch RNG state is a {type(saved).__name__}, not a dict; "
                      "torch generators keep their current state.", CheckpointWarning,
                      stacklevel=3)
        return
    cpu = saved.get("cpu", saved.get("torch"))
    if cpu is not None:
        torch.set_rng_state(_as_state(cpu))
    else:
        warnings.warn(f"{where} has no torch CPU RNG state; the CPU generator keeps its "
                      "current state.", CheckpointWarning, stacklevel=3)
    if cuda.is_available():
        _restore_cuda(saved.get("cuda"), where, cuda)


def _restore_cuda(saved: Any, where: str, cuda: Any) -> None:
    if saved is None:
        warnings.warn(f"{where} has no CUDA RNG state (written on a machine without CUDA, or "
                      "by an older version); the CUDA generators keep their current state, so "
                      "random ops on the GPU will not repeat exactly.", CheckpointWarning,
                      stacklevel=4)
        return
    count = cuda.device_count()
    if len(saved) != count:
        warnings.warn(f"{where} holds CUDA RNG state for {len(saved)} device(s) and this "
                      f"process sees {count}; restoring the first {min(len(saved), count)}, "
                      "the others keep their current state.", CheckpointWarning, stacklevel=4)
    for index, state in enumerate(saved[:count]):
        cuda.set_rng_state(_as_state(state), index)


def _as_bytes(state: torch.Tensor) -> bytes:
    return bytes(state.cpu().numpy().tobytes())


def _as_state(value: Any) -> torch.Tensor:
    """A generator state as the uint8 tensor torch takes (older manager checkpoints hold
    the tensor)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.frombuffer(bytearray(value), dtype=torch.uint8)
