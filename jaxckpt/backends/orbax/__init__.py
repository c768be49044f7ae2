"""The JAX/Flax backend: pytrees of arrays stored in Orbax's layout.

Owns: ``OrbaxBackend`` (``backend``) and its parts: its settings (``options``), the record of
saved leaves (``tree``), where each leaf goes (``plan``), the write path (``write``), matching
``like`` to tree.json (``match``), the read path (``read``), placing arrays on devices
(``place``), the writer of a multi-process run (``shards``), the facts of a
``jax.distributed`` run (``process``), where its files live (``files``, ``locations``),
Orbax's zarr3 form (``zarr_format``) and the I/O of its chunk files (``chunk_io``), live Flax
NNX objects (``nnx_live``) and importing plain Orbax checkpoints (``import_orbax``).

May import: jax, orbax, flax and the rest of jaxckpt's library. Importing this package loads
no framework: ``OrbaxBackend`` and ``import_orbax`` load their modules on first use.

Must not import: torch, torch_bridge.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxckpt.backends.orbax.backend import OrbaxBackend as OrbaxBackend
    from jaxckpt.backends.orbax.import_orbax import import_orbax as import_orbax

_EXPORTS = {"OrbaxBackend": "backend", "import_orbax": "import_orbax"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
