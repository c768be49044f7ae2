"""A moto S3 server on 127.0.0.1 for the tests that need an object store: started as a
subprocess of its own (``python -m moto.server``, so its request handling does not compete
with the test for one interpreter), stopped by its PID, never reachable from elsewhere.

``moto_s3()`` is a context manager giving the ``storage_options`` of a client of that server;
``server_env(options)`` gives the same as the standard environment variables, for worker
processes and CLI commands. Imports nothing from the library but ``s3_client``.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

CREDENTIALS = {"region_name": "us-east-1", "aws_access_key_id": "testing",
               "aws_secret_access_key": "testing"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


#: Servers started before giving up: a port found free can be taken before the server binds it.
START_TRIES = 3


@contextlib.contextmanager
def moto_s3(*buckets: str, timeout_s: float = 30.0) -> Iterator[dict[str, Any]]:
    """A fresh moto server holding the empty ``buckets``; yields client ``storage_options``
    (few retries, short timeouts: a test failure shows quickly)."""
    from jaxckpt.storage.s3.storage import s3_client

    proc, port = _start(timeout_s)
    options = {"endpoint_url": f"http://127.0.0.1:{port}", **CREDENTIALS, "max_attempts": 3,
               "connect_timeout": 5, "read_timeout": 30}
    try:
        client = s3_client(options)
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield options
    finally:
        _stop(proc)


def _start(timeout_s: float) -> tuple[subprocess.Popen[bytes], int]:
    """A moto server answering HTTP: its process and port. One that exits first (its port
    was taken between ``_free_port`` and its bind) is started again on another port."""
    for _ in range(START_TRIES):
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                 str(port)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            if _answers(proc, port, timeout_s):
                return proc, port
        except BaseException:
            _stop(proc)
            raise
        _stop(proc)
    raise RuntimeError(f"moto server did not start: it exited on {START_TRIES} ports")


def _answers(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> bool:
    """Wait until ``port`` answers an HTTP request while ``proc`` runs: True. False when
    ``proc`` exits first. A socket that accepts connections is not enough: whoever took the
    port may be listening there."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            connection.request("GET", "/")
            connection.getresponse().read()
            return proc.poll() is None
        except (OSError, http.client.HTTPException):
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto server did not answer on port {port} within "
                                   f"{timeout_s} s") from None
            time.sleep(0.1)
        finally:
            connection.close()
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def server_env(options: dict[str, Any], base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment through which boto3 finds the server of ``options`` (endpoint,
    region, credentials) without ``storage_options``."""
    env = dict(os.environ if base is None else base)
    env.update({"AWS_ENDPOINT_URL": options["endpoint_url"],
                "AWS_REGION": options["region_name"],
                "AWS_DEFAULT_REGION": options["region_name"],
                "AWS_ACCESS_KEY_ID": options["aws_access_key_id"],
                "AWS_SECRET_ACCESS_KEY": options["aws_secret_access_key"]})
    return env
