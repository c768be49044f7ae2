"""What a root string names: a local path or an object-store URL, decided in one place.

Owns: ``parse_root`` (a root -> ("local", path), ("s3", S3Storage) or ("gs", GCSStorage)),
``root_scheme`` (the same decision without building a client) and ``local_root`` (for code
that writes local paths only: a local path, or ``CheckpointRootError`` for a URL). Every
scheme other than ``s3://`` and ``gs://`` is refused up front, naming the scheme and what is
supported, so that a URL is never taken for a relative path (which would create a directory
named ``s3:`` in the working directory).

Must not import: jax, orbax, torch, boto3, google (``jaxckpt.storage.s3.storage`` and
``jaxckpt.storage.gcs.storage`` are imported only for a root of their scheme).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Literal

from jaxckpt.errors import CheckpointRootError
from jaxckpt.storage.base import Storage

__all__ = ["parse_root", "root_scheme", "local_root", "is_url",
           "OBJECT_STORE_ARRAYS_UNSUPPORTED"]

RootKind = Literal["local", "s3", "gs"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_SUPPORTED = "local paths, s3://BUCKET/PREFIX and gs://BUCKET/PREFIX"

OBJECT_STORE_ARRAYS_UNSUPPORTED = (
    "Object-storage roots are not supported by the array backends yet: Orbax and "
    "torch.distributed.checkpoint cannot write a jaxckpt checkpoint to {url} (Orbax's "
    "finalize renames directories, which S3 cannot do). Train against a local or network "
    "filesystem root and copy committed checkpoints to object storage; `jaxckpt ls` and "
    "`jaxckpt verify` read s3:// and gs:// roots.")


def is_url(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` is a ``scheme://`` URL (of any scheme) rather than a local path."""
    return isinstance(root, str) and _SCHEME.match(root) is not None


def root_scheme(root: str | os.PathLike[str]) -> RootKind:
    """"local", "s3" or "gs" for a root; ``CheckpointRootError`` for any other
    ``scheme://``."""
    if not isinstance(root, str):
        return "local"  # an os.PathLike is a path
    match = _SCHEME.match(root)
    if match is None:
        return "local"
    scheme = match.group(1).lower()
    if scheme == "s3":
        return "s3"
    if scheme == "gs":
        return "gs"
    raise CheckpointRootError(
        f"{root!r}: the {scheme}:// scheme is not supported; jaxckpt takes {_SUPPORTED}. "
        f"Nothing was written.")


def parse_root(root: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
               ) -> tuple[Literal["local"], str] | tuple[Literal["s3", "gs"], Storage]:
    """("local", path), or ("s3", an ``S3Storage``) / ("gs", a ``GCSStorage``) serving the
    URL's bucket and prefix, the root itself being the URL, without a trailing "/".
    ``storage_options`` (the client's endpoint, region, credentials:
    ``storage.s3.storage.s3_client``, ``storage.gcs.storage.gcs_client``; ``lease_s``,
    ``heartbeat_s`` of the root lease; ``conditional_writes``, ``jaxckpt.storage.write_probe``) are
    for object-store roots only."""
    kind = root_scheme(root)
    if kind == "local":
        if storage_options:
            raise CheckpointRootError(
                f"storage_options={dict(storage_options)!r} were given for the local root "
                f"{os.fspath(root)!r}; they apply to s3:// and gs:// roots only")
        return "local", os.fspath(root)
    options, lease = _lease_options(storage_options)
    from jaxckpt.storage.write_probe import CHECK, OPTION, conditional_writes_mode

    writes = conditional_writes_mode(options.pop(OPTION, CHECK))
    if kind == "gs":
        return "gs", _gcs_storage(str(root), options, lease, writes)
    from jaxckpt.storage.s3.storage import S3Storage, split_s3_url

    bucket, prefix = split_s3_url(str(root))
    if not prefix:
        raise CheckpointRootError(f"{root!r}: give a prefix below the bucket "
                                  f"(s3://{bucket}/PREFIX), not the whole bucket")
    return "s3", S3Storage(bucket, prefix, storage_options=options, conditional_writes=writes,
                           **lease)


def local_root(root: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """``root`` unchanged when it is a local path; ``CheckpointRootError`` for an ``s3://``
    or ``gs://`` root and for any other scheme: for code that writes local paths only, called
    before it creates anything."""
    if root_scheme(root) in ("s3", "gs"):
        raise CheckpointRootError(f"{root!r}: " + OBJECT_STORE_ARRAYS_UNSUPPORTED.format(
            url=root) + " Nothing was written.")
    return root


def _gcs_storage(root: str, storage_options: Mapping[str, Any],
                 lease: Mapping[str, float], conditional_writes: str) -> Storage:
    from jaxckpt.storage.gcs.storage import GCSStorage, split_gs_url

    bucket, prefix = split_gs_url(root)
    if not prefix:
        raise CheckpointRootError(f"{root!r}: give a prefix below the bucket "
                                  f"(gs://{bucket}/PREFIX), not the whole bucket")
    return GCSStorage(bucket, prefix, storage_options=storage_options,
                      conditional_writes=conditional_writes, **lease)


def _lease_options(storage_options: Mapping[str, Any] | None
                   ) -> tuple[dict[str, Any], dict[str, float]]:
    """``storage_options`` split into the client's options and the root lease's timing."""
    options = dict(storage_options or {})
    lease: dict[str, float] = {name: float(options.pop(name))
                               for name in ("lease_s", "heartbeat_s") if name in options}
    return options, lease
