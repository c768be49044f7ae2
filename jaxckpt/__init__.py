"""jaxckpt: fault-tolerant checkpointing for JAX/Flax and PyTorch training loops.

One policy layer (when to save, what to keep, how a checkpoint commits, what "latest valid"
means, the full driver state) over interchangeable array backends: Orbax for JAX pytrees
(``jaxckpt.CheckpointManager``) and torch.distributed.checkpoint (``torch_bridge``).

Importing jaxckpt imports neither jax, orbax nor torch; the Orbax backend is loaded when a
manager without an explicit backend is created. A feature whose extra is not installed
raises ``MissingExtraError`` (an ``ImportError``) naming the ``pip install`` that adds it.
"""

from jaxckpt.backends.orbax.import_orbax import import_orbax
from jaxckpt.manager.manager import CheckpointManager, Recovered, SaveReport

from ._version import __version__
from .config import (
    Every,
    ExportConfig,
    KeepBest,
    LocalTier,
    RecoverConfig,
    StepInfo,
    Versioned,
)
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointRootError,
    CheckpointWarning,
    CheckpointWriteError,
    CodecError,
    ConditionalWritesError,
    ConfigError,
    MissingExtraError,
    ObjectStoreError,
    RootLockedError,
    TreeMismatchError,
)
from .loop import batches
from .sampler import IndexSampler

__all__ = [
    "__version__",
    "Every",
    "StepInfo",
    "RecoverConfig",
    "ExportConfig",
    "KeepBest",
    "LocalTier",
    "Versioned",
    "CheckpointManager",
    "import_orbax",
    "IndexSampler",
    "batches",
    "SaveReport",
    "Recovered",
    "CheckpointError",
    "ConfigError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointWriteError",
    "TreeMismatchError",
    "RootLockedError",
    "CheckpointRootError",
    "ConditionalWritesError",
    "ObjectStoreError",
    "CodecError",
    "CheckpointWarning",
    "MissingExtraError",
]
