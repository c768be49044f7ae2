"""The storage seam on S3 (and S3-protocol servers): ``S3Storage``.

Owns: ``S3Storage`` (``storage.base.Storage`` over boto3, one bucket and key prefix of
``s3://`` URLs: a location outside is a ``ValueError``) and ``s3_client`` (built from the
environment and ``storage_options``, with a private ``random.Random`` for botocore's retry
jitter). ``write`` is one PUT (multipart above ``MULTIPART_OVER``), ``create`` a PUT with
``If-None-Match: *``, ``copy`` server-side, ``delete_prefix`` in batches of 1000,
``discard_incomplete_uploads`` aborts a killed writer's uploads; small objects it wrote or
verified are kept for the commit and read that follow (``_SmallObjects``). Retries are
botocore's, bounded by ``max_attempts`` and ``request_deadline_s``. No rename:
``commit.object_steps`` does quarantine and exports instead. ``reading`` holds live in this
process. The root lock is ``storage.s3.lease``; streamed writes ``storage.s3.upload``.

Must not import: jax, orbax, torch. Imports boto3 lazily, when a storage is made.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import contextlib
import dataclasses
import random
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

from jaxckpt.core.checksum import extend
from jaxckpt.errors import CheckpointWarning, ObjectStoreError
from jaxckpt.storage.base import ObjectWriter, ReadHolds, RootLock, Storage, object_name
from jaxckpt.storage.readers import JoinedReader

__all__ = ["S3Storage", "s3_client", "split_s3_url"]

_READ_PIECE = 8 * 1024 * 1024
#: how much of a GET's body lands between two ``read_into`` progress calls.
_PROGRESS_PIECE = 4 * 1024 * 1024
#: Objects above this many bytes are uploaded in parts of ``PART_BYTES``, ``PART_THREADS``
#: at a time (S3 allows 10,000 parts of 5 MiB to 5 GiB: 64 MiB parts reach 640 GB).
MULTIPART_OVER = 64 << 20
PART_BYTES = 64 << 20
PART_THREADS = 4
_DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes
_CLIENT_OPTIONS = ("endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key",
                   "aws_session_token", "verify", "use_ssl")
_RETRY_OPTIONS = ("max_attempts", "connect_timeout", "read_timeout", "max_pool_connections",
                  "request_deadline_s")


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (``bucket``, ``some/prefix``), without end slashes."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket: write s3://BUCKET/PREFIX")
    return bucket, key.strip("/")


def s3_client(storage_options: Mapping[str, Any] | None = None) -> Any:
    """A boto3 S3 client. Endpoint, region and credentials come from ``storage_options``
    (``endpoint_url``, ``region_name``, ``aws_access_key_id``, ``aws_secret_access_key``,
    ``aws_session_token``, ``verify``, ``use_ssl``) or, where not given, boto3's standard
    environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID`` ...). Retries:
    botocore's "standard" mode, ``max_attempts`` tries in all (default 8), with
    ``connect_timeout``/``read_timeout`` in seconds (default 10 and 30); a server that does
    not answer is tried no more once ``request_deadline_s`` (default 60) have passed since
    the operation began (``_Deadline``)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise ImportError("s3:// roots need boto3: pip install 'jaxckpt[s3]'") from exc
    options = dict(storage_options or {})
    unknown = set(options) - set(_CLIENT_OPTIONS) - set(_RETRY_OPTIONS)
    if unknown:
        raise ValueError(f"storage_options: unknown keys {sorted(unknown)}; known: "
                         f"{sorted(_CLIENT_OPTIONS + _RETRY_OPTIONS)}")
    _private_jitter()
    deadline = _Deadline(max_attempts=int(options.pop("max_attempts", 8)),
                         connect_timeout=float(options.pop("connect_timeout", 10)),
                         read_timeout=float(options.pop("read_timeout", 30)),
                         deadline_s=float(options.pop("request_deadline_s", 60)))
    # botocore's own "max_attempts" counts retries only; "total_max_attempts" counts tries.
    config = Config(retries={"mode": "standard", "total_max_attempts": deadline.max_attempts},
                    connect_timeout=deadline.connect_timeout,
                    read_timeout=deadline.read_timeout,
                    max_pool_connections=options.pop("max_pool_connections", 16))
    client = boto3.session.Session().client("s3", config=config, **options)
    client.meta.events.register("before-call.s3", deadline.started)
    client.meta.events.register_first("needs-retry.s3", deadline.needs_retry)
    return client


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Deadline:
    """How long one operation of a client keeps trying a server that does not answer (a
    connection refused, not made in time, dropped, or no answer in time): no try once
    ``deadline_s`` have passed since the operation began, but a ``TimeoutError`` naming the
    endpoint and the operation, chained to botocore's error. Within the deadline, and for
    every other failure, botocore's standard mode decides (at most ``max_attempts`` tries).
    Handlers of the client's events: ``started`` stamps the operation's context,
    ``needs_retry`` runs before botocore's own retry handler after each failed try."""

    max_attempts: int
    connect_timeout: float
    read_timeout: float
    deadline_s: float

    def started(self, context: dict[str, Any], **_: Any) -> None:
        context["jaxckpt_started"] = time.monotonic()

    def needs_retry(self, *, caught_exception: Exception | None = None, attempts: int = 0,
                    operation: Any = None, request_dict: Any = None, endpoint: Any = None,
                    **_: Any) -> None:
        from botocore.exceptions import ConnectionError, HTTPClientError

        if not isinstance(caught_exception, (ConnectionError, HTTPClientError)):
            return None
        request = request_dict or {}
        started = request.get("context", {}).get("jaxckpt_started")
        elapsed = time.monotonic() - started if started is not None else 0.0
        if elapsed < self.deadline_s:
            return None  # botocore's handler decides (and waits before the next try)
        raise TimeoutError(
            f"the S3 endpoint {getattr(endpoint, 'host', '?')} is not answering: "
            f"{getattr(operation, 'name', 'a request')} "
            f"{urllib.parse.urlsplit(request.get('url') or '').path} got no "
            f"answer in {elapsed:.0f} s over {attempts} tries (last: {caught_exception}). A "
            f"try waits {self.connect_timeout:g} s to connect and {self.read_timeout:g} s for "
            f"each answer, and none starts {self.deadline_s:g} s after the first: raise "
            f"storage_options 'connect_timeout', 'read_timeout' or 'request_deadline_s' for a "
            f"slow server, or check that it is up.") from caught_exception


