"""Keras 3 on the JAX backend: ``BackupAndRestore``, a ``model.fit`` callback whose
checkpoints are jaxckpt's (asynchronous, verified, retained) and whose resume is exact.

Importing this module imports Keras, which must run on the JAX backend (``KERAS_BACKEND=jax``
set before Keras is first imported); otherwise it raises ``ConfigError`` saying so.

Must not import: torch, torch_bridge.
"""

from .callback import BackupAndRestore

__all__ = ["BackupAndRestore"]
