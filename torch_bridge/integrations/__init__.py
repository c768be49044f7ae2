"""Drop-ins for the trainers people already use; each submodule is imported on its own.

``torch_bridge.integrations.transformers``: ``use_jaxckpt(trainer, root, ...)`` for a Hugging
Face ``Trainer`` and TRL's trainers. ``torch_bridge.integrations.lightning``:
``JaxckptCheckpointIO``, a Lightning checkpoint plugin.

Must not import: jax, orbax.
"""
