"""DcpCheckpointManager on object storage: s3:// against a moto server and gs:// against a
GCS emulator, both started by this module on 127.0.0.1 (tests/support/s3_server.py,
gcs_server.py). Model, optimizer, scheduler and a stateful loader round-trip bit-exact in
sync and async mode, in the layout a local root has, with nothing created locally, no
server-side copy and no DCP file read back by the commit; a partial restore fetches only the
bytes of what it loads; a planted ``.metadata`` pickle is refused, never run; the bench's
object-store rows run and clean up after themselves."""

from __future__ import annotations

import os
import pickle
import threading
import uuid

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from jaxckpt import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointWarning,
    CheckpointWriteError,
    Every,
    RecoverConfig,
    StepInfo,
)
from jaxckpt.commit.store import CheckpointStore  # noqa: E402
from jaxckpt.core.layout import COMMIT_MARKER  # noqa: E402
from jaxckpt.storage.s3 import storage as s3_storage  # noqa: E402
from jaxckpt.storage.url import parse_root  # noqa: E402
from torch_bridge import DcpBackend, DcpCheckpointManager  # noqa: E402

from support.s3_server import moto_s3  # noqa: E402

BUCKET = "jaxckpt-dcp"
LEASE = {"lease_s": 3.0, "heartbeat_s": 0.5}
STEP = StepInfo(0, 3, 3, 12)


@pytest.fixture(scope="module")
def options():
    with moto_s3(BUCKET) as opts:
        yield {**opts, **LEASE}


@pytest.fixture
def root():
    return f"s3://{BUCKET}/runs/{uuid.uuid4().hex}"


