"""The lease protocol of jaxckpt.storage.lease over an in-memory lease object (the one place a fake
stands in for a server: the protocol's decisions, each in a fraction of a second). The same
behaviours against the moto server and the GCS emulator are in
tests/integration/test_lease_servers.py.

The fake keeps what a server keeps: a version that changes on every write, the time of the
last write (its clock is this process's monotonic clock), and conditional requests decided
under a lock."""

import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from jaxckpt import RootLockedError
from jaxckpt.storage.lease import LeaseConflict, LeaseRequestUnsupported, LeaseState, ObjectLease
from jaxckpt.storage.lease_holder import holder_status, this_process

LEASE_S, HEARTBEAT_S = 0.8, 0.2


class MemoryLeaseObject:
    """An in-memory ``LeaseObject``; ``delete_answer`` makes a delete raise instead."""

    url = "mem://bucket/run/.lock"

    def __init__(self):
        self._lock = threading.Lock()
        self.body: bytes | None = None
        self.version = 0
        self.written = 0.0
        self.delete_answer: Exception | None = None

    def _write(self, body: bytes) -> str:
        self.body, self.version, self.written = body, self.version + 1, time.monotonic()
        return str(self.version)

    def create(self, body):
        with self._lock:
            if self.body is not None:
                raise LeaseConflict(self.url)
            return self._write(body)

    def replace(self, body, version):
        with self._lock:
            if self.body is None or str(self.version) != version:
                raise LeaseConflict(self.url)
            return self._write(body)

    def read(self):
        with self._lock:
            if self.body is None:
                return None
            return LeaseState(version=str(self.version), body=self.body,
                              age_s=time.monotonic() - self.written)

    def delete(self, version):
        with self._lock:
            if self.delete_answer is not None:
                raise self.delete_answer
            if self.body is None or str(self.version) != version:
                raise LeaseConflict(self.url)
            self.body = None

    def record(self) -> dict:
        return json.loads(self.body)


def lease(lease_object) -> ObjectLease:
    return ObjectLease(lease_object, lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S)


def plant(lease_object, **record) -> None:
    """A lease written just now by the holder ``record`` describes."""
    body = {"holder": "planted", "lease_s": LEASE_S, "heartbeat_s": HEARTBEAT_S, **record}
    with lease_object._lock:
        lease_object._write(json.dumps(body).encode())


def test_a_release_the_server_cannot_delete_marks_the_lease_released(caplog):
    lease_object = MemoryLeaseObject()
    lease_object.delete_answer = LeaseRequestUnsupported(lease_object.url)
    first = lease(lease_object)
    first.acquire()
    with caplog.at_level(logging.INFO, logger="jaxckpt"):
        first.release()
        assert lease_object.record()["released"] is True
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # A taker of another host's process sees a released lease as free, without waiting.
    plant(lease_object, host="another-host", pid=4242, start=1, released=True, lease_s=60)
    second = lease(lease_object)
    with caplog.at_level(logging.INFO, logger="jaxckpt"):
        second.acquire()
    assert lease_object.record()["holder"] == second.token
    assert "released by its holder" in caplog.text and "waiting" not in caplog.text
    second.release()


def test_a_lease_this_process_failed_to_give_up_does_not_block_it(caplog):
    lease_object = MemoryLeaseObject()
    lease_object.delete_answer = OSError("the server went away")
    first = lease(lease_object)
    first.acquire()
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        first.release()
    assert "could not give up the root lease" in caplog.text
    assert lease_object.record()["holder"] == first.token  # still there, young
    second = lease(lease_object)
    second.acquire()  # this process is never "another running job" to itself
    assert lease_object.record()["holder"] == second.token
    assert "an earlier manager of this process" in caplog.text
    second.release()


def test_a_lease_held_by_an_open_manager_of_this_process_is_refused_at_once():
    lease_object = MemoryLeaseObject()
    first = lease(lease_object)
    first.acquire()
    try:
        with pytest.raises(RootLockedError, match=f"another manager of this same process "
                                                  f"\\(pid {os.getpid()}\\), still open"):
            lease(lease_object).acquire()
    finally:
        first.release()


