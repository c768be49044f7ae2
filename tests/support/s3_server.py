"""A moto S3 server on 127.0.0.1 for the tests that need an object store: started as a
subprocess of its own (``python -m moto.server``, so its request handling does not compete
with the test for one interpreter), stopped by its PID, never reachable from elsewhere.

``moto_s3()`` is a context manager giving the ``storage_options`` of a client of that server;
``server_env(options)`` gives the same as the standard environment variables, for worker
processes and CLI commands. Imports nothing from the library but ``s3_client``.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def moto_s3(*buckets: str, timeout_s: float = 30.0) -> Iterator[dict[str, Any]]:
    """A fresh moto server holding the empty ``buckets``; yields client ``storage_options``
    (few retries, short timeouts: a test failure shows quickly)."""
    from jaxckpt.s3_storage import s3_client

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    options = {"endpoint_url": f"http://127.0.0.1:{port}", **CREDENTIALS, "max_attempts": 3,
               "connect_timeout": 5, "read_timeout": 30}
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start (exit {proc.poll()})") from None
                time.sleep(0.1)
        client = s3_client(options)
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield options
    finally:
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
