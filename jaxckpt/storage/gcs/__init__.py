"""Google Cloud Storage and its emulators: ``GCSStorage`` (``storage``) and the root lease
over object generations (``lease``). google-cloud-storage is imported lazily.

Must not import: jax, orbax, torch, torch_bridge.
"""
