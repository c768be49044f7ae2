"""The commit protocol over one storage: what makes a directory a checkpoint, and its life.

Owns: ``CheckpointStore`` (``store``: staging, the ``COMMITTED`` manifest, listing, deleting),
the steps that differ on an object store (``object_steps``), whose a root or a directory is
(``ownership``), checkpoints pinned by hand (``pins``), how a restore verifies what it reads
(``verification``), checksums deferred to the reader (``deferred_checks``) and fetching a
restore's files ahead of its reader (``prefetch``).

May import: the standard library and, of jaxckpt, ``core``, ``storage``, ``config`` and
``errors``. The manager drives this package; nothing here knows a backend or a framework.

Must not import: jax, orbax, torch, boto3, google, torch_bridge.
"""
