"""A GCS-protocol server for tests: the pure-Python ``gcp-storage-emulator`` in a child
process on 127.0.0.1, and ``PreconditionProxy``, an HTTP proxy in front of it.

Why the proxy: the emulator ignores ``ifGenerationMatch`` (it has no code for preconditions
at all: every upload and delete goes through), so against it alone a create-only write can
never fail and a test of one proves nothing. The proxy does what GCS does: a request that
carries ``ifGenerationMatch=G`` is checked against the object's current generation (0 when
there is none) and answered 412 when they differ, the check and the forwarded request being
one step under a lock, so that of racing conditional writes exactly one wins. It also
records every request (method, object name, query) so that tests can see which
preconditions a client sent, and can fail requests on purpose (503 before forwarding, or
after: the write happened but its answer was lost).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

_OBJECT_PATH = re.compile(r"^(?:/upload|/download)?/storage/v1/b/([^/]+)/o(?:/([^?]+))?$")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


#: Emulators started before giving up: a port found free can be taken before one binds it.
START_TRIES = 3


@contextlib.contextmanager
def emulator(bucket: str) -> Iterator[str]:
    """Run the emulator (in memory, ``bucket`` created) until the block ends; yields its
    endpoint URL. Stopped by its PID (SIGTERM, then SIGKILL)."""
    for _ in range(START_TRIES):
        port = free_port()
        log = tempfile.TemporaryFile()
        child = subprocess.Popen(
            [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
             "--port", str(port), "--in-memory", "--default-bucket", bucket, "--quiet"],
            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        try:
            started = _serves(child, log, port, bucket)
        except BaseException:
            _stop(child)
            raise
        finally:
            log.close()
        if started:
            break
        _stop(child)
    else:
        raise RuntimeError(f"the GCS emulator did not start: its port was taken {START_TRIES} "
                           "times")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(child)


def _serves(child: subprocess.Popen[bytes], log: Any, port: int, bucket: str) -> bool:
    """Wait until the emulator answers for ``bucket`` on ``port``: True. False when it could
    not bind the port (taken since ``free_port``): then it exits, or its server thread dies
    with "Address already in use" while the process waits on it for ever."""
    deadline = time.monotonic() + 60
    while True:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            connection.request("GET", f"/storage/v1/b/{bucket}")
            if connection.getresponse().status == 200:
                return True
        except (OSError, http.client.HTTPException):
            pass
        finally:
            connection.close()
        # pread: a seek would move the offset the child writes its stderr through.
        if child.poll() is not None or b"Address already in use" in os.pread(
                log.fileno(), 1 << 20, 0):
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(f"the GCS emulator did not start (exit {child.poll()})")
        time.sleep(0.1)


def _stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        os.kill(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)


@dataclasses.dataclass(frozen=True)
class Request:
    """One request the proxy saw: ``name`` is the object it names ("" for none)."""

    method: str
    name: str
    query: dict[str, str]
    answered: int

    @property
    def is_upload(self) -> bool:
        """An upload, or a resumable upload's chunk (a PUT to its session)."""
        return (self.method == "POST" and "uploadType" in self.query) or (
            self.method == "PUT" and "upload_id" in self.query)


