"""The root lock on S3: a lease object, created only if absent and renewed by a heartbeat.

Owns: ``S3Lease``. The lock of a root is the object ``{root}/.lock`` holding JSON (holder
token, host, pid, lease length). Taking it: a create-only PUT (``If-None-Match: *``). When
the object is there, its age is the server's clock (the GET's ``Date``) minus its
``Last-Modified``: younger than the lease length its writer recorded, the root is held
(``RootLockedError`` naming the holder); older, the holder stopped renewing (killed,
frozen), and the lease is taken over with a PUT conditional on the old ETag (``If-Match``),
so of several takers exactly one wins. Ages come from the server's clock only, so clocks of
the hosts need not agree.

A heartbeat thread renews the lease every ``heartbeat_s`` with a PUT conditional on the ETag
of the last renewal; if that condition fails, someone took the lease over (this job stalled
longer than the lease): the heartbeat stops and logs an error, and ``lost`` says so.
Releasing deletes the object if it is still ours (a DELETE conditional on our ETag).

Must not import: jax, orbax, torch.

Concurrency contract: one lease object per holder; ``release`` may be called from any
thread, any number of times. Across jobs and hosts the server's conditional writes decide.
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from .errors import RootLockedError
from .s3_storage import is_not_found, is_precondition_failed

if TYPE_CHECKING:
    from .s3_storage import S3Storage

__all__ = ["S3Lease"]

log = logging.getLogger("jaxckpt")


class S3Lease:
    """A held (after ``acquire``) root lease on S3; see the module docstring."""

    def __init__(self, storage: S3Storage, key: str, *, lease_s: float, heartbeat_s: float):
        self.storage = storage
        self.key = key
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        self.token = uuid.uuid4().hex
        self.lost = False
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    @property
    def url(self) -> str:
        return f"s3://{self.storage.bucket}/{self.key}"

    def _body(self) -> bytes:
        return json.dumps({"holder": self.token, "host": socket.gethostname(),
                           "pid": os.getpid(), "lease_s": self.lease_s,
                           "renewed": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode()

    def _put(self, **condition: str) -> str:
        response = self.storage.client.put_object(
            Bucket=self.storage.bucket, Key=self.key, Body=self._body(), **condition)
        return response["ETag"]

    def acquire(self) -> None:
        """Take the lease, or raise ``RootLockedError`` naming the live holder."""
        for _ in range(5):  # the holder may release between our create and our read
            try:
                self._etag = self._put(IfNoneMatch="*")
                break
            except Exception as exc:
                if not is_precondition_failed(exc):
                    raise
            current = self._current()
            if current is None:
                continue
            etag, holder, age = current
            if holder.get("holder") == self.token:  # our own create, its answer lost
                self._etag = etag
                break
            if age < float(holder.get("lease_s", self.lease_s)):
                raise self._locked(holder, age)
            try:  # expired: take it over, unless another taker was first
                self._etag = self._put(IfMatch=etag)
                log.warning("jaxckpt: took over the expired lease %s (holder %s, silent "
                            "for %.0f s)", self.url, _describe(holder), age)
                break
            except Exception as exc:
                if not is_precondition_failed(exc):
                    raise
                raise self._locked(holder, age, took_over=True) from None
        else:
            raise RootLockedError(f"could not take the lease {self.url}: it kept changing")
        self._thread = threading.Thread(target=self._heartbeat, name="jaxckpt-s3-lease",
                                        daemon=True)
        self._thread.start()

    def _current(self) -> tuple[str, dict[str, Any], float] | None:
        """(ETag, holder record, age in s by the server's clock), or None when absent."""
        try:
            response = self.storage.client.get_object(Bucket=self.storage.bucket, Key=self.key)
        except Exception as exc:
            if is_not_found(exc):
                return None
            raise
        body = response["Body"].read()
        try:
            holder = json.loads(body)
            if not isinstance(holder, dict):
                raise ValueError(holder)
        except ValueError:
            holder = {"holder": "unreadable lease object"}
        now = response["ResponseMetadata"]["HTTPHeaders"].get("date")
        server_now = email.utils.parsedate_to_datetime(now) if now else None
        modified = response["LastModified"]
        age = (server_now - modified).total_seconds() if server_now else 0.0
        return response["ETag"], holder, age

    def _locked(self, holder: dict[str, Any], age: float, *,
                took_over: bool = False) -> RootLockedError:
        how = ("another job took over its expired lease just now" if took_over else
               f"lease renewed {age:.0f} s ago, lasts {holder.get('lease_s', '?')} s")
        return RootLockedError(
            f"checkpoint root {self.url.rsplit('/', 1)[0]!r} is in use by another running job "
            f"({_describe(holder)}; {how}). Two jobs writing one root would delete each "
            f"other's checkpoints. Give this run its own root, or stop the other job first (a "
            f"killed job's lease expires by itself).")

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._mutex:
                if self._stop.is_set():
                    return
                try:
                    self._etag = self._put(IfMatch=self._etag)
                except Exception as exc:
                    if is_precondition_failed(exc) and self._renewed_by_us():
                        continue
                    if is_precondition_failed(exc) or is_not_found(exc):
                        self.lost = True
                        log.error("jaxckpt: lost the root lease %s: another job took it over "
                                  "(this one did not renew it for over %s s)", self.url,
                                  self.lease_s)
                        return
                    log.warning("jaxckpt: renewing the root lease %s failed (%s); will retry",
                                self.url, exc)

    def _renewed_by_us(self) -> bool:
        """After a refused renewal: whether the lease holds our token anyway (a retry of a
        renewal whose answer was lost, the first try having landed); adopts its ETag."""
        try:
            current = self._current()
        except Exception:  # noqa: BLE001 - unknown: the caller treats the lease as lost
            return False
        if current is None or current[1].get("holder") != self.token:
            return False
        self._etag = current[0]
        return True

    def release(self) -> None:
        """Stop renewing and delete the lease object if it is still ours. Idempotent."""
        self._stop.set()
        with self._mutex:
            etag, self._etag = self._etag, None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.heartbeat_s + 5)
        if etag is None or self.lost:
            return
        try:
            self.storage.client.delete_object(Bucket=self.storage.bucket, Key=self.key,
                                              IfMatch=etag)
        except Exception as exc:
            if not (is_precondition_failed(exc) or is_not_found(exc)):
                log.warning("jaxckpt: could not delete the root lease %s (%s); it expires "
                            "in %s s", self.url, exc, self.lease_s)


def _describe(holder: dict[str, Any]) -> str:
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, holder " \
           f"{holder.get('holder', '?')}"
