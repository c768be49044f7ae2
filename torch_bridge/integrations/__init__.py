"""Drop-in checkpointing for the trainers people already use (issue 31).

Submodules, imported by name (this package imports nothing):
``torch_bridge.integrations.transformers`` (``use_jaxckpt`` for Hugging Face ``Trainer``) and
``torch_bridge.integrations.lightning`` (``JaxckptCheckpointIO`` for ``lightning.Trainer``).

Must not import: jax, orbax.
"""
