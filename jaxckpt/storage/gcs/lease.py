"""The root lock on GCS: the lease protocol of ``jaxckpt.storage.lease`` over GCS generations.

Owns: ``GCSLease``, whose object is ``{root}/.lock``: taking is an upload with
``ifGenerationMatch=0``; takeover and renewal an upload with the generation last seen; the
release a delete with it (an upload where the delete is answered 501). 412 or 404 is a
``LeaseConflict``. The object's age is the server's ``Date`` minus its ``updated`` time,
read through the client's authorised HTTP session (``Client._http``), which exposes it.

Must not import: jax, orbax, torch. google-cloud-storage comes through ``GCSStorage``.

Concurrency: as ``jaxckpt.storage.lease.ObjectLease``; the GCS server decides between jobs.
"""

from __future__ import annotations

import datetime
import email.utils
import urllib.parse
from typing import TYPE_CHECKING, Any

from jaxckpt.storage.lease import LeaseConflict, LeaseRequestUnsupported, LeaseState, ObjectLease

if TYPE_CHECKING:
    from jaxckpt.storage.gcs.storage import GCSStorage

__all__ = ["GCSLease"]

_READ_TRIES = 5


class _GCSLeaseObject:
    """The four conditional requests of ``jaxckpt.storage.lease.LeaseObject`` on one GCS object."""

    def __init__(self, storage: GCSStorage, name: str):
        self.storage = storage
        self.name = name
        self.url = f"gs://{storage.bucket_name}/{name}"

    def _upload(self, body: bytes, generation: int) -> str:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        try:
            blob = self.storage.upload(self.name, body, if_generation_match=generation)
        except (PreconditionFailed, NotFound) as exc:
            raise LeaseConflict(self.url) from exc
        return str(blob.generation)

    def create(self, body: bytes) -> str:
        return self._upload(body, 0)

    def replace(self, body: bytes, version: str) -> str:
        return self._upload(body, int(version))

    def read(self) -> LeaseState | None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        for _ in range(_READ_TRIES):
            found = self._metadata()
            if found is None:
                return None
            metadata, server_now = found
            generation = int(metadata["generation"])
            updated = datetime.datetime.fromisoformat(metadata["updated"].replace("Z", "+00:00"))
            age = (server_now - updated).total_seconds() if server_now else 0.0
            try:  # the body of the generation whose age was measured
                body = self.storage.download(self.name, if_generation_match=generation)
            except (NotFound, PreconditionFailed):
                continue  # rewritten (or deleted) in between: read again
            return LeaseState(version=str(generation), body=body, age_s=age)
        # Rewritten on every read: someone is renewing it right now, so it is fresh.
        return LeaseState(version=str(generation), body=b"", age_s=0.0)

    def _metadata(self) -> tuple[dict[str, Any], datetime.datetime | None] | None:
        """(the object's metadata, the server's time of the answer), or None when absent."""
        from google.api_core.exceptions import from_http_response

        client = self.storage.client
        url = (f"{client.api_endpoint}/storage/v1/b/"
               f"{urllib.parse.quote(self.storage.bucket_name, safe='')}/o/"
               f"{urllib.parse.quote(self.name, safe='')}")

        def get() -> Any:
            response = client._http.request("GET", url, params={"fields": "generation,updated"},
                                            timeout=self.storage.timeout)
            if response.status_code >= 400 and response.status_code != 404:
                raise from_http_response(response)
            return response

        response = self.storage.retrying(get)
        if response.status_code == 404:
            return None
        date = response.headers.get("Date")
        return response.json(), email.utils.parsedate_to_datetime(date) if date else None

    def delete(self, version: str) -> None:
        from google.api_core.exceptions import MethodNotImplemented, NotFound, PreconditionFailed

        try:
            self.storage.bucket.blob(self.name).delete(
                if_generation_match=int(version), timeout=self.storage.timeout,
                retry=self.storage.retry())
        except (PreconditionFailed, NotFound) as exc:
            raise LeaseConflict(self.url) from exc
        except MethodNotImplemented as exc:
            raise LeaseRequestUnsupported(self.url) from exc


class GCSLease(ObjectLease):
    """A root lease on GCS (held after ``acquire``); see ``jaxckpt.storage.lease``."""

    def __init__(self, storage: GCSStorage, name: str, *, lease_s: float, heartbeat_s: float):
        super().__init__(_GCSLeaseObject(storage, name), lease_s=lease_s,
                         heartbeat_s=heartbeat_s)
        self.storage = storage
        self.name = name
