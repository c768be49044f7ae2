"""The object-store servers the tests start (support.s3_server, support.gcs_server) survive a
port taken between the probe that found it free and the server's own bind: the server that
could not bind is given up and another started on another port. Without that, a fixture
either failed ("did not start") or, worse, took whoever listened on the port for the server.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator

import pytest

from support import gcs_server, s3_server
from support.object_stores import KINDS


@contextlib.contextmanager
def first_port_taken(module, name: str) -> Iterator[int]:
    """``module.name`` (its free-port probe) first returns a port someone listens on (and
    never answers), then free ones again; yields the taken port."""
    real: Callable[[], int] = getattr(module, name)
    with socket.socket() as taken, pytest.MonkeyPatch.context() as patch:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        handed = iter([port])
        patch.setattr(module, name, lambda: next(handed, None) or real())
        yield port


@pytest.mark.skipif("s3" not in KINDS, reason="boto3 or moto is not installed")
def test_the_moto_server_moves_to_another_port_when_its_port_was_taken():
    from jaxckpt.storage.s3.storage import s3_client

    with first_port_taken(s3_server, "_free_port") as taken, s3_server.moto_s3("ports") as options:
        assert not options["endpoint_url"].endswith(f":{taken}")
        names = [b["Name"] for b in s3_client(options).list_buckets()["Buckets"]]
        assert names == ["ports"]


@pytest.mark.skipif("gs" not in KINDS, reason="google-cloud-storage or the emulator is not "
                                              "installed")
def test_the_gcs_emulator_moves_to_another_port_when_its_port_was_taken():
    import http.client
    import urllib.parse

    with first_port_taken(gcs_server, "free_port") as taken, gcs_server.emulator("b") as url:
        where = urllib.parse.urlsplit(url)
        assert where.port != taken
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
        connection.request("GET", "/storage/v1/b/b")
        assert connection.getresponse().status == 200
        connection.close()
