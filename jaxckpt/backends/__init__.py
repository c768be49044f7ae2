"""The array backends: what writes and reads the arrays of a checkpoint.

Owns: the seam between the manager and a backend (``base``: ``Backend``, ``WriteHandle``,
``BackendFeatures``) and the JAX/Flax backend over Orbax (``orbax/``). The PyTorch backend
lives in ``torch_bridge`` (DCP), beside the rest of the torch code.

May import: the standard library and ``jaxckpt.errors``; ``orbax/`` imports what its own
``__init__`` says.

Must not import: jax, orbax, torch, torch_bridge.
"""
