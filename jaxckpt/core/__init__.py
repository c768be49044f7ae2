"""The pure layer: the decisions and the formats, with no I/O of their own.

Owns: when a save is due and what to keep (``policy``, ``retention``), every name under a
root (``layout``), the ``COMMITTED`` manifest (``manifest``), the JSON codec of driver state
(``codec``), checksums (``checksum``), the ``tree.json`` record (``tree_record``) and the
table of extras (``extras``).

May import: the standard library, numpy (and ml_dtypes, google-crc32c where installed), and
of jaxckpt only ``jaxckpt.errors`` and ``jaxckpt.config``; ``codec`` alone imports torch,
inside the function that decodes a torch value. tests/unit/test_architecture.py holds the
folder to this. Outside jaxckpt's library, torch_bridge and the tools use only the public
modules that test names.

Must not import: jax, jaxlib, orbax, flax, optax, torch, tensorstore, torch_bridge.
"""
