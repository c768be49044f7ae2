"""ReadAhead (jaxckpt/commit/prefetch.py): whole objects fetched before their reader asks, with
their checksum computed from the pieces as they land, handed over once, and dropped when
cancelled. A storage double stands in for the object store."""

from __future__ import annotations

import os
import threading

from jaxckpt.commit.deferred_checks import DeferredChecks
from jaxckpt.commit.prefetch import ReadAhead
from jaxckpt.core.checksum import default_algorithm, extend

ALGORITHM = default_algorithm()
PIECE = 1000


class _PiecesStorage:
    """Objects by path; ``read_into`` reports progress every ``PIECE`` bytes, and may be
    held before its second piece until ``release`` is set."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects
        self.asked: list[tuple[str, int]] = []
        self.hold = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()

    def read_into(self, path, out, *, offset=0, progress=None):
        self.asked.append((path, len(out)))
        data = self.objects[path][offset:offset + len(out)]
        for start in range(0, len(data), PIECE):
            if start and self.hold.is_set():
                self.holding.set()
                self.release.wait(timeout=30)
            end = min(len(data), start + PIECE)
            out[start:end] = data[start:end]
            if progress is not None:
                progress(end)
        return len(data)


def _entry(data: bytes) -> dict:
    return {"size": len(data), ALGORITHM: f"{extend(ALGORITHM, 0, data):08x}"}


def test_a_fetched_object_comes_with_the_checksum_of_its_pieces_and_is_taken_once():
    data = os.urandom(3500)
    storage = _PiecesStorage({"s3://b/x/a": data})
    ahead = ReadAhead(storage)
    ahead.start([("s3://b/x/a", _entry(data))])
    view, crc = ahead.take("s3://b/x/a")
    assert bytes(view) == data
    assert crc == _entry(data)[ALGORITHM]
    assert storage.asked == [("s3://b/x/a", len(data) + 1)]  # one more: a longer object shows
    assert ahead.take("s3://b/x/a") is None  # handed over once
    assert ahead.take("s3://b/x/other") is None  # never started


def test_an_object_longer_than_its_manifest_entry_fails_its_checksum():
    data = os.urandom(2000)
    storage = _PiecesStorage({"p": data + b"!"})
    ahead = ReadAhead(storage)
    ahead.start([("p", _entry(data))])
    view, crc = ahead.take("p")
    assert bytes(view) == data + b"!" and crc != _entry(data)[ALGORITHM]


def test_a_failed_fetch_hands_over_nothing_so_the_reader_fetches_and_meets_the_error():
    ahead = ReadAhead(_PiecesStorage({}))  # KeyError inside read_into
    ahead.start([("missing", {"size": 10, ALGORITHM: "00000000"})])
    assert ahead.take("missing") is None


def test_cancel_stops_a_running_fetch_and_drops_it_and_start_replaces_the_last_candidate():
    data = os.urandom(5000)
    storage = _PiecesStorage({"old": data, "new": data})
    storage.hold.set()
    ahead = ReadAhead(storage)
    ahead.start([("old", _entry(data))])
    assert storage.holding.wait(timeout=30)  # the first piece is in, the fetch runs on
    ahead.start([("new", _entry(data))])  # the next candidate: "old" is cancelled
    storage.hold.clear()
    storage.release.set()
    assert ahead.take("old") is None
    assert bytes(ahead.take("new")[0]) == data
    ahead.start([("new", _entry(data))])
    ahead.cancel()
    assert ahead.take("new") is None


def test_claims_hand_over_what_was_fetched_ahead_under_the_claimed_name():
    data = os.urandom(1500)
    storage = _PiecesStorage({"s3://b/run/step/state/d": data})
    ahead = ReadAhead(storage)
    ahead.start([("s3://b/run/step/state/d", _entry(data))])
    claims = DeferredChecks(ahead)
    claims.offer("s3://b/run/step", [("state/d", _entry(data))])
    assert claims.claim("s3://b/run/step/state/d") == (ALGORITHM, _entry(data)[ALGORITHM])
    view, crc = claims.fetched("s3://b/run/step/state/d")
    assert bytes(view) == data and crc == _entry(data)[ALGORITHM]
    assert DeferredChecks().fetched("s3://b/run/step/state/d") is None