def test_racing_takers_in_one_process_exactly_one_wins():
    lease_object = MemoryLeaseObject()
    takers = [lease(lease_object) for _ in range(8)]
    won, refused = [], []
    start = threading.Barrier(len(takers))

    def take(taker) -> None:
        start.wait()
        try:
            taker.acquire()
            won.append(taker)
        except RootLockedError:
            refused.append(taker)

    threads = [threading.Thread(target=take, args=(t,)) for t in takers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1 and len(refused) == 7
    assert lease_object.record()["holder"] == won[0].token
    won[0].release()


@pytest.fixture
def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_holder_on_this_host_whose_process_is_gone_is_taken_over_at_once(dead_pid):
    me = this_process()
    if me["start"] is None:
        pytest.skip("no /proc: holders are never judged from here")
    lease_object = MemoryLeaseObject()
    plant(lease_object, **{**me, "pid": dead_pid})
    taker = lease(lease_object)
    taker.acquire()  # a young lease, but its process is gone
    assert lease_object.record()["holder"] == taker.token
    taker.release()


def test_a_reused_pid_is_not_taken_for_the_holder():
    me = this_process()
    if me["start"] is None:
        pytest.skip("no /proc: holders are never judged from here")
    parent = {**me, "pid": os.getppid()}
    parent["start"] = int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[19])
    assert holder_status(parent) == "running here"
    lease_object = MemoryLeaseObject()
    plant(lease_object, **parent)
    with pytest.raises(RootLockedError, match=f"pid {os.getppid()}"):
        lease(lease_object).acquire()  # alive here: refused without waiting
    # The same pid with another start time: the holder is gone, the pid names another.
    plant(lease_object, **{**parent, "start": parent["start"] + 1})
    taker = lease(lease_object)
    taker.acquire()
    taker.release()


def test_a_holder_elsewhere_that_stopped_renewing_is_waited_for_then_taken_over(caplog):
    lease_object = MemoryLeaseObject()
    plant(lease_object, host="another-host", pid=4242, start=1)
    taker = lease(lease_object)
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        taker.acquire()  # written just now: watched for a lease length, not refused
    assert lease_object.record()["holder"] == taker.token
    assert "host another-host, pid 4242" in caplog.text
    assert "waiting up to" in caplog.text and "took over the root lease" in caplog.text
    taker.release()


def test_a_holder_elsewhere_that_keeps_renewing_is_refused():
    lease_object = MemoryLeaseObject()
    # A long lease: a renewer starved by a loaded machine is still seen renewing.
    holder = {"host": "another-host", "pid": 4242, "start": 1, "lease_s": 30.0}
    plant(lease_object, **holder)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(HEARTBEAT_S):
            plant(lease_object, **holder)

    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        with pytest.raises(RootLockedError, match="pid 4242.*renewed while this job waited"):
            lease(lease_object).acquire()
    finally:
        stop.set()
        renewer.join()
    assert lease_object.record()["holder"] == "planted"


def test_an_expired_lease_is_taken_over_without_waiting():
    lease_object = MemoryLeaseObject()
    plant(lease_object, host="another-host", pid=4242, start=1, lease_s=0.01)
    time.sleep(0.05)  # the planted lease's length passes
    taker = lease(lease_object)
    taker.acquire()
    assert lease_object.record()["holder"] == taker.token
    taker.release()


def test_a_lease_is_created_renewed_by_its_heartbeat_and_deleted_on_release():
    lease_object = MemoryLeaseObject()
    holder = lease(lease_object)
    holder.acquire()
    assert lease_object.record()["holder"] == holder.token
    first = lease_object.version
    deadline = time.monotonic() + 60  # two renewals, however slowly a loaded machine runs
    while lease_object.version < first + 2:  # each a write conditional on the last one
        assert time.monotonic() < deadline, "the lease was never renewed"
        time.sleep(0.02)
    assert lease_object.record()["holder"] == holder.token and not holder.lost
    holder.release()
    assert lease_object.body is None  # given up: a delete conditional on our version
    holder.release()  # idempotent
    again = lease(lease_object)
    again.acquire()  # free at once
    assert lease_object.record()["holder"] == again.token
    again.release()


