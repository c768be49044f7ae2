"""One object store for a test, S3 or GCS, behind one small interface, so that a test of
behaviour on object storage is written once and parametrized over both.

``object_store(kind, bucket)`` starts the server of ``kind`` on 127.0.0.1 and yields an
``ObjectStore``: for "s3" a moto server (``support.s3_server``); for "gs" the GCS emulator
behind the precondition proxy (``support.gcs_server``; without the proxy a create-only write
could never fail there). ``storage_options`` reach the server; ``env`` is the standard
environment through which a worker process finds it with no ``storage_options``
(``AWS_ENDPOINT_URL`` and credentials; ``STORAGE_EMULATOR_HOST``). Both servers are stopped
when the block ends. ``KINDS`` names the kinds whose client and server are installed.
``fault_proxy_before(store)`` puts a ``support.fault_proxy.FaultProxy`` in front of what the
client reaches (moto itself, or the GCS precondition proxy) for one test.

Imports nothing from the library at module level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Iterator
from typing import Any

__all__ = ["KINDS", "ObjectStore", "object_store"]

_NEEDS = {"s3": ("boto3", "moto"), "gs": ("google.cloud.storage", "gcp_storage_emulator")}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


#: The object-store kinds a test can run against here ("s3", "gs").
KINDS = tuple(kind for kind, modules in _NEEDS.items() if all(map(_installed, modules)))


@dataclasses.dataclass
class ObjectStore:
    """A running server of ``kind`` holding ``bucket``. ``proxy`` is the GCS precondition
    proxy (None for S3), whose fault switches and request log a test may use."""

    kind: str
    bucket: str
    storage_options: dict[str, Any]
    env: dict[str, str]
    proxy: Any = None

    def url(self, prefix: str) -> str:
        """The root URL of ``prefix`` in this store's bucket."""
        return f"{self.kind}://{self.bucket}/{prefix.strip('/')}"

    def storage(self, root: str, **extra: Any) -> Any:
        """The library's ``Storage`` for ``root``, reaching the server directly."""
        from jaxckpt.storage.url import parse_root

        return parse_root(root, {**self.storage_options, **extra})[1]

    def steps(self, root: str) -> tuple[list[int], list[int]]:
        """(committed steps, steps with objects but no marker) under ``root``/recover."""
        from jaxckpt.core.layout import COMMIT_MARKER, parse_step_dirname

        storage = self.storage(root)
        committed, partial = [], []
        for name in storage.list_names(f"{root}/recover"):
            step = parse_step_dirname(name.rstrip("/"))
            if step is not None:
                marked = storage.exists(f"{root}/recover/{name.rstrip('/')}/{COMMIT_MARKER}")
                (committed if marked else partial).append(step)
        return sorted(committed), sorted(partial)


@contextlib.contextmanager
def object_store(kind: str, bucket: str) -> Iterator[ObjectStore]:
    """A fresh server of ``kind`` ("s3" or "gs") holding the empty ``bucket`` (module
    docstring)."""
    if kind == "s3":
        from support.s3_server import moto_s3, server_env

        with moto_s3(bucket) as options:
            yield ObjectStore("s3", bucket, dict(options), server_env(options, {}))
        return
    if kind != "gs":
        raise ValueError(f"unknown object store {kind!r}; one of {sorted(_NEEDS)}")
    from support.gcs_server import PreconditionProxy, emulator

    with emulator(bucket) as endpoint:
        proxy = PreconditionProxy(endpoint)
        try:
            # Retries as on the S3 side (few, short backoff): a failure shows quickly.
            options = {"endpoint_url": proxy.url, "max_attempts": 4, "backoff_s": 0.1,
                       "max_backoff_s": 1.0}
            yield ObjectStore("gs", bucket, options, {"STORAGE_EMULATOR_HOST": proxy.url},
                              proxy)
        finally:
            proxy.close()



@contextlib.contextmanager
def fault_proxy_before(store: ObjectStore) -> Iterator[Any]:
    """A ``FaultProxy`` in front of ``store``'s endpoint, closed when the block ends."""
    from support.fault_proxy import FaultProxy

    front = FaultProxy(store.storage_options["endpoint_url"])
    try:
        yield front
    finally:
        front.close()
