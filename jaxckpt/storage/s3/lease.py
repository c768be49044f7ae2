"""The root lock on S3: the lease protocol of ``storage.lease`` over S3's conditional requests.

Owns: ``S3Lease``, a ``storage.lease.ObjectLease`` whose object is ``{root}/.lock`` in the storage's
bucket. Taking it is a PUT with ``If-None-Match: *``; a takeover, a renewal and the release
are a PUT or DELETE with ``If-Match`` on the ETag last seen (a server that answers the
conditional DELETE 501, as LocalStack does, gets the release as a conditional PUT instead:
``LeaseRequestUnsupported``). The age of the object is the
server's clock (the GET's ``Date``) minus its ``Last-Modified``. A 412 (condition failed), a
409 (a concurrent conditional write) or a 404 (the object vanished) is a ``LeaseConflict``.

Must not import: jax, orbax, torch.

Concurrency contract: as ``jaxckpt.storage.lease.ObjectLease``; the S3 server decides between jobs.
"""

from __future__ import annotations

import email.utils
from typing import TYPE_CHECKING

from jaxckpt.storage.lease import LeaseConflict, LeaseRequestUnsupported, LeaseState, ObjectLease
from jaxckpt.storage.s3.storage import is_not_found, is_precondition_failed

if TYPE_CHECKING:
    from jaxckpt.storage.s3.storage import S3Storage

__all__ = ["S3Lease"]


class _S3LeaseObject:
    """The four conditional requests of ``jaxckpt.storage.lease.LeaseObject`` on one S3 key."""

    def __init__(self, storage: S3Storage, key: str):
        self.storage = storage
        self.key = key
        self.url = f"s3://{storage.bucket}/{key}"

    def _put(self, body: bytes, **condition: str) -> str:
        try:
            response = self.storage.client.put_object(
                Bucket=self.storage.bucket, Key=self.key, Body=body, **condition)
        except Exception as exc:
            if is_precondition_failed(exc) or is_not_found(exc):
                raise LeaseConflict(self.url) from exc
            raise
        return str(response["ETag"])

    def create(self, body: bytes) -> str:
        return self._put(body, IfNoneMatch="*")

    def replace(self, body: bytes, version: str) -> str:
        return self._put(body, IfMatch=version)

    def read(self) -> LeaseState | None:
        try:
            response = self.storage.client.get_object(Bucket=self.storage.bucket, Key=self.key)
        except Exception as exc:
            if is_not_found(exc):
                return None
            raise
        body = response["Body"].read()
        now = response["ResponseMetadata"]["HTTPHeaders"].get("date")
        server_now = email.utils.parsedate_to_datetime(now) if now else None
        age = (server_now - response["LastModified"]).total_seconds() if server_now else 0.0
        return LeaseState(version=str(response["ETag"]), body=body, age_s=age)

    def delete(self, version: str) -> None:
        try:
            self.storage.client.delete_object(Bucket=self.storage.bucket, Key=self.key,
                                              IfMatch=version)
        except Exception as exc:
            if is_precondition_failed(exc) or is_not_found(exc):
                raise LeaseConflict(self.url) from exc
            if _not_implemented(exc):
                raise LeaseRequestUnsupported(self.url) from exc
            raise


def _not_implemented(exc: Exception) -> bool:
    """The server answered 501: it does not implement the request (as sent)."""
    response = getattr(exc, "response", None) or {}
    return response.get("Error", {}).get("Code") == "NotImplemented" or \
        response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 501


class S3Lease(ObjectLease):
    """A root lease on S3 (held after ``acquire``); see ``jaxckpt.storage.lease``."""

    def __init__(self, storage: S3Storage, key: str, *, lease_s: float, heartbeat_s: float):
        super().__init__(_S3LeaseObject(storage, key), lease_s=lease_s,
                         heartbeat_s=heartbeat_s)
        self.storage = storage
        self.key = key
