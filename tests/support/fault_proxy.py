"""A fault-injecting HTTP proxy on 127.0.0.1 between an object-store client (S3 or GCS) and
the test's server.

``FaultProxy(target, seed=..., rates=...)`` forwards every request to ``target`` and, per
request, by a seeded draw, instead answers 503 (throttled), drops the connection before
forwarding (the request never reached the server), drops it after forwarding (the server
acted but the answer is lost: the client's retry must cope with its own first attempt,
e.g. a create-only PUT that already landed), or waits before forwarding (a slow server).
``fail_next = N`` answers 503 to the next N requests whatever the rates (-1: to every one
from now on), for tests that count retries exactly. ``counts`` says how many of each it
did.

Servers that lack a feature, as some S3- and GCS-protocol servers do: ``ignore_conditions``
names the conditions of a conditional write that the proxy strips before forwarding (the
headers ``If-None-Match`` and ``If-Match`` of S3, the ``ifGenerationMatch`` parameter of GCS;
``CONDITIONS``: all three), so the server overwrites as a server that ignores them does;
``answer`` maps an operation of ``OPERATIONS`` to the status the proxy answers it with, not
forwarding it (``{"ListMultipartUploads": 501}``: a server without that operation).
``requests`` records (method, path with query, conditions sent) of every request seen.
Server behaviours of the lease tests: ``no_conditional_delete`` answers a DELETE that carries
a precondition (S3's ``If-Match``, GCS's ``ifGenerationMatch``) with 501 Not Implemented (as
LocalStack's S3 does), counted in ``counts["not_implemented"]``; ``hold`` keeps every request
from then on unanswered (a server that stopped answering, as under SIGSTOP) until it is
switched off or the proxy closes, counting them in ``counts["held"]``. Imports nothing from
the library.

Concurrency: a threading HTTP server; the counters are guarded by a lock.
"""

from __future__ import annotations

import http.client
import http.server
import random
import threading
import time
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

FAULTS = ("unavailable", "drop_before", "drop_after", "slow")
#: The 501 of S3 (XML) and of GCS (JSON, the precondition in the query).
_NOT_IMPLEMENTED = {
    False: ("application/xml", b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
            b"NotImplemented</Code><Message>A header you provided implies functionality that "
            b"is not implemented</Message></Error>"),
    True: ("application/json", b'{"error": {"code": 501, "message": "Not Implemented"}}')}

#: The conditions of a conditional write: S3's headers, GCS's query parameter.
CONDITIONS = frozenset({"If-None-Match", "If-Match", "ifGenerationMatch"})
#: Operations ``answer`` can single out, told apart by (method, query parameters).
OPERATIONS = {
    "ListMultipartUploads": lambda method, query: method == "GET" and "uploads" in query,
    "ListObjectsV2": lambda method, query: method == "GET" and query.get("list-type") == "2",
}
_ERROR_CODES = {500: "InternalError", 501: "NotImplemented", 503: "ServiceUnavailable"}


def _error_body(status: int) -> bytes:
    code = _ERROR_CODES.get(status, "Error")
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>'
            f'answered {status} by the test proxy</Message></Error>').encode()


def _without_conditions(path: str, headers: dict[str, str], ignored: frozenset[str]
                        ) -> tuple[str, dict[str, str], dict[str, str]]:
    """(path, headers) with the ``ignored`` conditions taken out, and those that were sent."""
    split = urlsplit(path)
    query = parse_qsl(split.query, keep_blank_values=True)
    sent = {name: value for name, value in headers.items() if name.title() in CONDITIONS}
    sent.update((name, value) for name, value in query if name in CONDITIONS)
    if not ignored:
        return path, headers, sent
    headers = {name: value for name, value in headers.items() if name.title() not in ignored}
    kept = [(name, value) for name, value in query if name not in ignored]
    return urlunsplit(split._replace(query=urlencode(kept))), headers, sent


class FaultProxy:
    """See the module docstring. ``rates``: probability of each fault per request."""

    def __init__(self, target: str, *, seed: int = 0, rates: dict[str, float] | None = None,
                 slow_s: float = 0.3):
        self.rates = dict(rates or {})
        self.counts = {name: 0 for name in ("forwarded", "held", "not_implemented", *FAULTS)}
        self.enabled = True
        self.fail_next = 0
        self.ignore_conditions: frozenset[str] = frozenset()
        self.answer: dict[str, int] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.no_conditional_delete = False
        self.hold = False
        self._unheld = threading.Event()
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        proxy = self
        target_host = urlsplit(target).netloc

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.hold:
                    with proxy._lock:
                        proxy.counts["held"] += 1
                    while proxy.hold and not proxy._unheld.wait(0.05):
                        pass
                    self.close_connection = True
                    return
                gcs = "ifGenerationMatch=" in self.path
                if proxy.no_conditional_delete and self.command == "DELETE" and (
                        gcs or "If-Match" in self.headers):
                    with proxy._lock:
                        proxy.counts["not_implemented"] += 1
                    self._send(501, *_NOT_IMPLEMENTED[gcs])
                    return
                path, headers, sent = _without_conditions(self.path, dict(self.headers),
                                                          frozenset(proxy.ignore_conditions))
                with proxy._lock:
                    proxy.requests.append((self.command, self.path, sent))
                status = proxy._answer_for(self.command, self.path)
                if status:
                    self._send(status, "application/xml", _error_body(status))
                    return
                fault = proxy._draw()
                if fault == "unavailable":
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if fault == "drop_before":
                    self.close_connection = True
                    return
                if fault == "slow":
                    time.sleep(slow_s)
                upstream = http.client.HTTPConnection(target_host, timeout=60)
                try:
                    upstream.request(self.command, path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                if fault == "drop_after":
                    self.close_connection = True
                    return
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("content-length", "transfer-encoding",
                                            "connection", "server", "date"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _send(self, status: int, content_type: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _relay

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _answer_for(self, method: str, path: str) -> int | None:
        """The status ``answer`` gives this request instead of forwarding it, if any."""
        query = dict(parse_qsl(urlsplit(path).query, keep_blank_values=True))
        return next((status for name, status in dict(self.answer).items()
                     if OPERATIONS[name](method, query)), None)

    def _draw(self) -> str:
        with self._lock:
            fault = "forwarded"
            if self.fail_next:
                self.fail_next -= self.fail_next > 0
                fault = "unavailable"
            elif self.enabled:
                value, edge = self._random.random(), 0.0
                for name in FAULTS:
                    edge += self.rates.get(name, 0.0)
                    if value < edge:
                        fault = name
                        break
            self.counts[fault] += 1
            return fault

    def close(self) -> None:
        self._unheld.set()
        self.server.shutdown()
        self.server.server_close()
