"""The root lease and request deadlines against the servers the tests start (moto for s3://,
the GCS emulator behind its precondition proxy for gs://), with the fault proxy between where
a server must misbehave: a conditional DELETE answered 501 (LocalStack's S3), a server that
stops answering. The protocol's decisions one by one are tests/unit/storage/test_lease.py."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import uuid

import pytest

from jaxckpt import RootLockedError
from jaxckpt.storage.url import parse_root

from support.object_stores import KINDS, fault_proxy_before, object_store
from support.s3_server import CREDENTIALS, _start, _stop

BUCKET = "jaxckpt-lease"
# A lease far longer than any test: a root that opens at once was not waited for.
LONG_LEASE = {"lease_s": 60.0, "heartbeat_s": 0.5}


@pytest.fixture(scope="module", params=KINDS)
def store(request):
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with object_store(request.param, BUCKET) as running:
        yield running


@pytest.fixture
def proxy(store):
    with fault_proxy_before(store) as front:
        yield front


@pytest.fixture
def root(store):
    return store.url(f"lease/{uuid.uuid4().hex}")


def lock_in_another_process(options, root) -> str:
    """'acquired' or 'refused: ...' from a fresh process opening ``root`` at once."""
    source = ("from jaxckpt import RootLockedError\n"
              "from jaxckpt.storage.url import parse_root\n"
              f"storage = parse_root({root!r}, {options!r})[1]\n"
              "try:\n"
              f"    storage.lock_root({root!r}).release()\n"
              "    print('acquired')\n"
              "except RootLockedError as exc:\n"
              "    print('refused:', exc)\n")
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                          timeout=120, check=True)
    return done.stdout.strip()


def test_a_lease_released_where_a_conditional_delete_is_not_implemented_is_free(
        store, proxy, root, caplog):
    proxy.no_conditional_delete = True
    options = {**store.storage_options, "endpoint_url": proxy.url, **LONG_LEASE}
    storage = parse_root(root, options)[1]
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        storage.lock_root(root).release()
    assert proxy.counts["not_implemented"] == 1  # the delete was tried, and refused
    assert not caplog.records, caplog.text  # given up all the same: nothing to report
    assert json.loads(storage.read(f"{root}/.lock"))["released"] is True
    assert lock_in_another_process(options, root) == "acquired"
    storage.lock_root(root).release()  # and by this process again, at once


def plant(storage, root, **record) -> None:
    """A lease just written by a holder on another host (it cannot be checked from here),
    its bytes new each time (as a holder's renewals are: an S3 version is their digest)."""
    body = {"holder": "planted", "host": "another-host", "pid": 4242, "start": 1,
            "lease_s": 2.0, "heartbeat_s": 0.5, "written": uuid.uuid4().hex, **record}
    storage.write(f"{root}/.lock", json.dumps(body).encode())


def test_a_young_lease_no_longer_renewed_is_waited_for_and_taken_over(store, root, caplog):
    storage = store.storage(root, **LONG_LEASE)
    plant(storage, root)
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        lease = storage.lock_root(root)  # not refused: watched until its 2 s ran out
    try:
        assert json.loads(storage.read(f"{root}/.lock"))["holder"] == lease.token
        assert "host another-host, pid 4242" in caplog.text
        assert "waiting up to" in caplog.text and "took over the root lease" in caplog.text
    finally:
        lease.release()


def test_a_lease_its_holder_keeps_renewing_is_refused(store, root):
    storage = store.storage(root, **LONG_LEASE)
    plant(storage, root, lease_s=60.0)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(0.3):
            plant(storage, root, lease_s=60.0)

    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        with pytest.raises(RootLockedError, match="pid 4242.*renewed while this job waited"):
            storage.lock_root(root)
    finally:
        stop.set()
        renewer.join()
    assert json.loads(storage.read(f"{root}/.lock"))["holder"] == "planted"


def test_a_server_that_stops_answering_fails_a_request_by_its_deadline_naming_it(
        store, proxy, root):
    options = {**store.storage_options, "endpoint_url": proxy.url, "max_attempts": 50,
               "connect_timeout": 0.5, "read_timeout": 0.5, "request_deadline_s": 1.5}
    storage = parse_root(root, options)[1]
    storage.write(f"{root}/object", b"bytes")
    proxy.hold = True  # from now on every request goes unanswered
    with pytest.raises(TimeoutError) as caught:
        storage.read(f"{root}/object")
    message = str(caught.value)
    assert f"endpoint {proxy.url} is not answering" in message, message
    assert "request_deadline_s" in message
    assert ("GetObject" if store.kind == "s3" else "GET ") in message, message
    # Stopped by the deadline, long before the 50 tries the attempts allowed.
    assert 1 <= proxy.counts["held"] < 10, proxy.counts


def test_requests_are_bounded_by_default(store, root):
    timing = ("max_attempts", "connect_timeout", "read_timeout", "request_deadline_s")
    options = {k: v for k, v in store.storage_options.items() if k not in timing}
    storage = parse_root(root, options)[1]
    if store.kind == "s3":
        config = storage.client.meta.config
        assert (config.connect_timeout, config.read_timeout) == (10, 30)
        handlers = storage.client.meta.events._emitter._handlers.prefix_search(
            "needs-retry.s3.GetObject")
        deadlines = [h.__self__ for h in handlers if type(getattr(h, "__self__", None)).__name__
                     == "_Deadline"]
        assert [d.deadline_s for d in deadlines] == [60.0]
    else:
        assert storage.timeout == (10.0, 30.0) and storage.request_deadline_s == 60.0


def test_the_cli_names_a_server_that_stops_answering_as_an_environment_error(
        store, proxy, root, capsys):
    from jaxckpt.tools.cli import main

    options = {**store.storage_options, "endpoint_url": proxy.url, "connect_timeout": 0.5,
               "read_timeout": 0.5, "request_deadline_s": 1.0}
    flags = [flag for key, value in options.items()
             for flag in ("--storage-option", f"{key}={value}")]
    proxy.hold = True
    assert main(["ls", root, *flags]) == 2
    said = capsys.readouterr().err
    assert "object storage request failed" in said and f"{proxy.url} is not answering" in said


def test_opening_a_manager_on_a_stopped_server_fails_by_its_deadline_naming_it():
    """The issue's case itself: the server process frozen with SIGSTOP (it accepts
    connections, in the kernel, and answers nothing), a manager opened on it."""
    pytest.importorskip("moto.server")
    import jaxckpt

    server, port = _start(30.0)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        options = {"endpoint_url": endpoint, **CREDENTIALS, "read_timeout": 0.5,
                   "connect_timeout": 0.5, "request_deadline_s": 1.5, "max_attempts": 50}
        parse_root("s3://frozen/run", options)[1].client.create_bucket(Bucket="frozen")
        os.killpg(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(jaxckpt.CheckpointRootError,
                               match=f"endpoint {endpoint} is not answering: ListObjectsV2"):
                jaxckpt.CheckpointManager("s3://frozen/run", storage_options=options,
                                          preemption_signals=())
        finally:
            os.killpg(server.pid, signal.SIGCONT)
    finally:
        _stop(server)
