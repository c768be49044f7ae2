"""An S3 object written as a stream: ``StreamingUpload``, what ``S3Storage.open_writer`` gives.

Owns: sending an object's bytes while its writer still produces them: full parts go up on
the upload's own threads as a multipart upload (at most ``PART_THREADS`` in flight, so at
most ``PART_THREADS + 1`` parts in memory; part size ``STREAM_PART_BYTES``, doubling every
2,000 parts to reach S3's 10,000-part limit late); ``close`` completes it, and only then
does the object appear. An object of one part is a single PUT. A failure or ``abort``
aborts the upload; a killed process leaves it to ``discard_incomplete_uploads``.

Must not import: jax, orbax, torch. Uses the storage's boto3 client.

Concurrency: one writer thread calls ``write``, ``close`` and ``abort``; the part threads
only send; each upload has its own threads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxckpt.storage.s3.storage import S3Storage

__all__ = ["STREAM_PART_BYTES", "StreamingUpload"]

#: The size of the first parts of a streamed object (S3's smallest part is 5 MiB).
STREAM_PART_BYTES = 16 << 20
#: Parts of one streamed object sent or waiting at once.
PART_THREADS = 4
_PARTS_PER_SIZE = 2000


def part_size(number: int, first: int = STREAM_PART_BYTES) -> int:
    """The size of part ``number`` (from 1) of a streamed object, all but the last."""
    return first << ((number - 1) // _PARTS_PER_SIZE)


class StreamingUpload:
    """``ObjectWriter`` of ``S3Storage``: parts sent while the writer writes (module
    docstring)."""

    def __init__(self, storage: S3Storage, path: str, *, first_part: int | None = None,
                 threads: int | None = None):
        """``first_part``, ``threads``: default ``STREAM_PART_BYTES``, ``PART_THREADS``."""
        self._storage = storage
        self._path = path
        self._key = storage.key(path)
        self._first_part = STREAM_PART_BYTES if first_part is None else first_part
        self._threads = PART_THREADS if threads is None else threads
        self._buffer: bytearray | None = bytearray()
        self._part = part_size(1, self._first_part)  # the size of the part being filled
        self._upload: str | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._slots = threading.Semaphore(self._threads)
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._failed: concurrent.futures.Future[dict[str, Any]] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._buffer is None:
            raise ValueError(f"write to {self._path} after close or abort")
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            if len(self._buffer) == self._part:  # full, and more is coming: send it
                self._send_part()
            take = min(len(view) - done, self._part - len(self._buffer))
            # Grown as bytes come (no zero-filled part for a small object); one copy.
            self._buffer += view[done:done + take]
            done += take
        return done

    def close(self) -> None:
        if self._buffer is None:
            return
        if self._upload is None:  # one part or less: a plain PUT
            data, self._buffer = self._buffer, None
            self._storage.write(self._path, data)
            return
        try:
            self._send_part(last=True)
            parts = [part.result() for part in self._parts]
            self._storage.client.complete_multipart_upload(
                Bucket=self._storage.bucket, Key=self._key, UploadId=self._upload,
                MultipartUpload={"Parts": parts})
        except BaseException:
            self.abort()
            raise
        self._finish_pool()

    def abort(self) -> None:
        self._buffer = None
        for part in self._parts:
            part.cancel()
        self._finish_pool()
        if self._upload is not None:
            with contextlib.suppress(Exception):
                self._storage.client.abort_multipart_upload(
                    Bucket=self._storage.bucket, Key=self._key, UploadId=self._upload)
            self._upload = None

    def _finish_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _send_part(self, *, last: bool = False) -> None:
        """Hand the buffer to a part thread (waiting for a free slot) and, unless it is the
        ``last``, start the next."""
        assert self._buffer is not None
        if self._upload is None:
            self._upload = self._storage.client.create_multipart_upload(
                Bucket=self._storage.bucket, Key=self._key)["UploadId"]
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self._threads, thread_name_prefix="jaxckpt-s3-stream")
        assert self._pool is not None
        if self._failed is not None:  # a part that failed stops the writer now, not at close
            self._failed.result()
        self._slots.acquire()
        data, number = self._buffer, len(self._parts) + 1
        try:
            part = self._pool.submit(self._send, number, data)
        except BaseException:
            self._slots.release()
            raise
        part.add_done_callback(self._part_done)
        self._parts.append(part)
        self._buffer = None if last else bytearray()
        self._part = part_size(number + 1, self._first_part)

    def _part_done(self, part: concurrent.futures.Future[dict[str, Any]]) -> None:
        if not part.cancelled() and part.exception() is not None:
            self._failed = part
        self._slots.release()

    def _send(self, number: int, data: bytearray) -> dict[str, Any]:
        response = self._storage.client.upload_part(
            Bucket=self._storage.bucket, Key=self._key, UploadId=self._upload,
            PartNumber=number, Body=data)
        return {"PartNumber": number, "ETag": response["ETag"]}