class PreconditionProxy:
    """The proxy of the module docstring, on 127.0.0.1 in a thread of the test process.

    ``fail_before``: answer 503 to the next N requests without forwarding them (-1: all);
    ``fail_after``: forward the next N uploads, then answer 503 instead of the server's answer
    (a write whose response was lost); ``drop_answer_to``: object names whose next upload
    (for a resumable upload: the chunk that finishes it) is forwarded, then answered by
    closing the connection (recorded as answered 0). A chunk sent again to a finished
    resumable session gets the answer that finished it, as from GCS (the emulator forgets
    finished sessions and would answer 404).
    ``requests``: what was seen, in order.
    """

    def __init__(self, target: str):
        self.target = urllib.parse.urlsplit(target).netloc
        self.fail_before = 0
        self.fail_after = 0
        self.drop_answer_to: set[str] = set()
        self._sessions: dict[str, str] = {}  # resumable upload id -> object name
        self._finished: dict[str, tuple[int, list[tuple[str, str]], bytes]] = {}
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, data = proxy.handle(self.command, self.path, dict(self.headers),
                                                     body)
                if status == _NO_ANSWER:
                    self.close_connection = True
                    return
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in ("content-length", "transfer-encoding", "connection",
                                            "server", "date"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = do_HEAD = _relay

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def uploads(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.is_upload and r.name == name]

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes
               ) -> tuple[int, list[tuple[str, str]], bytes]:
        split = urllib.parse.urlsplit(path)
        query = dict(urllib.parse.parse_qsl(split.query))
        session = query.get("upload_id") if method == "PUT" else None
        name = self._sessions.get(session or "") or _object_name(split.path, query, headers,
                                                                  body)
        with self._lock:
            if self.fail_before:
                self.fail_before -= self.fail_before > 0
                return self._record(method, name, query, 503, [], b"")
        condition = query.get("ifGenerationMatch")
        mutating = method in ("POST", "PUT", "PATCH", "DELETE")
        # Mutations go one at a time, so that a condition checked still holds when the
        # request it guards reaches the server.
        with self._lock if (mutating or condition is not None) else contextlib.nullcontext():
            if session in self._finished:
                # GCS answers a finished session with its object (the emulator forgets it).
                return self._record(method, name, query, *self._finished[session])
            if condition is not None and name:
                bucket = _OBJECT_PATH.match(split.path).group(1)  # type: ignore[union-attr]
                if self._generation(bucket, name) != int(condition):
                    return self._record(method, name, query, 412, [
                        ("Content-Type", "application/json")], _PRECONDITION_FAILED)
            status, answer_headers, data = self._forward(method, path, headers, body)
            self._track_session(query, name, session, (status, answer_headers, data))
            upload = method == "POST" and "uploadType" in query
            if self.fail_after and upload:
                self.fail_after -= 1
                return self._record(method, name, query, 503, [], b"")
            # Stored: a one-request upload, or the chunk that finished a resumable one (whose
            # first request only opened a session).
            stored = (upload and query["uploadType"] != "resumable") or (
                session is not None and status in (200, 201))
            if stored and name in self.drop_answer_to:
                self.drop_answer_to.discard(name)
                return self._record(method, name, query, _NO_ANSWER, [], b"")
            return self._record(method, name, query, status, answer_headers, data)

    def _track_session(self, query: dict[str, str], name: str, session: str | None,
                       answer: tuple[int, list[tuple[str, str]], bytes]) -> None:
        """Remember the object a resumable session started for, and the answer that finished
        one (called under the lock)."""
        status, headers, _ = answer
        if session is not None and status in (200, 201):
            self._finished[session] = answer
        elif query.get("uploadType") == "resumable" and "upload_id" not in query and \
                status == 200:
            location = next((v for k, v in headers if k.lower() == "location"), "")
            started = urllib.parse.parse_qs(urllib.parse.urlsplit(location).query)
            if started.get("upload_id"):
                self._sessions[started["upload_id"][0]] = name

    def _record(self, method: str, name: str, query: dict[str, str], status: int,
                headers: list[tuple[str, str]], data: bytes
                ) -> tuple[int, list[tuple[str, str]], bytes]:
        self.requests.append(Request(method, name, query, status))
        return status, headers, data

    def _forward(self, method: str, path: str, headers: dict[str, str], body: bytes
                 ) -> tuple[int, list[tuple[str, str]], bytes]:
        upstream = http.client.HTTPConnection(self.target, timeout=30)
        try:
            upstream.request(method, path, body=body, headers=headers)
            answer = upstream.getresponse()
            return answer.status, answer.getheaders(), answer.read()
        finally:
            upstream.close()

    def _generation(self, bucket: str, name: str) -> int:
        status, _, data = self._forward(
            "GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}", {}, b"")
        if status == 404:
            return 0
        return int(json.loads(data)["generation"])


_NO_ANSWER = 0  # the status that closes the connection instead of answering
_PRECONDITION_FAILED = json.dumps({"error": {
    "code": 412, "message": "At least one of the pre-conditions you specified did not hold.",
    "errors": [{"reason": "conditionNotMet", "domain": "global"}]}}).encode()


def _object_name(path: str, query: dict[str, str], headers: dict[str, str], body: bytes) -> str:
    """The object a JSON-API request names: in the path, the ``name`` query parameter, the
    JSON part of a multipart upload, or the JSON body that starts a resumable upload (whose
    precondition the proxy therefore checks when the upload starts, GCS when it ends)."""
    match = _OBJECT_PATH.match(path)
    if match is None:
        return ""
    if match.group(2):
        return urllib.parse.unquote(match.group(2))
    if "name" in query:
        return query["name"]
    if query.get("uploadType") == "resumable" and "upload_id" not in query and body:
        return str(json.loads(body).get("name", ""))  # the session's start: JSON metadata
    if query.get("uploadType") == "multipart":
        content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
        boundary = re.search(r'boundary="?([^";]+)', content_type)
        if boundary:
            for part in body.split(b"--" + boundary.group(1).encode()):
                head, _, content = part.partition(b"\r\n\r\n")
                if b"application/json" in head.lower():
                    return str(json.loads(content.strip()).get("name", ""))
    return ""