def _private_jitter() -> None:
    """Point the default ``random`` of botocore's retry backoff (bound to the global
    ``random.random`` when botocore was imported) at a ``random.Random`` of its own
    (docs/cloud.md). Idempotent."""
    from botocore.retries import standard

    init = standard.ExponentialBackoff.__init__
    defaults = init.__defaults__ or ()
    if random.random in defaults:
        init.__defaults__ = tuple(random.Random().random if value == random.random else value
                                  for value in defaults)


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _status(exc: Exception) -> int:
    response = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def is_not_found(exc: Exception) -> bool:
    return _code(exc) in ("404", "NoSuchKey", "NotFound") or _status(exc) == 404


def is_precondition_failed(exc: Exception) -> bool:
    """A conditional write lost: ``If-None-Match``/``If-Match`` did not hold (412), or the
    server saw a concurrent conditional write to the key (409)."""
    return _code(exc) in ("PreconditionFailed", "ConditionalRequestConflict") or \
        _status(exc) in (409, 412)


def is_not_implemented(exc: Exception) -> bool:
    """The server does not implement the request (501, or its error code says so)."""
    return _code(exc) in ("NotImplemented", "501") or _status(exc) == 501


def _request_failed(storage: S3Storage, operation: str, location: str, exc: Exception, *,
                    page: int | None = None) -> ObjectStoreError:
    """The error for a request the server failed after its retries: names the server, the
    request (and the page of a listing) and the location."""
    which = f" (page {page} of the listing)" if page and page > 1 else ""
    return ObjectStoreError(
        f"the S3 server at {storage.endpoint} failed {operation} of {location}{which}: "
        f"HTTP {_status(exc) or '?'} {_code(exc) or ''} ({exc}). Requests are tried "
        f"storage_options['max_attempts'] times (5xx, throttling, timeouts); check the "
        f"server's health and logs.")


def _checksum_field(crc32c: int) -> dict[str, str]:
    """The PUT field that hands S3 the body's crc32c (base64 of its 4 big-endian bytes)."""
    return {"ChecksumCRC32C": base64.b64encode(crc32c.to_bytes(4, "big")).decode("ascii")}


