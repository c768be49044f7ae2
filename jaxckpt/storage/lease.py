"""The root lock on an object store: a lease object, created only if absent, renewed by a
heartbeat, taken over by one job once its holder is gone. The part every object store shares.

Owns: ``ObjectLease`` (take, renew, give up; ``RootLockedError`` for a second job) over
``LeaseObject``, the four conditional requests a store offers (``storage.s3.lease``,
``storage.gcs.lease``); ``LeaseConflict`` (a condition failed) and
``LeaseRequestUnsupported`` (HTTP 501). The protocol (a held lease is free once released, this
process's own, a gone process of this host, or unrenewed for a lease length) is in
docs/cloud.md; a conflict is checked by reading the object back (a retry can fail its own
condition).

Must not import: jax, orbax, torch, boto3, google (the stores' clients stay in their modules).

Concurrency: one ``ObjectLease`` per holder, renewed by its heartbeat thread; ``release`` from any
thread, any number of times. Across jobs and hosts the server's conditional requests decide.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
import uuid
from typing import Any, Protocol

from jaxckpt.errors import RootLockedError
from jaxckpt.storage.lease_holder import holder_status, this_process

__all__ = ["ObjectLease", "LeaseConflict", "LeaseObject", "LeaseRequestUnsupported", "LeaseState"]

log = logging.getLogger("jaxckpt")

_VANISHED_TRIES = 5  # the holder may release between our create and our read
#: How often a watched lease is read again, as a fraction of its holder's heartbeat (and
#: the bounds of that interval in seconds).
_WATCH_FRACTION, _WATCH_MIN_S, _WATCH_MAX_S = 0.25, 0.05, 1.0

# The tokens of the leases this process holds now (acquired, not yet released nor lost).
_held: set[str] = set()
_held_lock = threading.Lock()


class LeaseConflict(Exception):
    """A conditional request on the lease object lost: the object was not at the version
    the request named (or, for a create, something was there; for a replace, nothing)."""


class LeaseRequestUnsupported(Exception):
    """The server does not implement this conditional request (it answered 501)."""


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
    """The conditional requests on one lease object that ``ObjectLease`` is built from. Each
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
        """Delete the object only if it is at ``version``; ``LeaseRequestUnsupported`` when
        the server does not implement a conditional delete."""


@dataclasses.dataclass(kw_only=True, slots=True)
class _Watch:
    """A held lease this taker is watching for a renewal: the version first seen, when."""

    version: str
    since: float


