"""Drop-in checkpointing for the trainers people already use, on the JAX side.

Submodules (none is imported here; each imports its trainer when it is imported):
``jaxckpt.integrations.keras``: ``BackupAndRestore``, a ``model.fit`` callback for Keras 3 on
the JAX backend. The PyTorch trainers' integrations live in ``torch_bridge.integrations``.

Must not import: torch, torch_bridge.
"""
