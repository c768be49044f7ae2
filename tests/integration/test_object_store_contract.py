"""What every object store keeps, written once and run against each (``support.object_stores``:
a moto S3 server, the GCS emulator behind its precondition proxy, both on 127.0.0.1): the
Storage contract (tests/support/storage_contract.py), create-only decided by the server
(exactly one of many racing creators wins), the root lease (a killed holder's taken over at
once, exactly one of several takers of an expired one wins) and bounded retries of
transient server errors. What only one store has stays in test_s3_storage.py and
test_gcs_storage.py."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from jaxckpt import RootLockedError

from support import storage_contract
from support.object_stores import KINDS, fault_proxy_before, object_store

BUCKET = "jaxckpt-contract"
# Leases of a few seconds keep the tests short; the margin between a heartbeat (0.5 s) and
# the lease (3 s) absorbs a loaded machine's pauses.
SHORT_LEASE = {"lease_s": 3.0, "heartbeat_s": 0.5}
#: Racing creators and takers per store (the GCS emulator is slower to answer many at once).
CREATORS = {"s3": 16, "gs": 12}
TAKERS = {"s3": 8, "gs": 6}

pytestmark = pytest.mark.skipif(not KINDS, reason="no object-store client and server installed")


@pytest.fixture(scope="module", params=KINDS)
def store(request):
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    with object_store(request.param, BUCKET) as running:
        yield running


@pytest.fixture
def options(store):
    return {**store.storage_options, **SHORT_LEASE}


@pytest.fixture
def base(store):
    return store.url(f"runs/{uuid.uuid4().hex}")


@pytest.fixture
def storage(store, base):
    return store.storage(base, **SHORT_LEASE)


def spawn_source(options, base) -> str:
    return ("from jaxckpt.storage.url import parse_root\n"
            f"storage = parse_root({base!r}, {options!r})[1]")


@pytest.mark.parametrize("check", storage_contract.CHECKS, ids=lambda check: check.__name__)
def test_contract(check, storage, base):
    check(storage, base)


def test_contract_lock(storage, base, options):
    storage_contract.check_lock_excludes_a_second_holder(storage, base,
                                                         spawn_source(options, base))


def test_create_only_race_has_exactly_one_winner(store, storage, base):
    path = f"{base}/COMMITTED"
    count = CREATORS[store.kind]
    outcomes: list[str] = []
    start = threading.Barrier(count)

    def create(index: int) -> None:
        start.wait()
        try:
            storage.create(path, f"writer {index}".encode())
            outcomes.append(f"won {index}")
        except FileExistsError:
            outcomes.append("refused")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(outcomes) == count and len(winners) == 1
    assert storage.read(path) == f"writer {winners[0].split()[1]}".encode()


def test_the_lease_of_a_killed_holder_on_this_host_is_taken_over_at_once(storage, base, options,
                                                                        caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", spawn_source(options, base) + "\n"
         f"lease = storage.lock_root({base!r})\nprint('held', flush=True)\n"
         "import time\ntime.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RootLockedError, match=f"pid {holder.pid}"):
            storage.lock_root(base)  # alive: refused
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        # Renewed under a heartbeat ago, but its process is gone: taken over without waiting.
        with caplog.at_level(logging.WARNING, logger="jaxckpt"):
            lease = storage.lock_root(base)
        assert "its process on this host is gone" in caplog.text
        assert "waiting up to" not in caplog.text
        lease.release()
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(timeout=30)


def test_two_takers_of_an_expired_lease_exactly_one_wins(store, storage, base):
    # A lease left by a holder that stopped renewing 1 s-leases.
    storage.write(f"{base}/.lock",
                  b'{"holder": "dead", "host": "gone", "pid": 1, "lease_s": 1}')
    time.sleep(2.5)
    count = TAKERS[store.kind]
    won, refused = [], []
    start = threading.Barrier(count)

    def take() -> None:
        start.wait()
        try:
            won.append(storage.lock_root(base))
        except RootLockedError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=take) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert len(won) == 1 and len(refused) == count - 1
    finally:
        for lease in won:
            lease.release()


def test_transient_server_errors_are_retried_a_bounded_number_of_times(store, base):
    attempts = 4
    marker = f"{base}/COMMITTED"
    with fault_proxy_before(store) as proxy:  # no random faults: only fail_next
        flaky = store.storage(base, endpoint_url=proxy.url, max_attempts=attempts)
        flaky.write(f"{base}/warm-up", b"")  # the client's first look at the bucket, uncounted

        def fail_next(count: int) -> int:
            proxy.counts = dict.fromkeys(proxy.counts, 0)
            proxy.fail_next = count
            return len(proxy.requests)

        def reads_of_the_marker(since: int) -> int:
            # A GET names its object in the path (an upload may carry the name in its body).
            return sum(method == "GET" and "COMMITTED" in path
                       for method, path, _ in proxy.requests[since:])

        # Every 503 is served and the request still succeeds. (Rarely, under load, the GCS
        # client sends a request of its own in between that takes one of the 503s.)
        fail_next(3)
        flaky.create(marker, b"m")
        assert proxy.counts["unavailable"] == 3 and proxy.counts["forwarded"] >= 1, proxy.counts
        since = fail_next(2)
        assert flaky.read(marker) == b"m"
        assert proxy.counts["unavailable"] == 2, proxy.counts
        assert reads_of_the_marker(since) <= 3
        since = fail_next(-1)  # the server never recovers: give up
        with pytest.raises(Exception, match="503|ServiceUnavailable|reached max retries"):
            flaky.read(marker)
        assert reads_of_the_marker(since) == attempts  # max_attempts tries, then the error
