"""The root lock on an object store: a lease object, created only if absent, renewed by a
heartbeat, taken over by one job once it has expired. The part every object store shares.

Owns: ``Lease`` (taking, renewing and giving up a lease, and the ``RootLockedError`` a second
job gets) over ``LeaseObject``, the four conditional requests a store must offer for it
(``jaxckpt.s3_lease`` on S3, ``jaxckpt.gcs_lease`` on GCS), and ``LeaseConflict``, what such
a request raises when its condition does not hold.

The protocol. The lease of a root is the object ``{root}/.lock`` holding JSON (a holder token
unique to this lease, host, pid, lease length). Taking it: a create-only write. When the
object is there, its age is measured by the server's clock (the server's time of the read
minus the object's modification time): younger than the lease length its writer recorded,
the root is held (``RootLockedError`` naming the holder); older, the holder stopped renewing
(killed, frozen), and the lease is taken over by a write conditional on the version that was
read (an ETag on S3, a generation on GCS), so of several takers exactly one wins. Ages come
from the server's clock only, so the hosts' clocks need not agree.

A heartbeat thread renews the lease every ``heartbeat_s`` with a write conditional on the
version of the last renewal; if that condition fails, someone took the lease over (this job
stalled longer than the lease): the heartbeat stops and logs an error, and ``lost`` says so.
Releasing deletes the object if it is still ours (a delete conditional on our version).

A conditional write whose response was lost may be retried by the client and then fail its
own condition (the first try succeeded). Every conflict is therefore checked by reading the
object back: if it holds this lease's token, the write was ours and succeeded.

Must not import: jax, orbax, torch, boto3, google (the stores' clients stay in their modules).

Concurrency contract: one ``Lease`` per holder; ``release`` may be called from any thread,
any number of times. Across jobs and hosts the server's conditional requests decide.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Protocol

from .errors import RootLockedError

__all__ = ["Lease", "LeaseConflict", "LeaseObject", "LeaseState"]

log = logging.getLogger("jaxckpt")

_ACQUIRE_TRIES = 5  # the holder may release between our create and our read


class LeaseConflict(Exception):
    """A conditional request on the lease object lost: the object was not at the version
    the request named (or, for a create, something was there; for a replace, nothing)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LeaseState:
    """The lease object as one read saw it."""

    version: str
    """What a conditional request names to act only on this state (ETag, generation)."""
    body: bytes
    """The object's bytes (the holder record, JSON)."""
    age_s: float
    """Seconds since it was last written, by the server's clock."""


class LeaseObject(Protocol):
    """The conditional requests on one lease object that ``Lease`` is built from. Each
    raises ``LeaseConflict`` when its condition does not hold, and the store's own error
    for anything else (after the store's retries)."""

    url: str
    """Where the object is (for messages), e.g. ``gs://bucket/run/.lock``."""

    def create(self, body: bytes) -> str:
        """Write ``body`` only if no object is there; the new version."""

    def replace(self, body: bytes, version: str) -> str:
        """Write ``body`` only if the object is at ``version``; the new version."""

    def read(self) -> LeaseState | None:
        """The object now, or None when there is none."""

    def delete(self, version: str) -> None:
        """Delete the object only if it is at ``version``."""


class Lease:
    """A root lease (held after ``acquire``); see the module docstring."""

    def __init__(self, lease_object: LeaseObject, *, lease_s: float, heartbeat_s: float):
        self.lease_object = lease_object
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        self.token = uuid.uuid4().hex
        self.lost = False
        self._version: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    @property
    def url(self) -> str:
        return self.lease_object.url

    def _body(self) -> bytes:
        return json.dumps({"holder": self.token, "host": socket.gethostname(),
                           "pid": os.getpid(), "lease_s": self.lease_s,
                           "renewed": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode()

    def _claim(self, version: str | None) -> str:
        """Create the object (``version`` None) or replace it at ``version`` with our
        record; the new version. ``LeaseConflict`` unless the object ends up ours."""
        try:
            if version is None:
                return self.lease_object.create(self._body())
            return self.lease_object.replace(self._body(), version)
        except LeaseConflict:
            current = self.lease_object.read()  # a retried write may have found its own
            if current is not None and _record(current.body).get("holder") == self.token:
                return current.version
            raise

    def acquire(self) -> None:
        """Take the lease, or raise ``RootLockedError`` naming the live holder."""
        for _ in range(_ACQUIRE_TRIES):
            try:
                self._version = self._claim(None)
                break
            except LeaseConflict:
                pass
            current = self.lease_object.read()
            if current is None:
                continue
            holder = _record(current.body)
            if current.age_s < float(holder.get("lease_s", self.lease_s)):
                raise self._locked(holder, current.age_s)
            try:  # expired: take it over, unless another taker was first
                self._version = self._claim(current.version)
            except LeaseConflict:
                raise self._locked(holder, current.age_s, took_over=True) from None
            log.warning("jaxckpt: took over the expired lease %s (holder %s, silent for "
                        "%.0f s)", self.url, _describe(holder), current.age_s)
            break
        else:
            raise RootLockedError(f"could not take the lease {self.url}: it kept changing")
        self._thread = threading.Thread(target=self._heartbeat, name="jaxckpt-lease",
                                        daemon=True)
        self._thread.start()

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
                version = self._version
                if self._stop.is_set() or version is None:
                    return  # released, or never held: a renewal must never create one
                try:
                    self._version = self._claim(version)
                except LeaseConflict:
                    self.lost = True
                    log.error("jaxckpt: lost the root lease %s: another job took it over "
                              "(this one did not renew it for over %s s)", self.url,
                              self.lease_s)
                    return
                except Exception as exc:  # a store error after its retries: try next beat
                    log.warning("jaxckpt: renewing the root lease %s failed (%s); will "
                                "retry", self.url, exc)

    def release(self) -> None:
        """Stop renewing and delete the lease object if it is still ours. Idempotent."""
        self._stop.set()
        with self._mutex:
            version, self._version = self._version, None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.heartbeat_s + 5)
        if version is None or self.lost:
            return
        try:
            self.lease_object.delete(version)
        except LeaseConflict:
            pass  # no longer ours: nothing to give up
        except Exception as exc:
            log.warning("jaxckpt: could not delete the root lease %s (%s); it expires in %s s",
                        self.url, exc, self.lease_s)


def _record(body: bytes) -> dict[str, Any]:
    """The holder record in a lease object's bytes (a placeholder when unreadable)."""
    try:
        record = json.loads(body)
    except ValueError:
        record = None
    return record if isinstance(record, dict) else {"holder": "unreadable lease object"}


def _describe(holder: dict[str, Any]) -> str:
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, holder " \
           f"{holder.get('holder', '?')}"