def _stream_into(body: Any, out: memoryview,
                 progress: Callable[[int], None] | None = None) -> int:
    """Read a GET's body into ``out`` until it is full or the body ends; the byte count.
    With ``progress``, in slices of ``_PROGRESS_PIECE`` bytes, each followed by
    ``progress(bytes in so far)`` (a reader checksums what landed while the rest comes).

    Straight from the socket where the body is plain bytes (no content encoding): the
    HTTP response under botocore's and urllib3's wrappers reads into ``out`` itself, where
    their ``readinto`` reads into a new buffer and copies it over (less CPU per byte, and
    faster on a loaded machine). The connection then goes back to
    the pool as urllib3 would return it. Any other body goes through botocore."""
    raw: Any = getattr(body, "_raw_stream", None)
    direct: Any = getattr(raw, "_fp", None)
    headers = getattr(raw, "headers", None) or {}
    plain = (direct is not None and hasattr(direct, "readinto")
             and not headers.get("content-encoding") and hasattr(raw, "release_conn"))
    read = direct.readinto if plain else body.readinto
    step = len(out) if progress is None else _PROGRESS_PIECE
    got = 0
    while got < len(out):
        count = read(out[got:got + step])
        if not count:
            break
        got += count
        if progress is not None:
            progress(got)
    if plain and direct.isclosed():  # the whole body was read: the connection is free
        raw.release_conn()
    return got


class _SmallObjects:
    """The bytes of small checkpoint objects this storage wrote or checksummed, so that the
    commit does not GET what was just PUT, and a restore does not GET twice what it verified
    and then parses (zarr.json, tree.json, driver.json). Only objects below a ``recover/`` or
    ``export/`` prefix are kept: those are written once per save attempt (a second attempt at
    the same name writes or deletes through this storage, which replaces or drops them), by
    the one process that holds the root's lease. Bounded (LRU). Thread-safe."""

    MAX_OBJECT = 1 << 20
    MAX_TOTAL = 64 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._total = 0

    @staticmethod
    def keeps(key: str, size: int) -> bool:
        return size <= _SmallObjects.MAX_OBJECT and ("/recover/" in key or "/export/" in key)

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self._total -= len(self._bytes.pop(key, b""))
            if not self.keeps(key, len(data)):
                return
            self._bytes[key] = data
            self._total += len(data)
            while self._total > self.MAX_TOTAL:
                self._total -= len(self._bytes.popitem(last=False)[1])

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._bytes.get(key)
            if data is not None:
                self._bytes.move_to_end(key)
            return data

    def any_below(self, key: str) -> bool:
        with self._lock:
            return any(k.startswith(key + "/") for k in self._bytes)

    def drop(self, key: str, *, below: bool = False) -> None:
        with self._lock:
            doomed = [k for k in self._bytes if k == key or below and k.startswith(key + "/")]
            for k in doomed:
                self._total -= len(self._bytes.pop(k))


