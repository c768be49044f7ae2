"""torch_bridge: jaxckpt for PyTorch loops (DCP checkpoints) and Hugging Face export.

``DcpCheckpointManager`` is jaxckpt's CheckpointManager (same policy, store and driver) with
``DcpBackend``, which writes torch state with torch.distributed.checkpoint. See docs/torch.md.

Importing torch_bridge imports neither jax nor torch: each name loads its module on first
use (a torch user never pays for jax; the HF bridge needs neither, though writing an
export's config files goes through transformers, which loads torch when it is installed).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load lazily below
    # `X as X` marks a re-export (linters cannot read the computed __all__ below).
    from torch_bridge.dcp.backend import DcpBackend as DcpBackend

    from .hf import (
        ARCHITECTURES as ARCHITECTURES,
        HFExporter as HFExporter,
        HFMismatchError as HFMismatchError,
        export_hf as export_hf,
        hf_exporter as hf_exporter,
        load_hf as load_hf,
    )
    from .manager import DcpCheckpointManager as DcpCheckpointManager

# name -> submodule that defines it
_EXPORTS = {
    "DcpCheckpointManager": "manager",
    "DcpBackend": "dcp.backend",
    # Hugging Face export/import (numpy + safetensors; no jax, no torch)
    "export_hf": "hf",
    "load_hf": "hf",
    "hf_exporter": "hf",
    "HFExporter": "hf",
    "HFMismatchError": "hf",
    "ARCHITECTURES": "hf",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_bridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
