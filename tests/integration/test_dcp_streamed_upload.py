"""A DCP data file goes up to an object store while DCP is still writing it.

The writer used to gather each data file in memory and upload it only once DCP closed it:
serialising and uploading never overlapped, and a rank's whole file sat in memory. Now
(``torch_bridge.dcp.upload`` over ``Storage.open_writer``; on S3 ``jaxckpt.storage.s3.upload``)
its parts are sent while DCP serialises the next tensors, a bounded number at a time, and
the object still appears only complete. Against a moto server on 127.0.0.1.
"""

from __future__ import annotations

import threading
import uuid

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
torch = pytest.importorskip("torch")

from jaxckpt.core.checksum import default_algorithm  # noqa: E402
from jaxckpt.storage.url import parse_root  # noqa: E402
from torch_bridge import DcpBackend  # noqa: E402

from support.s3_server import moto_s3  # noqa: E402

BUCKET = "jaxckpt-stream"
MIB = 1 << 20
PART = 5 * MIB  # S3's smallest part: small tests, several parts


@pytest.fixture(scope="module")
def options():
    with moto_s3(BUCKET) as opts:
        yield opts


@pytest.fixture
def storage(options):
    _, found = parse_root(f"s3://{BUCKET}/runs/{uuid.uuid4().hex}", options)
    return found


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr("jaxckpt.storage.s3.upload.STREAM_PART_BYTES", PART)


def calls_of(storage) -> list[str]:
    calls: list[str] = []
    storage.client.meta.events.register("before-call.s3.*",
                                        lambda model, **_: calls.append(model.name))
    return calls


def unfinished_uploads(storage) -> list[str]:
    response = storage.client.list_multipart_uploads(Bucket=BUCKET,
                                                     Prefix=storage.key(storage.url()))
    return [upload["Key"] for upload in response.get("Uploads", ())]


def test_a_big_dcp_file_is_sent_while_dcp_still_writes_it(storage, small_parts,
                                                           monkeypatch):
    # Four 4 MiB tensors make one 16 MiB data file. Before DCP serialises the last one, a
    # part of the file must already be on its way: the writer that uploaded the file
    # whole on close never got there (the wait below then runs out, and the check fails).
    state = {f"t{i}": torch.randn(MIB, generator=torch.Generator().manual_seed(i))
             for i in range(4)}
    part_started = threading.Event()
    storage.client.meta.events.register("before-call.s3.UploadPart",
                                        lambda **_: part_started.set())
    seen_before_last: list[bool] = []
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, torch.Tensor) and obj.numel() == MIB:
            if len(seen_before_last) == 3:  # the last tensor of the file
                seen_before_last.append(part_started.wait(timeout=20))
            else:
                seen_before_last.append(part_started.is_set())
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    backend = DcpBackend()
    backend.attach_storage(storage)
    directory = storage.url(f"{storage.prefix}/state")
    try:
        handle = backend.write(directory, state, asynchronous=False)
        handle.wait()
        assert seen_before_last[-1], "no part was sent before DCP wrote its last tensor"
        data = f"{directory}/__0_0.distcp"
        algorithm = default_algorithm()
        size, checksum = storage.checksum(data, algorithm)
        # The entry the commit takes was computed from the bytes as they went up.
        assert handle.checksums["__0_0.distcp"] == {"size": size, algorithm: checksum}
        assert size > 3 * PART
        assert unfinished_uploads(storage) == []
        monkeypatch.setattr(torch, "save", real_save)
        like = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
        backend.read(directory, like)
        assert all(torch.equal(like[name], state[name]) for name in state)
    finally:
        backend.close()


def test_a_streamed_upload_keeps_at_most_its_threads_parts_in_flight(storage):
    from jaxckpt.storage.s3.upload import StreamingUpload

    in_flight = peak = 0
    lock = threading.Lock()
    real_upload_part = storage.client.upload_part

    def upload_part(**kwargs):
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        try:
            threading.Event().wait(0.2)  # a slow server: the writer outruns the parts
            return real_upload_part(**kwargs)
        finally:
            with lock:
                in_flight -= 1

    storage.client.upload_part = upload_part
    path = storage.url(f"{storage.prefix}/big")
    payload = bytes(range(256)) * (26 * MIB // 256)  # 6 parts of 5 MiB, the last short
    upload = StreamingUpload(storage, path, first_part=PART, threads=2)
    calls = calls_of(storage)
    for start in range(0, len(payload), 3 * MIB):  # writes that straddle the parts
        upload.write(memoryview(payload)[start:start + 3 * MIB])
        assert storage.exists(path) is False  # nothing visible before close
    upload.close()
    assert peak == 2, peak  # both threads used, never a third part held
    assert calls.count("UploadPart") == 6
    assert storage.read(path) == payload


def test_an_object_of_one_part_or_less_is_one_put(storage):
    path = storage.url(f"{storage.prefix}/one")
    calls = calls_of(storage)
    writer = storage.open_writer(path)
    payload = b"x" * (16 * MIB)  # exactly the first part's size: no part follows
    writer.write(payload[:MIB])
    writer.write(payload[MIB:])
    writer.close()
    assert calls == ["PutObject"]
    assert storage.read(path) == payload


def test_an_aborted_or_failed_streamed_upload_stores_nothing(storage, small_parts):
    path = storage.url(f"{storage.prefix}/aborted")
    writer = storage.open_writer(path)
    writer.write(b"a" * (12 * MIB))  # two parts sent or on their way
    writer.abort()
    assert not storage.exists(path)
    assert unfinished_uploads(storage) == []

    # A writer that never closes (its process killed) leaves no object, only an unfinished
    # upload, which the next primary's start-up discards.
    path = storage.url(f"{storage.prefix}/killed")
    writer = storage.open_writer(path)
    writer.write(b"k" * (12 * MIB))
    writer._finish_pool()  # the parts that were sent have landed
    assert not storage.exists(path)
    assert storage.discard_incomplete_uploads(storage.url()) == [path]
    assert unfinished_uploads(storage) == []

    real_upload_part = storage.client.upload_part

    def failing(**kwargs):
        if kwargs["PartNumber"] == 2:
            raise OSError("connection dropped for good")
        return real_upload_part(**kwargs)

    storage.client.upload_part = failing
    path = storage.url(f"{storage.prefix}/failed")
    writer = storage.open_writer(path)
    with pytest.raises(OSError, match="dropped"):
        writer.write(b"b" * (12 * MIB))
        writer.close()
    assert not storage.exists(path)
    assert unfinished_uploads(storage) == []


def test_a_dcp_stream_left_on_an_error_stores_nothing(storage, small_parts):
    from torch_bridge.dcp.upload import UploadStream

    path = storage.url(f"{storage.prefix}/state/__0_0.distcp")
    written: dict = {}
    with pytest.raises(RuntimeError, match="serialising failed"):
        with UploadStream(storage, path, written) as stream:
            stream.write(b"c" * (7 * MIB))
            raise RuntimeError("serialising failed")
    assert written == {}
    assert not storage.exists(path)
    assert unfinished_uploads(storage) == []