class S3Storage(Storage):
    """``Storage`` on one S3 bucket, below one key prefix (``""``: the whole bucket).

    Concurrency contract: any number of threads may share one storage (boto3 clients are
    thread-safe). Across processes and hosts, ``create`` and the root lease are decided by
    the server's conditional writes; ``reading`` holds are per process (module docstring).
    """

    #: Requests are latency-bound (a round trip each): many in flight at once.
    concurrent_requests = 16

    def __init__(self, bucket: str, prefix: str = "", *,
                 storage_options: Mapping[str, Any] | None = None,
                 lease_s: float = 30.0, heartbeat_s: float = 10.0,
                 conditional_writes: str = "check"):
        """``lease_s``: how long the root lease lasts without a renewal (a job killed with
        SIGKILL frees its root this long after its last heartbeat); ``heartbeat_s``: how
        often a holder renews it (well under ``lease_s``). ``conditional_writes``: whether
        opening a root checks that the server honours conditional writes ("check") or not
        ("unsafe_skip_check"; ``jaxckpt.storage.write_probe``)."""
        if not bucket or "/" in bucket:
            raise ValueError(f"S3Storage: bucket must be a bucket name, not {bucket!r}")
        if not 0 < heartbeat_s < lease_s:
            raise ValueError(f"S3Storage: need 0 < heartbeat_s ({heartbeat_s}) < lease_s "
                             f"({lease_s})")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        self.conditional_writes = conditional_writes
        self.client = s3_client(storage_options)
        self._holds = ReadHolds()
        self._small = _SmallObjects()

    def __repr__(self) -> str:
        return f"S3Storage({self.bucket!r}, {self.prefix!r})"

    def url(self, key: str = "") -> str:
        """The location of ``key`` (default: this storage's prefix)."""
        return f"s3://{self.bucket}/{key or self.prefix}"

    def key(self, path: str) -> str:
        """The object key of location ``path``; ``ValueError`` outside this storage."""
        return object_name(path, split_s3_url(path), self.bucket, self.prefix, self)

    # --- whole objects -------------------------------------------------------------------
    def write(self, path: str, data: bytes | bytearray) -> None:
        self._put(path, data, {})

    def write_checked(self, path: str, data: bytes | bytearray, *, crc32c: int) -> None:
        """A single PUT carries the caller's crc32c (the server rejects bytes that do not
        match it, and botocore skips computing its own checksum of the body: a pass over
        the bytes saved); the parts of a multipart upload go as ``write`` sends them."""
        self._put(path, data, _checksum_field(crc32c))

    def write_joined(self, path: str, pieces: Sequence[bytes | bytearray | memoryview], *,
                     crc32c: int) -> None:
        """One PUT whose body reads the pieces in place (``JoinedReader``), with their
        crc32c; joined first where the object is kept (small) or goes up in parts."""
        key = self.key(path)
        size = sum(memoryview(piece).nbytes for piece in pieces)
        if size > MULTIPART_OVER or _SmallObjects.keeps(key, size):
            super().write_joined(path, pieces, crc32c=crc32c)
            return
        self._small.drop(key)
        self.client.put_object(Bucket=self.bucket, Key=key, Body=JoinedReader(pieces),
                               ContentLength=size, **_checksum_field(crc32c))

    def _put(self, path: str, data: bytes | bytearray, extra: dict[str, str]) -> None:
        key = self.key(path)
        self._small.drop(key)
        if len(data) > MULTIPART_OVER:
            self._write_multipart(key, data)
            return
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **extra)
        if _SmallObjects.keeps(key, len(data)):
            self._small.put(key, bytes(data))

    def _write_multipart(self, key: str, data: bytes | bytearray) -> None:
        """One object in parts, ``PART_THREADS`` in flight; aborted on any failure (a
        process killed meanwhile leaves it to ``discard_incomplete_uploads``)."""
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        view = memoryview(data)

        def send(number: int) -> dict[str, Any]:
            start = (number - 1) * PART_BYTES
            body = bytes(view[start:start + PART_BYTES])
            response = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload,
                                               PartNumber=number, Body=body)
            return {"PartNumber": number, "ETag": response["ETag"]}

        try:
            numbers = range(1, -(-len(data) // PART_BYTES) + 1)
            with concurrent.futures.ThreadPoolExecutor(
                    max_workers=PART_THREADS, thread_name_prefix="jaxckpt-s3-part") as pool:
                parts = list(pool.map(send, numbers))
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload,
                                                  MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                   UploadId=upload)
            raise

    def copy(self, src: str, dst: str) -> None:
        """Server-side copy (boto3's managed copy: multipart for big objects)."""
        self._small.drop(self.key(dst))
        try:
            self.client.copy({"Bucket": self.bucket, "Key": self.key(src)}, self.bucket,
                             self.key(dst))
        except Exception as exc:
            if is_not_found(exc):
                raise FileNotFoundError(2, "no such object", src) from exc
            raise

    def open_writer(self, path: str) -> ObjectWriter:
        """A writer whose bytes go up as they come: parts of a multipart upload sent while
        the caller writes the next (``storage.s3.upload``); one PUT if they fit in a part."""
        from jaxckpt.storage.s3.upload import StreamingUpload

        self._small.drop(self.key(path))
        return StreamingUpload(self, path)

    def discard_incomplete_uploads(self, prefix: str) -> list[str]:
        """Abort the unfinished multipart uploads below ``prefix``. A server that does not
        implement listing them (s3rver) has none to list: one ``CheckpointWarning``, and
        nothing is aborted."""
        keys = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        below = self.key(prefix) + "/"
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=below):
                for upload in page.get("Uploads", ()):
                    with contextlib.suppress(Exception):  # finished or aborted meanwhile
                        self.client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                    keys.append(self.url(upload["Key"]))
        except Exception as exc:
            if _status(exc) == 0 and not _code(exc):
                raise  # not an answer of the server: the client's own error
            if not is_not_implemented(exc):
                raise _request_failed(self, "ListMultipartUploads", self.url(below), exc) \
                    from exc
            warnings.warn(
                f"jaxckpt: the S3 server at {self.endpoint} does not implement "
                f"ListMultipartUploads ({_code(exc) or _status(exc)}): unfinished multipart "
                f"uploads below {self.url(below)} cannot be found, so none were aborted (the "
                f"parts a killed writer left stay stored until the server's own lifecycle "
                f"rules remove them). Going on as if there were none.",
                CheckpointWarning, stacklevel=2)
        return keys

    def create(self, path: str, data: bytes) -> None:
        """Create-only PUT. Once it wins, the bytes are kept (``_SmallObjects``): a marker
        the commit just wrote is not asked for again by the retention that follows."""
        key = self.key(path)
        self._small.drop(key)
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
        except Exception as exc:
            if not is_precondition_failed(exc):
                raise
            # A retry of our own PUT whose answer was lost (the first try landed) is refused
            # the same way as a rival's: the object holding exactly our bytes tells them
            # apart (a manifest records its creation time, so a rival's never matches).
            with contextlib.suppress(OSError):
                if self.read(path) == bytes(data):
                    self._small.put(key, bytes(data))
                    return
            raise FileExistsError(17, "already exists", path) from exc
        self._small.put(key, bytes(data))

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        if length == 0:
            return b""
        known = self._small.get(self.key(path))
        if known is not None:
            return known[offset:] if length is None else known[offset:offset + length]
        extra = {}
        if offset or length is not None:
            end = "" if length is None else str(offset + length - 1)
            extra["Range"] = f"bytes={offset}-{end}"
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.key(path), **extra)
        except Exception as exc:
            if is_not_found(exc):
                raise FileNotFoundError(2, "no such object", path) from exc
            if _code(exc) == "InvalidRange":  # offset at or past the end
                return b""
            raise
        with contextlib.closing(response["Body"]) as body:
            return body.read()

    def read_into(self, path: str, out: memoryview, *, offset: int = 0,
                  progress: Callable[[int], None] | None = None) -> int:
        """One GET (ranged past the start), its body streamed into ``out`` (``progress``:
        called every ``_PROGRESS_PIECE`` bytes)."""
        if not len(out):
            return 0
        # From the start: a plain GET, read as far as ``out`` goes (no Range: servers that
        # cut a range out of the whole object, moto among them, do less).
        extra = {"Range": f"bytes={offset}-{offset + len(out) - 1}"} if offset else {}
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.key(path),
                                              **extra)
        except Exception as exc:
            if is_not_found(exc):
                raise FileNotFoundError(2, "no such object", path) from exc
            if _code(exc) == "InvalidRange":  # offset at or past the end
                return 0
            raise
        with contextlib.closing(response["Body"]) as body:
            return _stream_into(body, out, progress)

    def size(self, path: str) -> int:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.key(path))
        except Exception as exc:
            if is_not_found(exc):
                raise FileNotFoundError(2, "no such object", path) from exc
            raise
        return int(head["ContentLength"])

    def checksum(self, path: str, algorithm: str, *, sync: bool = False) -> tuple[int, str]:
        """One GET, streamed in pieces. ``sync`` (the commit, right after the write; the
        object is durable already): none for a small object this storage just wrote, whose
        bytes it kept (``_SmallObjects``). Otherwise (a verification) the object is always
        read from the server, and a small one's bytes are kept for the read that follows."""
        known = self._small.get(self.key(path)) if sync else None
        if known is not None:
            return len(known), f"{extend(algorithm, 0, known):08x}"
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.key(path))
        except Exception as exc:
            if is_not_found(exc):
                raise FileNotFoundError(2, "no such object", path) from exc
            raise
        crc = size = 0
        pieces: list[bytes] = []
        with contextlib.closing(response["Body"]) as body:
            for piece in body.iter_chunks(_READ_PIECE):
                crc = extend(algorithm, crc, piece)
                size += len(piece)
                if size <= _SmallObjects.MAX_OBJECT:
                    pieces.append(piece)
        if _SmallObjects.keeps(self.key(path), size):
            self._small.put(self.key(path), b"".join(pieces))
        return size, f"{crc:08x}"

    def exists(self, path: str) -> bool:
        if self._small.get(self.key(path)) is not None:  # as ``read`` would return it
            return True
        try:
            self.size(path)
        except FileNotFoundError:
            return False
        return True

    # --- prefixes ------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """The server's URL (for messages)."""
        return str(self.client.meta.endpoint_url)

    def _pages(self, prefix_key: str, **extra: Any) -> Iterator[dict[str, Any]]:
        """The pages of one listing; a page that fails after its retries (s3rver answers
        500 to a truncated listing's next page) raises ``ObjectStoreError`` naming the
        server, the request and the page."""
        paginator = self.client.get_paginator("list_objects_v2")
        pages = 0
        try:
            for answer in paginator.paginate(Bucket=self.bucket, Prefix=prefix_key, **extra):
                pages += 1
                yield answer
        except Exception as exc:
            if _status(exc) == 0 and not _code(exc):
                raise  # not an answer of the server: the client's own error, or ours
            raise _request_failed(self, "ListObjectsV2", self.url(prefix_key),
                                  exc, page=pages + 1) from exc

    def list_names(self, prefix: str) -> list[str]:
        below = self.key(prefix) + "/"
        names: set[str] = set()
        for page in self._pages(below, Delimiter="/"):
            names.update(entry["Prefix"][len(below):] for entry in page.get("CommonPrefixes", ()))
            names.update(entry["Key"][len(below):] for entry in page.get("Contents", ()))
        names.discard("")
        return sorted(names)

    def list_files(self, prefix: str) -> dict[str, int]:
        below = self.key(prefix) + "/"
        return {entry["Key"][len(below):]: int(entry["Size"])
                for page in self._pages(below) for entry in page.get("Contents", ())
                if len(entry["Key"]) > len(below)}

    def is_prefix(self, path: str) -> bool:
        if self._small.any_below(self.key(path)):  # an object below it, as ``exists`` knows
            return True
        response = self.client.list_objects_v2(Bucket=self.bucket,
                                                Prefix=self.key(path) + "/", MaxKeys=1)
        return bool(response.get("KeyCount") or response.get("Contents"))

    def delete(self, path: str) -> None:
        # Deleting a missing key succeeds on S3.
        self._small.drop(self.key(path))
        self.client.delete_object(Bucket=self.bucket, Key=self.key(path))

    def delete_prefix(self, prefix: str) -> None:
        key = self.key(prefix)
        self._small.drop(key, below=True)
        keys = [entry["Key"] for page in self._pages(key + "/")
                for entry in page.get("Contents", ())]
        keys.append(key)  # an object at the prefix's own name, if any
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[start:start + _DELETE_BATCH]]
            response = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            errors = [e for e in response.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
            if errors:
                raise OSError(f"deleting below {prefix}: {len(errors)} keys not deleted, "
                              f"first {errors[0]}")

    def sync(self, prefix: str, *, data: bool = True, skip: Collection[str] = ()) -> None:
        """Nothing to do: an S3 PUT is durable when it returns."""

    # --- concurrency ---------------------------------------------------------------------
    def lock_root(self, root: str) -> RootLock:
        from jaxckpt.storage.s3.lease import S3Lease

        lease = S3Lease(self, self.key(root.rstrip("/") + "/.lock"),
                        lease_s=self.lease_s, heartbeat_s=self.heartbeat_s)
        lease.acquire()
        return lease

    @contextlib.contextmanager
    def reading(self, path: str) -> Iterator[None]:
        with self._holds.hold(self.key(path)):
            yield

    def delete_unless_reading(self, path: str) -> bool:
        key = self.key(path)
        with self._holds.lock:  # held while deleting, so no hold starts in between
            if self._holds.counts.get(key):
                return False
            self._small.drop(key)
            self.client.delete_object(Bucket=self.bucket, Key=key)
        return True