def training(seed: int = 0):
    """(state, loader) after 3 steps of a small run: Adam moments, a stepped scheduler, a
    shuffling loader part-way through its epoch."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = torch.randn(48, 6, generator=torch.Generator().manual_seed(1))
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True,
                                generator=torch.Generator().manual_seed(seed + 2))
    batches = iter(loader)
    for _ in range(3):
        optimizer.zero_grad()
        model(next(batches)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}, loader, batches


def tensors_of(state) -> dict[str, bytes]:
    """Every tensor and value of the state as bytes, by name (bit-exact comparison)."""
    out = {}
    for key, value in state["model"].state_dict().items():
        out[f"model/{key}"] = value.numpy().tobytes()
    for index, moments in state["optimizer"].state_dict()["state"].items():
        for key, value in moments.items():
            out[f"optimizer/{index}/{key}"] = value.numpy().tobytes()
    out["scheduler"] = repr(sorted(state["scheduler"].state_dict().items())).encode()
    return out


def keys_under(storage, url: str) -> set[str]:
    return set(storage.list_files(url))


def manager(root, options, **kwargs):
    return DcpCheckpointManager(root, recover=RecoverConfig(every=Every(steps=1)),
                                storage_options=options, preemption_signals=(), **kwargs)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_round_trip_on_s3_is_bit_exact_in_the_local_layout(options, root, mode, tmp_path,
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    copies: list[tuple[str, str]] = []
    real_copy = s3_storage.S3Storage.copy
    monkeypatch.setattr(s3_storage.S3Storage, "copy", lambda self, src, dst:
                        copies.append((src, dst)) or real_copy(self, src, dst))
    summed: list[str] = []  # files the commit reads back to checksum them
    real_checksum = s3_storage.S3Storage.checksum
    monkeypatch.setattr(s3_storage.S3Storage, "checksum", lambda self, path, *a, **kw:
                        summed.append(path) or real_checksum(self, path, *a, **kw))
    state, loader, batches = training()
    saved = tensors_of(state)
    with manager(root, options, mode=mode) as mgr:
        mgr.save(STEP, state, stateful={"loader": loader})
        mgr.wait()
        # The commit took the checksums of the bytes uploaded: no file of the backend's,
        # DCP's, objects.json nor driver.json (the manager's own bytes) was read back.
        assert summed == []
        # The seam is the right one: verification reads every file back through it.
        assert mgr.store.verify(mgr.store.step_path(STEP.global_step)) == []
        assert any(path.endswith(".distcp") for path in summed), summed
    expected_next = [next(batches) for _ in range(2)]

    fresh, fresh_loader, _ = training(seed=5)
    assert tensors_of(fresh) != saved
    with manager(root, options) as mgr:
        recovered = mgr.recover(fresh, stateful={"loader": fresh_loader})
    assert recovered.step_info == STEP
    assert tensors_of(fresh) == saved
    resumed = iter(fresh_loader)
    assert all(torch.equal(next(resumed), batch) for batch in expected_next)

    _, storage = parse_root(root, options)
    step = f"{root}/recover/step_00000003"
    assert keys_under(storage, f"{step}/state") == {"objects.json", ".metadata",
                                                    "__0_0.distcp"}
    assert {COMMIT_MARKER, "driver.json"} <= keys_under(storage, step)
    assert not any(".tmp" in key for key in keys_under(storage, root))
    assert copies == []  # .metadata is put once at its name: no copy+delete "rename"
    assert os.listdir(tmp_path) == []  # nothing local


def test_partial_restore_on_s3_fetches_only_the_bytes_it_loads(options, root, monkeypatch):
    state, _, _ = training()
    big = torch.randn(1_000_000)  # 4 MB that a model-only restore must not fetch
    with manager(root, options, mode="sync") as mgr:
        mgr.save(STEP, {**state, "big": big})
    fetched: list[int] = []
    real_read = s3_storage.S3Storage.read
    real_read_into = s3_storage.S3Storage.read_into

    def counting_read(self, path, *, offset=0, length=None):
        data = real_read(self, path, offset=offset, length=length)
        if path.endswith(".distcp"):
            fetched.append(len(data))
        return data

    def counting_read_into(self, path, out, *, offset=0):
        count = real_read_into(self, path, out, offset=offset)
        if path.endswith(".distcp"):
            fetched.append(count)
        return count

    fresh, _, _ = training(seed=5)
    _, storage = parse_root(root, options)
    backend = DcpBackend()
    backend.attach_storage(storage)
    monkeypatch.setattr(s3_storage.S3Storage, "read", counting_read)
    monkeypatch.setattr(s3_storage.S3Storage, "read_into", counting_read_into)
    try:
        backend.read(f"{root}/recover/step_00000003/state", {"model": fresh["model"]},
                     partial=True)
    finally:
        backend.close()
    assert all(torch.equal(a, b) for a, b in zip(fresh["model"].state_dict().values(),
                                                  state["model"].state_dict().values(),
                                                  strict=True))
    assert 0 < sum(fetched) < 1_000_000, fetched  # the model's bytes, not the 4 MB tensor

    # Through the manager too: the model loads, the optimizer and the big tensor stay unread.
    other, _, _ = training(seed=7)
    before = other["optimizer"].state_dict()["state"][0]["exp_avg"].clone()
    with manager(root, options) as mgr:
        mgr.restore({"model": other["model"]}, partial=True)
    assert tensors_of(other)["model/2.bias"] == tensors_of(state)["model/2.bias"]
    assert torch.equal(other["optimizer"].state_dict()["state"][0]["exp_avg"], before)


def counting_gets(monkeypatch) -> dict[str, int]:
    """Bytes fetched from the server per object URL, through S3Storage's read paths (the
    verifier's checksum streams a whole object; the reader's reads, into a buffer or not)."""
    fetched: dict[str, int] = {}
    real_read = s3_storage.S3Storage.read
    real_read_into = s3_storage.S3Storage.read_into
    real_checksum = s3_storage.S3Storage.checksum

    def read(self, path, *, offset=0, length=None):
        data = real_read(self, path, offset=offset, length=length)
        fetched[path] = fetched.get(path, 0) + len(data)
        return data

    def read_into(self, path, out, **kwargs):
        count = real_read_into(self, path, out, **kwargs)
        fetched[path] = fetched.get(path, 0) + count
        return count

    def checksum(self, path, algorithm, *, sync=False):
        size, value = real_checksum(self, path, algorithm, sync=sync)
        fetched[path] = fetched.get(path, 0) + size
        return size, value

    monkeypatch.setattr(s3_storage.S3Storage, "read", read)
    monkeypatch.setattr(s3_storage.S3Storage, "read_into", read_into)
    monkeypatch.setattr(s3_storage.S3Storage, "checksum", checksum)
    return fetched


def test_a_server_that_ignores_conditional_writes_is_refused_by_the_dcp_manager_too(
        options, root):
    """The DCP manager opens its root as CheckpointManager does: a server that overwrites
    on a create-only PUT (the fault proxy strips the conditions) is refused, nothing is
    written; the opt-in opens it with a warning and the round trip holds."""
    from jaxckpt.errors import ConditionalWritesError

    from support.fault_proxy import CONDITIONS, FaultProxy

    proxy = FaultProxy(options["endpoint_url"])
    proxy.ignore_conditions = CONDITIONS
    through = {**options, "endpoint_url": proxy.url}
    try:
        with pytest.raises(ConditionalWritesError, match="unsafe_skip_check"):
            DcpCheckpointManager(root, storage_options=through, preemption_signals=())
        assert parse_root(root, options)[1].list_files(root) == {}
        state, _, _ = training()
        with pytest.warns(CheckpointWarning, match="on your honour"):
            with DcpCheckpointManager(root, storage_options={
                    **through, "conditional_writes": "unsafe_skip_check"},
                    preemption_signals=()) as mgr:
                mgr.save(STEP, state)
                fresh, _, _ = training(seed=5)
                mgr.restore(fresh)
        assert tensors_of(fresh) == tensors_of(state)
    finally:
        proxy.close()


def test_a_save_to_s3_sends_one_put_per_file_and_nothing_else(options, root):
    # No listing to refuse a filled prefix (objects.json is put create-only instead), no
    # HEAD for DCP's "overwrite?" warning, and every file's checksum known from its upload.
    state, _, _ = training()
    _, storage = parse_root(root, options)
    calls: list[str] = []
    storage.client.meta.events.register("before-call.s3.*",
                                        lambda model, **_: calls.append(model.name))
    backend = DcpBackend()
    backend.attach_storage(storage)
    try:
        handle = backend.write(f"{root}/state", state, asynchronous=False)
        handle.wait()
        assert sorted(calls) == ["PutObject"] * 3, calls  # objects.json, the data, .metadata
        assert set(handle.checksums) == {"objects.json", ".metadata", "__0_0.distcp"}
        # A filled prefix is still refused (an identical objects.json would pass as a
        # retry of the same put; the manager never writes into a filled prefix).
        with pytest.raises(CheckpointWriteError, match="already exists"):
            backend.write(f"{root}/state", {"model": state["model"]}, asynchronous=False)
    finally:
        backend.close()


def test_a_restore_from_s3_fetches_each_data_byte_once(options, root, monkeypatch):
    # The data file used to come down twice: whole for its checksum before the read (DCP
    # loads into live modules), then its ranges for DCP. Now the reader fetches it once,
    # checks it, and only then lets DCP copy from those bytes.
    state, _, _ = training()
    big = torch.randn(600_000)  # 2.4 MB: over the size whose checksum may wait for the read
    with manager(root, options, mode="sync") as mgr:
        mgr.save(STEP, {**state, "big": big})
    _, storage = parse_root(root, options)
    data = f"{root}/recover/step_00000003/state/__0_0.distcp"
    data_size = storage.size(data)
    fresh, _, _ = training(seed=5)
    like = {**fresh, "big": torch.zeros_like(big)}
    fetched = counting_gets(monkeypatch)
    with manager(root, options) as mgr:
        mgr.restore(like)
    assert torch.equal(like["big"], big)
    assert tensors_of(fresh) == tensors_of(state)
    assert fetched[data] == data_size, (fetched, data_size)


def test_a_restore_from_s3_streams_each_data_file_into_one_buffer_and_skips_torch_load(
        options, root, monkeypatch):
    # Each data file comes down by one GET streamed into one buffer (no body object read
    # whole and joined), and each record's raw bytes go from there into the live tensor: no
    # unpickler, no intermediate tensor; a partial restore (ranged fetches, no claims) too.
    state, _, _ = training()
    big = torch.randn(600_000)
    with manager(root, options, mode="sync") as mgr:
        mgr.save(STEP, {**state, "big": big})
    fresh, _, _ = training(seed=5)
    like = {**fresh, "big": torch.zeros_like(big)}
    model_only = training(seed=6)[0]["model"]
    loads: list[object] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    requests: list[tuple[str, str]] = []
    real_read, real_read_into = s3_storage.S3Storage.read, s3_storage.S3Storage.read_into

    def read(self, path, **kwargs):
        requests.append(("read", path.rsplit("/", 1)[-1]))
        return real_read(self, path, **kwargs)

    def read_into(self, path, out, **kwargs):
        requests.append(("read_into", path.rsplit("/", 1)[-1]))
        return real_read_into(self, path, out, **kwargs)

    monkeypatch.setattr(s3_storage.S3Storage, "read", read)
    monkeypatch.setattr(s3_storage.S3Storage, "read_into", read_into)
    with manager(root, options) as mgr:
        mgr.restore(like)
        whole = [request for request in requests if request[1].endswith(".distcp")]
        mgr.restore({"model": model_only}, partial=True)
    assert whole == [("read_into", "__0_0.distcp")]
    assert loads == []
    assert torch.equal(like["big"], big) and tensors_of(fresh) == tensors_of(state)
    assert all(torch.equal(model_only.state_dict()[key], value)
               for key, value in state["model"].state_dict().items())


def test_a_restore_from_s3_asks_for_the_data_before_checking_the_small_files(
        options, root, monkeypatch):
    # The manifest names the data file and its size, so its GET goes out as soon as the
    # manifest is read; the verification's listing and small GETs and DCP's parsing run
    # while the data comes down (they used to come first, then the data GET). Here the
    # verification's GET of driver.json waits (up to 20 s) for the data to have been asked
    # for: in the old order it never was by then. The data's checksum is computed as its
    # pieces land (never over the whole file once it is in), still before DCP loads it.
    from jaxckpt.commit import prefetch as read_ahead
    from jaxckpt.core import checksum
    from torch_bridge.dcp import files as dcp_files

    state, _, _ = training()
    big = torch.randn(1_600_000)  # 6.4 MB: more than one progress piece
    with manager(root, options, mode="sync") as mgr:
        mgr.save(STEP, {**state, "big": big})
    asked = threading.Event()
    waited: list[bool] = []
    summed: list[int] = []
    real_read_into, real_checksum = s3_storage.S3Storage.read_into, s3_storage.S3Storage.checksum

    def read_into(self, path, out, **kwargs):
        if path.endswith(".distcp"):
            asked.set()
        return real_read_into(self, path, out, **kwargs)

    def checksum_of(self, path, algorithm, **kwargs):
        if path.endswith("/driver.json"):
            waited.append(asked.wait(timeout=20))
        return real_checksum(self, path, algorithm, **kwargs)

    def extend(algorithm, crc, data):
        summed.append(len(memoryview(data).cast("B")))
        return checksum.extend(algorithm, crc, data)

    monkeypatch.setattr(s3_storage.S3Storage, "read_into", read_into)
    monkeypatch.setattr(s3_storage.S3Storage, "checksum", checksum_of)
    monkeypatch.setattr(read_ahead, "extend", extend)
    monkeypatch.setattr(dcp_files, "extend", extend)
    for how in ("step", "latest"):
        asked.clear()
        fresh, _, _ = training(seed=5)
        like = {**fresh, "big": torch.zeros_like(big)}
        with manager(root, options) as mgr:  # a new manager: nothing kept from the save
            if how == "step":
                mgr.restore(like, step=3)
            else:
                mgr.recover(like)
        assert torch.equal(like["big"], big) and tensors_of(fresh) == tensors_of(state)
    assert waited == [True, True]
    assert summed and max(summed) <= s3_storage._PROGRESS_PIECE, summed


def test_a_restore_from_s3_lets_go_of_the_fetched_data_on_a_thread_of_its_own(
        options, root, monkeypatch):
    # Handing a fetched file's pages back to the system (munmap)
    # happens beside the training thread, not before restore() returns.
    from jaxckpt.commit import prefetch as read_ahead

    big = torch.randn(600_000)
    with manager(root, options, mode="sync") as mgr:
        mgr.save(STEP, {"big": big})
    freed: list[str] = []
    gone = threading.Event()

    class Tracked(bytearray):
        def __del__(self):
            freed.append(threading.current_thread().name)
            gone.set()

    monkeypatch.setattr(read_ahead, "_fresh", lambda nbytes: memoryview(Tracked(nbytes)))
    like = {"big": torch.zeros_like(big)}
    with manager(root, options) as mgr:
        mgr.restore(like)
    assert torch.equal(like["big"], big)
    assert gone.wait(timeout=30)
    assert freed == ["jaxckpt-let-go"], freed


def test_damaged_data_on_s3_leaves_the_live_tensors_untouched_and_recover_falls_back(
        options, root, monkeypatch):
    # The data is checked as it arrives, no longer before the read: the damaged file is
    # refused before DCP copies anything, and the fallback reads its own data once.
    config = RecoverConfig(every=Every(steps=1), keep_last_n=None)
    generator = torch.Generator().manual_seed(0)
    with DcpCheckpointManager(root, recover=config, storage_options=options, mode="sync",
                              preemption_signals=()) as mgr:
        for step in (0, 1):
            mgr.save(StepInfo(0, step, step),
                     {"big": torch.randn(512, 1024, generator=generator)})
    _, storage = parse_root(root, options)
    data = f"{root}/recover/step_00000001/state/__0_0.distcp"
    damaged = bytearray(storage.read(data))
    damaged[len(damaged) // 2] ^= 0x10  # same size: only the checksum can tell
    storage.write(data, bytes(damaged))
    live = torch.zeros(512, 1024)
    with DcpCheckpointManager(root, recover=config, storage_options=options,
                              preemption_signals=()) as mgr:
        with pytest.raises(CheckpointCorruptError, match=r"__0_0.distcp: crc32"):
            mgr.restore({"big": live}, step=1)
        assert torch.count_nonzero(live) == 0
        fetched = counting_gets(monkeypatch)
        with pytest.warns(CheckpointWarning, match=r"step_00000001.*__0_0.distcp: crc32"):
            recovered = mgr.recover({"big": live})
    assert recovered.step_info.global_step == 0 and recovered.state["big"] is live
    good = f"{root}/recover/step_00000000/state/__0_0.distcp"
    assert fetched[good] == storage.size(good), fetched
    expected = torch.randn(512, 1024, generator=torch.Generator().manual_seed(0))
    assert torch.equal(live, expected)


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_metadata_pickle_on_s3_is_refused_never_run(options, root, tmp_path):
    state, _, _ = training()
    with manager(root, options, mode="sync") as mgr:
        mgr.save(STEP, state)
    _, storage = parse_root(root, options)
    step = f"{root}/recover/step_00000003"
    marker = tmp_path / "RAN"
    storage.write(f"{step}/state/.metadata", pickle.dumps(_Payload(str(marker))))
    storage.delete(f"{step}/{COMMIT_MARKER}")
    CheckpointStore(root, storage=storage).commit(step, 3)  # the attacker re-signs it too
    fresh, _, _ = training(seed=5)
    # Refused by the restricted unpickler; DCP wraps the error in its CheckpointException (a
    # BaseException), as for a local root.
    with pytest.raises(BaseException, match="names posix.system, which is not part of a DCP index"):
        with manager(root, options) as mgr:
            mgr.restore(fresh)
    assert not marker.exists(), "restoring executed the pickle planted in .metadata"


def test_round_trip_on_gs_is_bit_exact(tmp_path, monkeypatch):
    pytest.importorskip("google.cloud.storage")
    pytest.importorskip("gcp_storage_emulator")
    from support.gcs_server import PreconditionProxy, emulator

    monkeypatch.chdir(tmp_path)
    state, loader, batches = training()
    saved = tensors_of(state)
    with emulator("jaxckpt-dcp-gs") as endpoint:
        proxy = PreconditionProxy(endpoint)
        try:
            options = {"endpoint_url": proxy.url, **LEASE}
            root = f"gs://jaxckpt-dcp-gs/runs/{uuid.uuid4().hex}"
            with manager(root, options, mode="async") as mgr:
                mgr.save(STEP, state, stateful={"loader": loader})
            expected = next(batches)
            fresh, fresh_loader, _ = training(seed=5)
            with manager(root, options) as mgr:
                assert mgr.recover(fresh, stateful={"loader": fresh_loader}).step_info == STEP
        finally:
            proxy.close()
    assert tensors_of(fresh) == saved
    assert torch.equal(next(iter(fresh_loader)), expected)
    assert os.listdir(tmp_path) == []


def test_the_object_store_bench_compares_with_raw_transfers_and_cleans_up(options, root):
    from jaxckpt.tools.bench.dcp_remote import ROWS, dcp_remote_rows, format_rows

    result = dcp_remote_rows(root, options, nbytes=1 << 20, tensors=4, repeats=1)
    assert set(result["rows"]) == set(ROWS)
    assert all(row["mib_per_s"] > 0 for row in result["rows"].values())
    assert result["save_vs_upload"] > 0 and result["restore_vs_download"] > 0
    assert "save / raw upload" in format_rows(result)
    _, storage = parse_root(root, options)
    assert storage.list_files(root) == {}  # the bench deleted what it wrote


def test_the_object_store_bench_times_the_raw_download_after_the_save_has_ended(
        options, root, monkeypatch):
    # A sync save returns at its marker; its retention lists the root in the background.
    # Those requests must not land inside the raw download's (or the restore's) timing.
    from jaxckpt.tools.bench.dcp_remote import dcp_remote_rows

    events: list[str] = []
    real_wait, real_read = DcpCheckpointManager.wait, s3_storage.S3Storage.read
    monkeypatch.setattr(DcpCheckpointManager, "wait",
                        lambda self: events.append("wait") or real_wait(self))

    def read(self, path, **kwargs):
        if "/raw/" in path:
            events.append("raw download")
        return real_read(self, path, **kwargs)

    monkeypatch.setattr(s3_storage.S3Storage, "read", read)
    result = dcp_remote_rows(root, options, nbytes=1 << 20, tensors=2, repeats=2)
    downloads = [i for i, event in enumerate(events) if event == "raw download"]
    # One warm-up round, then the two counted: the first saves of a process are slower.
    assert len(downloads) == 3 and all(events[i - 1] == "wait" for i in downloads), events
    assert {row["rounds"] for row in result["rows"].values()} == {2}


class _BytesStorage:
    """The two reads dcp_files's fetches use, over one object's bytes."""

    def __init__(self, data: bytes):
        self.data = data

    def read(self, path, *, offset=0, length=None):
        return self.data[offset:] if length is None else self.data[offset:offset + length]

    def read_into(self, path, out, *, offset=0):
        data = self.read(path, offset=offset, length=len(out))
        out[:len(data)] = data
        return len(data)


@pytest.mark.parametrize("actual", [1000, 999, 1001], ids=["exact", "shorter", "longer"])
def test_a_whole_fetch_returns_the_object_as_it_is_whatever_the_metadata_says(actual):
    # The size comes from DCP's metadata; a shorter object comes back short (its checksum
    # then fails), a longer one whole (read again as it is): never bytes it does not hold.
    import concurrent.futures

    from torch_bridge.dcp import files as dcp_files

    data = os.urandom(actual)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fetched = dcp_files._fetch_whole(_BytesStorage(data), pool, "x", 1000)
        pieces = dcp_files._fetch(_BytesStorage(data), pool, "x", 100, 1200, piece=300)
    assert bytes(fetched) == data
    assert bytes(pieces) == data[100:1200]


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc")
def test_a_fetched_data_file_lies_in_memory_not_advised_for_huge_pages():
    # numpy's np.empty advises huge pages from 4 MiB on; on a VM that hands freed memory
    # back to its host those cost several times a 4 KiB page's
    # (benchmarks/results/restore-read-floor_cpu2core_2026-11-25.md). The fetch buffer is one of
    # the restore's own maps.
    import concurrent.futures

    from torch_bridge.dcp import files as dcp_files

    from support.memory import mapping_flags, numpy_huge_page_advice

    data = os.urandom(6 << 20)
    with numpy_huge_page_advice(), concurrent.futures.ThreadPoolExecutor(2) as pool:
        fetched = dcp_files._fetch(_BytesStorage(data), pool, "x", 0, len(data))
        import numpy as np

        # numpy advises the whole huge pages inside its buffer: look in the middle.
        address = np.frombuffer(fetched, np.uint8).ctypes.data + len(data) // 2
        assert "hg" not in mapping_flags(address)
    assert bytes(fetched) == data
