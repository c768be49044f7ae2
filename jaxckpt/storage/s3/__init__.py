"""S3 and S3-protocol servers: ``S3Storage`` (``storage``), streamed uploads (``upload``) and
the root lease over conditional requests (``lease``). boto3 is imported lazily.

Must not import: jax, orbax, torch, torch_bridge.
"""
