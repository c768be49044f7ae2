"""The PyTorch backend: training state written and read by torch.distributed.checkpoint.

Owns: ``DcpBackend`` (``backend``) and its parts: where its files live, a local directory or
an object store (``files``), the checksumming local writer (``local_writer``), streamed
uploads (``upload``), loading DCP's metadata without trusting it (``metadata``) and the
layout of one tensor record proven from its bytes (``records``).

May import: torch and jaxckpt's library. Importing this package loads no torch:
``DcpBackend`` loads its module on first use.

Must not import: jax, orbax, flax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_bridge.dcp.backend import DcpBackend as DcpBackend

__all__ = ["DcpBackend"]


def __getattr__(name: str) -> Any:
    if name != "DcpBackend":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.backend").DcpBackend
