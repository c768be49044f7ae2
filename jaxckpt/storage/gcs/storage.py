"""The storage seam on Google Cloud Storage (and GCS emulators): ``GCSStorage``.

Owns: ``GCSStorage`` (``storage.base.Storage`` over google-cloud-storage, one bucket and
name prefix of ``gs://`` URLs: a location outside is a ``ValueError``), ``gcs_client``
(built from the environment and ``storage_options``, with a private ``random.Random`` for
the library's jitter and multipart boundaries) and ``Tries``/``is_transient`` (retries per
request: 408, 429, 5xx, timeouts, dropped connections, at most ``max_attempts`` tries and
``request_deadline_s``). ``write`` is one upload, ``create`` one with
``ifGenerationMatch=0`` (read back after a retry), ``sync`` does nothing; ``reading``
holds live in this process. The root lock is ``storage.gcs.lease``.

Must not import: jax, orbax, torch. Imports google-cloud-storage lazily, when a storage is
made (the ``gcs`` extra).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import sys
import time
import urllib.parse
from collections.abc import Callable, Collection, Mapping
from typing import Any

from jaxckpt.core.checksum import extend
from jaxckpt.core.extras import requires_extra
from jaxckpt.storage.base import ReadHolds, RootLock, Storage, object_name

__all__ = ["GCSStorage", "Tries", "gcs_client", "is_transient", "split_gs_url"]

_CLIENT_OPTIONS = ("endpoint_url", "project", "credentials", "anonymous")
_RETRY_OPTIONS = ("max_attempts", "connect_timeout", "read_timeout", "backoff_s",
                  "max_backoff_s", "request_deadline_s")
_DEFAULTS = {"max_attempts": 8, "connect_timeout": 10.0, "read_timeout": 30.0,
             "backoff_s": 0.5, "max_backoff_s": 16.0, "request_deadline_s": 60.0}
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_DELETE_THREADS = 8
_BINARY = "application/octet-stream"
# The client's modules that draw from the global ``random`` (docs/cloud.md).
_DRAWING_MODULES = ("google.cloud.storage._media._upload", "google.api_core.retry.retry_base",
                    "google.auth._exponential_backoff")


def split_gs_url(url: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` -> (``bucket``, ``some/prefix``), without end slashes."""
    if url[:5].lower() != "gs://":
        raise ValueError(f"not a gs:// URL: {url!r}")
    bucket, _, name = url[len("gs://"):].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: write gs://BUCKET/PREFIX")
    return bucket, name.strip("/")


def gcs_client(storage_options: Mapping[str, Any] | None = None) -> Any:
    """A google-cloud-storage client. ``storage_options`` (all optional):

    - ``endpoint_url``: the server (an emulator's ``http://127.0.0.1:PORT``); default the
      ``STORAGE_EMULATOR_HOST`` environment variable, else Google's endpoint;
    - ``project``: the project (not needed to read and write objects);
    - ``credentials``: a ``google.auth`` credentials object; default Application Default
      Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud, the metadata server);
    - ``anonymous``: no credentials at all; default True against an emulator (an
      ``endpoint_url`` or ``STORAGE_EMULATOR_HOST``), else False.

    The retry options (``max_attempts`` ...) belong to ``GCSStorage``, not to the client."""
    with requires_extra("gcs", "gs:// roots"):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage as gcs
    _private_randomness()
    options = _checked(storage_options)
    endpoint = options.get("endpoint_url")
    emulated = bool(endpoint or os.environ.get("STORAGE_EMULATOR_HOST"))
    credentials = options.get("credentials")
    if credentials is None and options.get("anonymous", emulated):
        credentials = AnonymousCredentials()
    extra: dict[str, Any] = {}
    if endpoint:
        extra["client_options"] = {"api_endpoint": endpoint}
        # Otherwise a custom endpoint makes the client look for credentials even when given
        # anonymous ones, and for a project through google.auth.default().
        extra["use_auth_w_custom_endpoint"] = not isinstance(credentials, AnonymousCredentials)
    # An explicit project (None included) keeps the client from asking the environment, or
    # the metadata server, for one.
    return gcs.Client(project=options.get("project"), credentials=credentials, **extra)


def _private_randomness() -> None:
    """Give the client's modules that draw from Python's global ``random`` (multipart
    boundaries, retry jitter) a ``random.Random`` of their own, so that uploads on background
    threads never advance the user's global random stream (docs/cloud.md). Idempotent."""
    for name in _DRAWING_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "random", None) is random:
            module.random = random.Random()  # type: ignore[attr-defined]