class ObjectLease:
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
        self._writes = itertools.count()

    @property
    def url(self) -> str:
        return self.lease_object.url

    def _body(self, *, released: bool = False) -> bytes:
        # Every write's bytes differ (``written``): an S3 ETag is a digest of the bytes, and
        # a taker watching for a renewal compares versions.
        record = {"holder": self.token, **this_process(), "lease_s": self.lease_s,
                  "heartbeat_s": self.heartbeat_s, "written": next(self._writes),
                  "renewed": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if released:
            record["released"] = True
        return json.dumps(record).encode()

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
        """Take the lease: at once when it is absent or free, after watching it when its
        holder cannot be checked from here (module docstring); else ``RootLockedError``
        naming the live holder."""
        with _held_lock:  # before the first write: a rival in this process must see it live
            _held.add(self.token)
        try:
            self._take()
        except BaseException:
            with _held_lock:
                _held.discard(self.token)
            raise
        self._thread = threading.Thread(target=self._heartbeat, name="jaxckpt-lease",
                                        daemon=True)
        self._thread.start()

    def _take(self) -> None:
        """Create the lease, or take it over once ``_why_free`` says it may, watching it
        meanwhile; ``self._version`` is then ours."""
        watch: _Watch | None = None
        vanished = 0
        while True:
            try:
                self._version = self._claim(None)
                return
            except LeaseConflict:
                pass
            current = self.lease_object.read()
            if current is None:
                vanished += 1
                if vanished >= _VANISHED_TRIES:
                    raise RootLockedError(f"could not take the lease {self.url}: it kept "
                                          f"changing")
                continue
            holder = _record(current.body)
            why_free = self._why_free(holder, current, watch)
            if why_free is not None:
                self._take_over(holder, current, why_free)
                return
            watch = self._watch(holder, current, watch)
            time.sleep(_watch_interval(float(holder.get("heartbeat_s", self.heartbeat_s))))

    def _why_free(self, holder: dict[str, Any], current: LeaseState,
                  watch: _Watch | None) -> str | None:
        """Why the lease read as ``current`` may be taken now (for the log), or None when
        its holder may be alive; ``RootLockedError`` when it surely is."""
        if holder.get("released") is True:
            return "released by its holder"
        lasts = float(holder.get("lease_s", self.lease_s))
        status = holder_status(holder)
        if status == "this process":
            with _held_lock:
                live = holder.get("holder") in _held
            if live:
                raise RootLockedError(
                    f"checkpoint root {self.url.rsplit('/', 1)[0]!r} is held by another "
                    f"manager of this same process (pid {holder.get('pid')}), still open. "
                    f"Close it first (a `with` block closes it), or give this one its own "
                    f"root.")
            return "left by an earlier manager of this process"
        if status == "gone":
            return "its process on this host is gone"
        if status == "running here":
            raise self._locked(holder, current.age_s)
        if current.age_s >= lasts:
            return f"not renewed for {current.age_s:.0f} s"
        if watch is not None and watch.version == current.version and \
                time.monotonic() - watch.since >= lasts:
            return f"not renewed while watched for {time.monotonic() - watch.since:.1f} s"
        return None

    def _watch(self, holder: dict[str, Any], current: LeaseState,
               watch: _Watch | None) -> _Watch:
        """Start watching the lease read as ``current``, or go on watching it; a lease
        rewritten since it was first seen is held by a live job (``RootLockedError``)."""
        if watch is None:
            lasts = float(holder.get("lease_s", self.lease_s))
            log.warning("jaxckpt: the root lease %s is held by %s (written %.1f s ago, lasts "
                        "%.0f s), a process this host cannot check; waiting up to %.1f s to "
                        "see whether it is still renewed (a job restarted right after its "
                        "predecessor was killed takes the lease over then)", self.url,
                        _describe(holder), current.age_s, lasts, lasts - current.age_s)
            return _Watch(version=current.version, since=time.monotonic())
        if current.version != watch.version:
            raise self._locked(holder, current.age_s, how=f"renewed while this job waited "
                               f"{time.monotonic() - watch.since:.1f} s for it")
        return watch

    def _take_over(self, holder: dict[str, Any], current: LeaseState, why: str) -> None:
        try:  # unless another taker was first
            self._version = self._claim(current.version)
        except LeaseConflict:
            raise self._locked(holder, current.age_s, how="another job took it over just "
                               "now") from None
        level = logging.INFO if holder.get("released") is True else logging.WARNING
        log.log(level, "jaxckpt: took over the root lease %s (holder %s: %s)", self.url,
                _describe(holder), why)

    def _locked(self, holder: dict[str, Any], age: float, *,
                how: str | None = None) -> RootLockedError:
        how = how or f"lease renewed {age:.0f} s ago, lasts {holder.get('lease_s', '?')} s"
        return RootLockedError(
            f"checkpoint root {self.url.rsplit('/', 1)[0]!r} is in use by another running job "
            f"({_describe(holder)}; {how}). Two jobs writing one root would delete each "
            f"other's checkpoints. Give this run its own root, or stop the other job first (a "
            f"killed job's lease is taken over once it is no longer renewed).")

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
                    with _held_lock:
                        _held.discard(self.token)
                    log.error("jaxckpt: lost the root lease %s: another job took it over "
                              "(this one did not renew it for over %s s)", self.url,
                              self.lease_s)
                    return
                except Exception as exc:  # a store error after its retries: try next beat
                    log.warning("jaxckpt: renewing the root lease %s failed (%s); will "
                                "retry", self.url, exc)

    def release(self) -> None:
        """Stop renewing and give the lease up if it is still ours: delete it, or where the
        server has no conditional delete, mark it released. Idempotent."""
        self._stop.set()
        with self._mutex:
            version, self._version = self._version, None
        with _held_lock:
            _held.discard(self.token)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.heartbeat_s + 5)
        if version is None or self.lost:
            return
        try:
            try:
                self.lease_object.delete(version)
            except LeaseRequestUnsupported:
                log.debug("jaxckpt: the server has no conditional delete; marking the root "
                          "lease %s released instead", self.url)
                self.lease_object.replace(self._body(released=True), version)
        except LeaseConflict:
            pass  # no longer ours (or our retried write landed): nothing to give up
        except Exception as exc:
            log.warning("jaxckpt: could not give up the root lease %s (%s); another job "
                        "takes it over once it is no longer renewed (this process at once)",
                        self.url, exc)


def _watch_interval(heartbeat_s: float) -> float:
    """How long to wait between two reads of a watched lease whose holder renews every
    ``heartbeat_s``."""
    return min(max(_WATCH_FRACTION * heartbeat_s, _WATCH_MIN_S), _WATCH_MAX_S)


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