def test_a_lease_renewed_by_its_heartbeat_keeps_a_taker_elsewhere_out(monkeypatch):
    """A holder whose process cannot be checked from here is refused only because it keeps
    renewing: the taker watching it sees the heartbeat's new version and gives up. (A long
    lease: a heartbeat starved by a loaded machine is still seen renewing.)"""
    lease_object = MemoryLeaseObject()
    elsewhere = {**this_process(), "host": "another-host", "pid": 4242}
    # The holder's records (its renewals too) name another host; the taker judges them with
    # lease_holder's view of this process, which the patch leaves alone.
    monkeypatch.setattr("jaxckpt.storage.lease.this_process", lambda: elsewhere)
    holder = ObjectLease(lease_object, lease_s=30.0, heartbeat_s=HEARTBEAT_S)
    holder.acquire()
    try:
        with pytest.raises(RootLockedError, match="pid 4242.*renewed while this job waited"):
            lease(lease_object).acquire()
        assert lease_object.record()["holder"] == holder.token and not holder.lost
    finally:
        holder.release()
    assert lease_object.body is None


class GatedLeaseObject(MemoryLeaseObject):
    """A ``MemoryLeaseObject`` whose first ``parties`` replaces wait for each other, so that
    every taker of an expired lease asks to replace the same version."""

    def __init__(self, parties: int):
        super().__init__()
        self.gate = threading.Barrier(parties, timeout=60)
        self.gated = itertools.count()

    def replace(self, body, version):
        if next(self.gated) < self.gate.parties:  # the takers' replaces, not later renewals
            self.gate.wait()
        return super().replace(body, version)


def test_takers_of_an_expired_lease_replace_the_same_version_and_exactly_one_wins():
    takers = 8
    lease_object = GatedLeaseObject(takers)
    plant(lease_object, host="another-host", pid=4242, start=1, lease_s=0.01)
    time.sleep(0.05)  # the planted lease's length passes
    planted = str(lease_object.version)
    leases = [lease(lease_object) for _ in range(takers)]
    won, refused = [], []

    def take(taker) -> None:
        try:
            taker.acquire()
            won.append(taker)
        except RootLockedError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=take, args=(t,)) for t in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert len(won) == 1 and len(refused) == takers - 1, refused
        assert all("another job took it over just now" in message for message in refused)
        assert lease_object.record()["holder"] == won[0].token
        assert str(lease_object.version) != planted
    finally:
        for taker in won:
            taker.release()


class RenewedAfterReadLeaseObject(MemoryLeaseObject):
    """A ``MemoryLeaseObject`` whose holder (of a lease lasting 0.01 s) renews it right after
    each of the taker's first ``renewals`` reads, and whose server clock says each state
    read was written a second ago: every read sees the lease expired, and every state read
    is stale by the time the taker acts on it."""

    holder = {"host": "another-host", "pid": 4242, "start": 1, "lease_s": 0.01}

    def __init__(self, renewals: int):
        super().__init__()
        self.renewals = renewals

    def read(self):
        state = super().read()
        if self.renewals:
            self.renewals -= 1
            plant(self, **self.holder)
        return None if state is None else LeaseState(
            version=state.version, body=state.body, age_s=state.age_s + 1.0)


def test_a_lease_renewed_between_the_takers_read_and_its_takeover_is_not_taken():
    # Two renewals: after the read that decides the lease is free, whether or not a read
    # comes before it; the takeover names the version read, which is gone by then.
    lease_object = RenewedAfterReadLeaseObject(renewals=2)
    plant(lease_object, **lease_object.holder)
    with pytest.raises(RootLockedError, match="pid 4242.*another job took it over just now"):
        lease(lease_object).acquire()
    assert lease_object.record()["holder"] == "planted"