def _checked(storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    options = dict(storage_options or {})
    unknown = set(options) - set(_CLIENT_OPTIONS) - set(_RETRY_OPTIONS)
    if unknown:
        raise ValueError(f"storage_options: unknown keys {sorted(unknown)}; known: "
                         f"{sorted(_CLIENT_OPTIONS + _RETRY_OPTIONS)}")
    return options


def is_transient(exc: BaseException) -> bool:
    """Whether a failed request may succeed if tried again: 408, 429 and 5xx answers,
    timeouts, refused or dropped connections, truncated bodies."""
    from google.api_core import exceptions as api
    from google.auth import exceptions as auth

    if isinstance(exc, api.GoogleAPICallError):
        return exc.code in _TRANSIENT_STATUS
    response = getattr(exc, "response", None)  # the client's InvalidResponse (media requests)
    status = getattr(response, "status_code", None)
    if status is not None:
        return status in _TRANSIENT_STATUS
    if isinstance(exc, auth.TransportError):
        return bool(exc.args) and isinstance(exc.args[0], BaseException) and \
            is_transient(exc.args[0])
    import requests  # the client's transport; it wraps urllib3's errors in its own

    return isinstance(exc, (ConnectionError, TimeoutError, requests.ConnectionError,
                            requests.Timeout, requests.exceptions.ChunkedEncodingError))


class Tries:
    """The tries of one request: the predicate of its ``Retry``, which retries a transient
    error while fewer than ``max_attempts`` tries have been made and, for a server that does
    not answer, while under ``deadline_s`` have passed since the request began; giving up on
    such a server, it raises a ``TimeoutError`` naming the endpoint and the request.
    ``retried`` tells the caller whether an earlier try may have succeeded unseen. One per
    request, never shared between requests (the pages of one listing share the listing's)."""

    def __init__(self, max_attempts: int, deadline_s: float | None = None):
        self.left = max_attempts - 1
        self.retried = False
        self.tries = 0
        self.deadline_s = deadline_s
        self.started = time.monotonic()

    def __call__(self, exc: BaseException) -> bool:
        self.tries += 1
        if not is_transient(exc):
            return False
        elapsed = time.monotonic() - self.started
        if self.deadline_s is not None and elapsed >= self.deadline_s:
            request = _unanswered(exc)
            if request is not None:
                raise TimeoutError(
                    f"the GCS endpoint {request[0]} is not answering: {request[1]} got no "
                    f"answer in {elapsed:.0f} s over {self.tries} tries (last: {exc}). Raise "
                    f"storage_options 'connect_timeout', 'read_timeout' or "
                    f"'request_deadline_s' (now {self.deadline_s} s) for a slow server, or "
                    f"check that it is up.") from exc
        if self.left <= 0:
            return False
        self.left -= 1
        self.retried = True
        return True


def _unanswered(exc: BaseException) -> tuple[str, str] | None:
    """(the endpoint, "METHOD path") of a request ``exc`` says got no answer (no connection,
    a timeout, a dropped connection), or None for any other error."""
    import requests

    while not isinstance(exc, requests.RequestException):
        inner = exc.args[0] if exc.args and isinstance(exc.args[0], BaseException) else None
        if inner is None:
            return None
        exc = inner  # google.auth's TransportError wraps the transport's error
    if not isinstance(exc, (requests.ConnectionError, requests.Timeout,
                            requests.exceptions.ChunkedEncodingError)):
        return None
    request = exc.request
    url = urllib.parse.urlsplit(getattr(request, "url", None) or "")
    return (f"{url.scheme}://{url.netloc}" if url.netloc else "?",
            f"{getattr(request, 'method', None) or 'a request'} {url.path}")


class GCSStorage(Storage):
    """``Storage`` on one GCS bucket, below one name prefix (``""``: the whole bucket).

    Concurrency contract: any number of threads may share one storage (requests go through
    one client, whose HTTP session is shared). Across processes and hosts, ``create`` and the
    root lease are decided by the server's generation preconditions; ``reading`` holds are
    per process (module docstring).
    """

    #: Each whole-object request waits on a network round trip: run several at once (kept
    #: under the HTTP session's pool of 10 connections).
    concurrent_requests = 8

    def __init__(self, bucket: str, prefix: str = "", *,
                 storage_options: Mapping[str, Any] | None = None,
                 lease_s: float = 30.0, heartbeat_s: float = 10.0,
                 conditional_writes: str = "check"):
        """``storage_options``: the client's (``gcs_client``) and the retries':
        ``max_attempts`` tries per request in all (default 8), ``connect_timeout`` and
        ``read_timeout`` in seconds (10, 30), ``request_deadline_s``: no try of a server that
        does not answer once this long has passed since the request began (60),
        ``backoff_s`` the first wait between tries (0.5, doubling up to ``max_backoff_s``,
        16). ``lease_s``: how long the root lease lasts without a renewal; ``heartbeat_s``:
        how often a holder renews it (well under ``lease_s``).
        ``conditional_writes``: as for ``jaxckpt.storage.s3.storage.S3Storage``."""
        if not bucket or "/" in bucket:
            raise ValueError(f"GCSStorage: bucket must be a bucket name, not {bucket!r}")
        if not 0 < heartbeat_s < lease_s:
            raise ValueError(f"GCSStorage: need 0 < heartbeat_s ({heartbeat_s}) < lease_s "
                             f"({lease_s})")
        options = {**_DEFAULTS, **_checked(storage_options)}
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        self.conditional_writes = conditional_writes
        self.max_attempts = int(options["max_attempts"])
        self.request_deadline_s = float(options["request_deadline_s"])
        self.timeout = (float(options["connect_timeout"]), float(options["read_timeout"]))
        self._backoff = (float(options["backoff_s"]), float(options["max_backoff_s"]))
        self.client = gcs_client(options)
        self.bucket = self.client.bucket(bucket)
        self._holds = ReadHolds()

    def __repr__(self) -> str:
        return f"GCSStorage({self.bucket_name!r}, {self.prefix!r})"

    def url(self, name: str = "") -> str:
        """The location of object ``name`` (default: this storage's prefix)."""
        return f"gs://{self.bucket_name}/{name or self.prefix}"

    def name(self, path: str) -> str:
        """The object name of location ``path``; ``ValueError`` outside this storage."""
        return object_name(path, split_gs_url(path), self.bucket_name, self.prefix, self)

    # --- requests ------------------------------------------------------------------------
    def tries(self) -> Tries:
        """The tries of a new request: ``max_attempts``, ``request_deadline_s``."""
        return Tries(self.max_attempts, self.request_deadline_s)

    def retry(self, tries: Tries | None = None) -> Any:
        """A ``google.api_core`` ``Retry`` for one request, bounded by ``tries`` (a fresh
        ``tries()`` when None). No deadline of its own: ``Tries`` keeps it."""
        from google.api_core.retry import Retry

        initial, maximum = self._backoff
        return Retry(predicate=tries or self.tries(), initial=initial,
                     maximum=maximum, multiplier=2.0, timeout=None)

    def retrying(self, request: Callable[[], Any]) -> Any:
        """``request()``, retried as every request of this storage is."""
        return self.retry()(request)()

    def upload(self, name: str, data: bytes, *, if_generation_match: int | None = None,
               tries: Tries | None = None) -> Any:
        """Upload ``data`` as object ``name`` (conditional when ``if_generation_match`` is
        given); the blob, whose ``generation`` is the new one."""
        blob = self.bucket.blob(name)
        blob.upload_from_string(data, content_type=_BINARY,
                                if_generation_match=if_generation_match,
                                timeout=self.timeout, retry=self.retry(tries))
        return blob

    def download(self, name: str, *, start: int | None = None, end: int | None = None,
                 if_generation_match: int | None = None) -> bytes:
        """The bytes of object ``name`` (``start`` to ``end`` inclusive); the client's
        ``NotFound``/``PreconditionFailed`` when it is not there (at that generation)."""
        ranged = start is not None or end is not None
        return self.bucket.blob(name).download_as_bytes(
            start=start, end=end, raw_download=True, if_generation_match=if_generation_match,
            checksum=None if ranged else "auto", timeout=self.timeout, retry=self.retry())

    # --- whole objects -------------------------------------------------------------------
    def write(self, path: str, data: bytes | bytearray) -> None:
        self.upload(self.name(path), bytes(data) if isinstance(data, bytearray) else data)

    def create(self, path: str, data: bytes) -> None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        name = self.name(path)
        tries = self.tries()
        try:
            self.upload(name, data, if_generation_match=0, tries=tries)
        except PreconditionFailed as exc:
            if tries.retried:  # did a try that failed on the way back create it?
                with contextlib.suppress(NotFound):
                    if self.download(name) == data:
                        return
            raise FileExistsError(17, "already exists", path) from exc

    def copy(self, src: str, dst: str) -> None:
        """A copy on the server (the JSON API's rewrite: no bytes through this host),
        retried as a plain write is (the same bytes to a name only the lease holder
        writes)."""
        from google.api_core.exceptions import NotFound

        try:
            self.bucket.copy_blob(self.bucket.blob(self.name(src)), self.bucket,
                                  self.name(dst), timeout=self.timeout, retry=self.retry())
        except NotFound as exc:
            raise FileNotFoundError(2, "no such object", src) from exc

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        from google.api_core.exceptions import NotFound, RequestRangeNotSatisfiable

        if length == 0:
            return b""
        start = offset or None
        end = None if length is None else offset + length - 1
        if start is None and end is not None:
            start = 0
        try:
            return self.download(self.name(path), start=start, end=end)
        except NotFound as exc:
            raise FileNotFoundError(2, "no such object", path) from exc
        except RequestRangeNotSatisfiable:  # offset at or past the end
            return b""

    def size(self, path: str) -> int:
        blob = self.bucket.get_blob(self.name(path), timeout=self.timeout, retry=self.retry())
        if blob is None:
            raise FileNotFoundError(2, "no such object", path)
        return int(blob.size)

    def checksum(self, path: str, algorithm: str, *, sync: bool = False) -> tuple[int, str]:
        """One GET, streamed (``sync`` needs nothing: the object is durable)."""
        from google.api_core.exceptions import NotFound

        sink = _ChecksumSink(algorithm)
        try:
            self.bucket.blob(self.name(path)).download_to_file(
                sink, raw_download=True, checksum=None, timeout=self.timeout,
                retry=self.retry())
        except NotFound as exc:
            raise FileNotFoundError(2, "no such object", path) from exc
        return sink.size, f"{sink.crc:08x}"

    def exists(self, path: str) -> bool:
        try:
            self.size(path)
        except FileNotFoundError:
            return False
        return True

    # --- prefixes ------------------------------------------------------------------------
    def _list(self, prefix_name: str, **extra: Any) -> Any:
        return self.client.list_blobs(self.bucket, prefix=prefix_name, timeout=self.timeout,
                                      retry=self.retry(), **extra)

    def list_names(self, prefix: str) -> list[str]:
        below = self.name(prefix) + "/"
        listing = self._list(below, delimiter="/")
        names = {blob.name[len(below):] for blob in listing}  # consumes every page
        names.update(name[len(below):] for name in listing.prefixes)
        names.discard("")
        return sorted(names)

    def list_files(self, prefix: str) -> dict[str, int]:
        below = self.name(prefix) + "/"
        return {blob.name[len(below):]: int(blob.size) for blob in self._list(below)
                if len(blob.name) > len(below)}

    def is_prefix(self, path: str) -> bool:
        return any(True for _ in self._list(self.name(path) + "/", max_results=1))

    def _delete_name(self, name: str) -> None:
        from google.api_core.exceptions import NotFound

        # A retried delete whose first try succeeded finds nothing: deleted all the same.
        with contextlib.suppress(NotFound):
            self.bucket.blob(name).delete(timeout=self.timeout, retry=self.retry())

    def delete(self, path: str) -> None:
        self._delete_name(self.name(path))

    def delete_prefix(self, prefix: str) -> None:
        name = self.name(prefix)
        names = [blob.name for blob in self._list(name + "/")]
        names.append(name)  # an object at the prefix's own name, if any
        with concurrent.futures.ThreadPoolExecutor(_DELETE_THREADS) as pool:
            for done in pool.map(self._delete_name, names):
                del done

    def sync(self, prefix: str, *, data: bool = True, skip: Collection[str] = ()) -> None:
        """Nothing to do: a GCS upload is durable when it returns."""

    # --- concurrency ---------------------------------------------------------------------
    def lock_root(self, root: str) -> RootLock:
        from jaxckpt.storage.gcs.lease import GCSLease

        lease = GCSLease(self, self.name(root.rstrip("/") + "/.lock"),
                         lease_s=self.lease_s, heartbeat_s=self.heartbeat_s)
        lease.acquire()
        return lease

    def reading(self, path: str) -> contextlib.AbstractContextManager[None]:
        return self._holds.hold(self.name(path))

    def delete_unless_reading(self, path: str) -> bool:
        name = self.name(path)
        with self._holds.lock:  # held while deleting, so no hold starts in between
            if self._holds.counts.get(name):
                return False
            self._delete_name(name)
        return True


class _ChecksumSink:
    """A file-like object that checksums what a download writes into it."""

    def __init__(self, algorithm: str):
        self.algorithm = algorithm
        self.crc = 0
        self.size = 0

    def write(self, data: bytes) -> int:
        self.crc = extend(self.algorithm, self.crc, data)
        self.size += len(data)
        return len(data)
