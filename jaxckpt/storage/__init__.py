"""The I/O seam: where checkpoint bytes are kept, and the lock on a root.

Owns: the ``Storage`` interface (``base``) and POSIX directories (``posix``), what a root
string names (``url``), the lease protocol an object store's root lock follows (``lease``,
``lease_holder``), the conditional-write check a root's opening makes (``write_probe``),
readers over several buffers (``readers``), page-aligned memory for file I/O (``buffers``),
and the two object stores, ``s3/`` and ``gcs/``.

May import: the standard library, numpy (``buffers``) and, of jaxckpt, ``core`` and
``errors``; boto3 only under ``s3/``, google-cloud-storage only under ``gcs/``, each lazily.
Nothing here knows a checkpoint's commit protocol (``jaxckpt.commit``) or a framework.

Must not import: jax, orbax, torch, torch_bridge.
"""
