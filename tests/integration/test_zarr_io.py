"""zarr_io against real Orbax and real files: what it writes is Orbax's checkpoint byte for
byte, Orbax reads it, Orbax's files are read natively, the checksums it reports are those of
the files, damage is caught, and a failed or unsupported write falls back or leaves nothing."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_integrity import flip_byte, step_dir
from test_orbax_backend import _FileSizeLimit, assert_bitwise_equal, assert_same_tree, like_of

from jaxckpt import CheckpointManager, CheckpointWarning, RecoverConfig, StepInfo
from jaxckpt.backends.orbax import chunk_io, zarr_format
from jaxckpt.backends.orbax.backend import OrbaxBackend
from jaxckpt.backends.orbax.files import LocalArrayFiles
from jaxckpt.commit.deferred_checks import DeferredChecks
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.core.checksum import default_algorithm, file_checksum
from jaxckpt.errors import CheckpointCorruptError, CheckpointWriteError
from jaxckpt.storage.buffers import ALIGN, aligned_empty

from support.memory import mapping_flags, numpy_huge_page_advice

ALGORITHM = default_algorithm()
PIECE = chunk_io.PIECE

ZERO_COPY_MIN = chunk_io.ZERO_COPY_MIN


@pytest.fixture(scope="module")
def backends():
    """backends(kind, pack_leaf_bytes): one shared backend per setting. kind "native" is
    the default (zarr_io), "orbax" is native_io=False."""
    made: dict[tuple[str, int | None], OrbaxBackend] = {}

    def get(kind: str, pack: int | None = None) -> OrbaxBackend:
        if (kind, pack) not in made:
            options = {} if pack is None else {"pack_leaf_bytes": pack}
            made[kind, pack] = OrbaxBackend(native_io=kind == "native", **options)
        return made[kind, pack]

    yield get
    for backend in made.values():
        backend.close()


def random_array(dtype, shape, rng) -> np.ndarray:
    """Random bits (NaN payloads, subnormals and all) of any dtype; bool as 0/1."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    count = int(np.prod(shape)) * dtype.itemsize
    return rng.integers(0, 256, size=count, dtype=np.uint8).view(dtype).reshape(shape)


def chunk_files(directory: Path) -> dict[str, Path]:
    """Array data files under ``directory/arrays`` (``{name}/c`` or ``{name}/c/0/...``), by
    path relative to ``directory``."""
    found = {}
    for path in (directory / "arrays").rglob("*"):
        rel = path.relative_to(directory)
        if path.is_file() and len(rel.parts) >= 3 and rel.parts[2] == "c":
            found[rel.as_posix()] = path
    return found


def offer_chunks(directory: Path, entries=None) -> tuple[DeferredChecks, list]:
    """A DeferredChecks offering every chunk file of ``directory`` (with the files' current
    checksums unless ``entries`` are given), as a restore with deferred checks does."""
    if entries is None:
        entries = []
        for rel, path in sorted(chunk_files(directory).items()):
            size, crc = file_checksum(str(path), ALGORITHM)
            entries.append((rel, {"size": size, ALGORITHM: crc}))
    claims = DeferredChecks()
    claims.offer(str(directory), entries)
    return claims, sorted(entries)


def chunk_entries(handle) -> list:
    """The write handle's entries of chunk files (what a restore defers), as (path, entry)."""
    return [(rel, info) for rel, info in handle.checksums.items()
            if len(rel.split("/")) >= 3 and rel.split("/")[2] == "c"]


def assert_checksums_are_the_files(handle, directory: Path) -> None:
    """The write handle lists every file it wrote (chunk files, zarr.json and Orbax's
    metadata, tree.json), with the file's real size and checksum, and names every directory
    below ``arrays/`` as made durable."""
    assert sorted(handle.checksums) == sorted(files_of(directory))
    for rel, info in handle.checksums.items():
        size, crc = file_checksum(str(directory / rel), ALGORITHM)
        assert info == {"size": size, ALGORITHM: crc}, rel
    arrays = directory / "arrays"
    assert sorted(handle.durable_dirs) == sorted(
        ["arrays"] + [p.relative_to(directory).as_posix() for p in arrays.rglob("*")
                      if p.is_dir()])


def files_of(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def placed(array: np.ndarray, past_page: int) -> np.ndarray:
    """A copy of ``array`` whose memory starts ``past_page`` bytes after a page boundary."""
    raw = np.empty(array.nbytes + 2 * ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN + past_page
    out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def bounce_of_kind(monkeypatch: pytest.MonkeyPatch, huge: bool) -> None:
    """Make the writer's bounce buffers anew, seen as backed by huge pages or not (which
    decides whether every block goes through them: ``chunk_io._write_direct``), whatever
    pages this system gives."""
    monkeypatch.setattr(chunk_io, "_local", threading.local())
    monkeypatch.setattr(chunk_io, "_huge_pages_at", lambda address: huge)


def stored_chunk(directory: Path, rel: str) -> tuple[int, bytes]:
    """(offset, array bytes) of the chunk file ``rel`` under ``directory``, after checking
    that the file is exactly ``offset`` zeros, the bytes, and the shard index naming them."""
    name_dir = (directory / rel).parents[len(Path(rel).parts) - 3]
    shape, dtype, offset = zarr_format.parse_metadata((name_dir / "zarr.json").read_bytes())
    nbytes = int(np.prod(shape)) * dtype.itemsize
    content = (directory / rel).read_bytes()
    assert len(content) == offset + nbytes + 20, rel
    assert content[:offset] == bytes(offset), rel
    assert content[offset + nbytes:] == zarr_format.shard_index(nbytes, offset), rel
    return offset, content[offset:offset + nbytes]


def stored_names(directory: Path) -> dict[str, str]:
    tree = json.loads((directory / "tree.json").read_text())
    return {leaf["path"]: leaf["name"] for leaf in tree["leaves"]}


def mixed_state() -> dict:
    rng = np.random.default_rng(1)
    return {
        "params": {"w": jnp.asarray(rng.standard_normal((64, 32), np.float32)),
                   "b": jnp.asarray(rng.standard_normal(32), jnp.bfloat16)},
        "big": jnp.asarray(rng.standard_normal(1 << 19, np.float32)),  # 2 MiB: never packed
        "host": rng.standard_normal((5, 3)),
        "half": rng.standard_normal(9).astype(ml_dtypes.bfloat16),
        "counts": rng.integers(-5, 5, (4,), dtype=np.int16),
        "key": jax.random.key(0),
        "step": 12345,
        "lr": 3e-4,
    }


# ------------------------------------------------------------------ same files as Orbax


@pytest.fixture(scope="module")
def fidelity(tmp_path_factory, backends):
    """The same flat dict written by Orbax and by zarr_io, every leaf its own array."""
    rng = np.random.default_rng(0)
    state = {f"{name}_{len(shape)}d": random_array(name, shape, rng)
             for name in sorted(zarr_format.SUPPORTED_DTYPES)
             for shape in [(), (7,), (3, 5), (2, 3, 4)]}
    state["one_block"] = random_array("uint8", (ALIGN - 20,), rng)  # data + index: 4096
    state["two_blocks"] = random_array("float32", ((2 * ALIGN - 20) // 4,), rng)
    # Large arrays keep tensorstore's layout (offset 0) when their memory is not 64-byte
    # aligned (copied through the bounce buffer) or sits on a page boundary (written from
    # where it is): see data_offset.
    state["piece_exact"] = placed(random_array("uint8", (PIECE,), rng), 16)  # index: a piece
    state["piece_straddle"] = placed(random_array("uint8", (PIECE - 10,), rng), 0)  # crosses
    state["pieces"] = placed(random_array("float32", (3 * PIECE // 8 + 5,), rng), 16)  # 12 MiB
    state["page_aligned"] = placed(random_array("bfloat16", (3, ZERO_COPY_MIN), rng), 0)
    root = tmp_path_factory.mktemp("fidelity")
    for kind in ("orbax", "native"):
        handle = backends(kind, 0).write(str(root / kind), state, asynchronous=False)
        handle.wait()
        assert (handle.checksums is not None) == (kind == "native")
    return root / "orbax", root / "native", state


def test_native_files_are_orbaxs_byte_for_byte(fidelity):
    orbax_dir, native_dir, state = fidelity
    orbax_files = files_of(orbax_dir)  # tree.json and arrays/
    assert "tree.json" in orbax_files and "arrays/_METADATA" in orbax_files
    assert files_of(native_dir) == orbax_files
    assert len(chunk_files(native_dir)) == len(state)
    stamped = {"arrays/_CHECKPOINT_METADATA", "arrays/commit_success.txt"}  # times, path
    differing = sorted(rel for rel in orbax_files - stamped
                       if (orbax_dir / rel).read_bytes() != (native_dir / rel).read_bytes())
    assert differing == []

    metadata = []
    for directory in (orbax_dir, native_dir):
        document = json.loads((directory / "arrays" / "_CHECKPOINT_METADATA").read_text())
        assert document.pop("init_timestamp_nsecs") <= document.pop("commit_timestamp_nsecs")
        metadata.append(document)
    assert metadata[1] == metadata[0]
    orbax_text = (orbax_dir / "arrays" / "commit_success.txt").read_text()
    native_text = (native_dir / "arrays" / "commit_success.txt").read_text()
    assert str(native_dir / "arrays") in native_text
    assert native_text == orbax_text.replace(str(orbax_dir), str(native_dir))


def test_plain_orbax_restores_what_zarr_io_wrote_bit_for_bit(fidelity):
    _, native_dir, state = fidelity
    names = stored_names(native_dir)
    restored = ocp.PyTreeCheckpointer().restore(native_dir / "arrays")
    assert sorted(restored) == sorted(names.values())
    for key, value in state.items():
        assert_bitwise_equal(restored[names[f"['{key}']"]], value)


# ------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("pack", [0, None], ids=["unpacked", "packed"])
@pytest.mark.parametrize("writer,reader", [("native", "native"), ("orbax", "native"),
                                           ("native", "orbax")])
def test_mixed_tree_round_trips_bit_exactly(backends, tmp_path, writer, reader, pack):
    state = mixed_state()
    handle = backends(writer, pack).write(str(tmp_path / "ckpt"), state, asynchronous=False)
    handle.wait()
    claims, offered = offer_chunks(tmp_path / "ckpt")

    restored = backends(reader, pack).read(str(tmp_path / "ckpt"), like_of(state),
                                           claims=claims)

    assert_same_tree(restored, state)
    # The native reader claims (and checksums) every chunk file; Orbax claims none.
    assert claims.unclaimed(str(tmp_path / "ckpt")) == ([] if reader == "native" else offered)
    assert claims.problems(str(tmp_path / "ckpt")) == []


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_write_checksums_are_the_files_checksums(backends, tmp_path, asynchronous):
    handle = backends("native", 0).write(str(tmp_path / "ckpt"), mixed_state(),
                                         asynchronous=asynchronous)
    handle.wait()
    assert_checksums_are_the_files(handle, tmp_path / "ckpt")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_each_directory_is_synced_after_its_last_entry_was_made(tmp_path, monkeypatch,
                                                                asynchronous):
    """The native writer syncs every directory below arrays/ on its side threads, and
    only once nothing more is added to it (the commit skips those it names); each small
    file is synced as well."""
    from jaxckpt.backends.orbax import files as files_module

    seen: dict[str, list[set[str]]] = {}
    synced_files: list[str] = []
    real_dir, real_file = files_module.fsync_dir, files_module.fsync_file

    def fsync_dir(path: str) -> None:
        seen.setdefault(path, []).append(set(os.listdir(path)))
        real_dir(path)

    def fsync_file(path: str) -> None:
        synced_files.append(path)
        real_file(path)

    monkeypatch.setattr(files_module, "fsync_dir", fsync_dir)
    monkeypatch.setattr(files_module, "fsync_file", fsync_file)
    backend = OrbaxBackend()
    try:
        handle = backend.write(str(tmp_path / "ckpt"), mixed_state(), asynchronous=asynchronous)
        handle.wait()
    finally:
        backend.close()
    state_dir = tmp_path / "ckpt"
    (base,) = {path.split("/arrays.tmp-")[1].split("/")[0] for path in seen}
    for rel in handle.durable_dirs:
        before = str(state_dir / rel).replace("/arrays", f"/arrays.tmp-{base}", 1)
        assert any(entries == set(os.listdir(state_dir / rel)) for entries in seen[before]), rel
    small = {rel for rel in handle.checksums if not chunk_files(state_dir).get(rel)}
    assert small and {os.path.relpath(path, state_dir).replace(f"arrays.tmp-{base}", "arrays")
                      for path in synced_files} == small


def test_each_chunk_file_is_synced_on_a_side_thread_before_arrays_appears(tmp_path,
                                                                         monkeypatch):
    """A chunk file's fsync is handed to a side thread once its bytes are written (its
    I/O thread goes on to the next file), and ``arrays/`` is renamed into place only once
    every one of them returned; a failed fsync fails the write and leaves no arrays/."""
    real_fsync, real_rename = os.fsync, os.rename
    events: list[tuple[str, str, str]] = []
    lock = threading.Lock()
    failing = [False]

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if "/arrays.tmp-" in path and failing[0] and os.path.isfile(path):
            raise OSError(errno.EIO, "injected", path)
        real_fsync(fd)
        with lock:
            events.append(("fsync", path, threading.current_thread().name))

    def rename(source, target, *args, **kwargs):
        with lock:
            events.append(("rename", os.fspath(source), ""))
        return real_rename(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    backend = OrbaxBackend()
    try:
        backend.write(str(tmp_path / "ckpt"), mixed_state(), asynchronous=False).wait()
        (moved,) = [index for index, (kind, path, _) in enumerate(events)
                    if kind == "rename" and "/arrays.tmp-" in path]
        base = events[moved][1]
        chunks = {os.path.join(base, os.path.relpath(path, tmp_path / "ckpt/arrays"))
                  for path in map(str, chunk_files(tmp_path / "ckpt").values())}
        synced = {path: thread for kind, path, thread in events[:moved] if kind == "fsync"}
        assert chunks and chunks <= set(synced)
        assert all(synced[path].startswith("jaxckpt-names") for path in chunks)
        failing[0] = True
        with pytest.raises(OSError, match="injected"):
            backend.write(str(tmp_path / "bad"), mixed_state(), asynchronous=False).wait()
    finally:
        backend.close()
    assert not any(name.startswith("arrays") for name in os.listdir(tmp_path / "bad"))


def test_a_native_save_commits_without_reading_a_file_back(tmp_path, monkeypatch):
    """Every file of a native save is checksummed by its writer (driver.json by the
    manager), so the commit reads none back, and syncs only the directories above the
    arrays' (the step's, state/, recover/)."""
    from jaxckpt.storage import posix as storage_module

    def refuse(*args, **kwargs):
        raise AssertionError("the commit read a file back")

    synced: list[str] = []
    real_dir = storage_module.fsync_dir
    monkeypatch.setattr(storage_module.PosixStorage, "checksum", refuse)
    monkeypatch.setattr(storage_module, "fsync_dir",
                        lambda path: (synced.append(path), real_dir(path)))
    with CheckpointManager(tmp_path, mode="sync", preemption_signals=()) as mgr:
        mgr.save(StepInfo(0, 0, 0), mixed_state())
        synced.clear()
        mgr.save(StepInfo(0, 1, 1), mixed_state())
    monkeypatch.undo()
    store = CheckpointStore(tmp_path)
    path = store.step_path(1)
    assert store.verify(path, checksums=True) == []
    names = {os.path.relpath(p, tmp_path) for p in synced}
    assert {"recover", f"recover/{os.path.basename(path)}",
            f"recover/{os.path.basename(path)}/state"} <= names
    assert not any("/arrays/" in name or name.endswith("/arrays") for name in names), names


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_manager_commits_a_manifest_that_verifies(tmp_path, mode):
    with CheckpointManager(tmp_path, mode=mode, preemption_signals=()) as mgr:
        mgr.save(StepInfo(0, 0, 0), mixed_state())
        mgr.wait()
    store = CheckpointStore(tmp_path)
    path = store.step_path(0)
    assert store.verify(path, checksums=True) == []
    listed = store.read_manifest(path).files
    chunks = chunk_files(Path(path) / "state")
    assert chunks and all(f"state/{rel}" in listed for rel in chunks)


# ---------------------------------------------------------- arrays written where they lie


def test_data_offset_follows_the_arrays_memory(tmp_path):
    big = np.zeros(ZERO_COPY_MIN, np.uint8)
    assert chunk_io.data_offset(placed(big, 64), str(tmp_path)) == 64  # where jax puts them
    assert chunk_io.data_offset(placed(big, 448), str(tmp_path)) == 448
    assert chunk_io.data_offset(placed(big, 0), str(tmp_path)) == 0  # already aligned
    assert chunk_io.data_offset(placed(big, 16), str(tmp_path)) == 0  # restored misaligned
    assert chunk_io.data_offset(placed(big, 64), str(tmp_path), direct=False) == 0
    assert chunk_io.data_offset(placed(big[:-1], 64), str(tmp_path)) == 0  # small: copied
    matrix = placed(np.zeros((1024, 2048), np.uint8), 64)
    assert chunk_io.data_offset(matrix[:, ::2], str(tmp_path)) == 0  # not contiguous
    assert aligned_empty((3, 5), np.float32).ctypes.data % ALIGN == 0
    array = jnp.arange(ZERO_COPY_MIN // 4, dtype=jnp.float32)
    host = np.asarray(array)
    assert chunk_io.data_offset(host, str(tmp_path)) == host.ctypes.data % ALIGN


@pytest.fixture
def numpy_advises_huge_pages():
    """numpy's advice of huge pages for its big arrays switched on for the test (it is on
    by default on Linux): the memory a restore reads into must not depend on it."""
    with numpy_huge_page_advice():
        yield


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
def test_a_restore_reads_into_xla_memory_that_a_donated_step_reuses(
        tmp_path, numpy_advises_huge_pages, monkeypatch):
    # On a CPU device the restore reads each array's bytes into memory XLA allocated
    # (``place.owned_on_cpu``), not into a buffer jax would adopt as a view: XLA reuses
    # only memory it owns for a donated step's outputs, and the first training step would
    # otherwise fault in a whole new state. That memory asks for no huge pages either
    # (benchmarks/results/cold-restore-hugepages_cpu2core_2026-11-25.md).
    read_into: list[int] = []
    real_read = chunk_io.read_chunk_into

    def spy(path, out, **options):
        read_into.append(out.ctypes.data)
        return real_read(path, out, **options)

    monkeypatch.setattr(chunk_io, "read_chunk_into", spy)
    count = 2 << 20  # 8 MiB of float32, 4 of bfloat16: numpy advises huge pages from 4 MiB
    state = {"big": jnp.arange(count, dtype=jnp.float32) + 1,
             "half": jnp.arange(count, dtype=jnp.bfloat16) - 1}
    with CheckpointManager(tmp_path, mode="sync", preemption_signals=()) as mgr:
        mgr.save(StepInfo(0, 0, 0), state)
        restored = mgr.restore(like_of(state)).state
    addresses = {name: array.unsafe_buffer_pointer() for name, array in restored.items()}
    assert sorted(read_into) == sorted(addresses.values())  # read straight into them
    for name, array in restored.items():
        np.testing.assert_array_equal(np.asarray(array), np.asarray(state[name]))
        assert "hg" not in mapping_flags(addresses[name]), name
    step = jax.jit(lambda tree: jax.tree.map(lambda leaf: leaf * 2, tree), donate_argnums=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable"
        stepped = jax.block_until_ready(step(restored))
    for name, array in restored.items():
        assert array.is_deleted(), name
        assert stepped[name].unsafe_buffer_pointer() == addresses[name], name  # reused


def test_a_chunk_read_to_the_host_asks_for_no_huge_pages(tmp_path, numpy_advises_huge_pages):
    # Packs and arrays for other devices are read into buffers handed over as they are.
    data = np.arange(2 << 20, dtype=np.float32)
    path = tmp_path / "chunk"
    chunk_io.write_chunk(str(path), data, algorithm=ALGORITHM)
    content, _ = chunk_io.read_chunk(str(path), data.nbytes, algorithm=None)
    assert chunk_io.array_bytes(str(path), content, data.nbytes).tobytes() == data.tobytes()
    assert "hg" not in mapping_flags(content.ctypes.data)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("past_page,offset", [(64, 64), (448, 448), (0, 0), (16, 64), (0, 4032)],
                         ids=["zero-copy", "zero-copy-448", "aligned", "bounce", "bounce-far"])
@pytest.mark.parametrize("nbytes", [ALIGN - 64, 2 * ALIGN + 7, PIECE + 3 * ALIGN + 5],
                         ids=["one-block", "blocks", "pieces"])
@pytest.mark.parametrize("huge", [False, True], ids=["4k-bounce", "huge-bounce"])
def test_write_chunk_puts_the_bytes_at_the_offset(tmp_path, monkeypatch, direct, past_page,
                                                  offset, nbytes, huge):
    bounce_of_kind(monkeypatch, huge)
    data = placed(random_array("uint8", (nbytes,), np.random.default_rng(nbytes)), past_page)
    path = tmp_path / "chunk"
    size, crc = chunk_io.write_chunk(str(path), data, algorithm=ALGORITHM, direct=direct,
                                    offset=offset)
    content = path.read_bytes()
    assert size == len(content) == offset + nbytes + 20
    assert content == bytes(offset) + data.tobytes() + zarr_format.shard_index(nbytes, offset)
    assert (size, crc) == file_checksum(str(path), ALGORITHM)

    read, checksum = chunk_io.read_chunk(str(path), nbytes, algorithm=ALGORITHM, offset=offset)
    assert checksum == crc
    restored = chunk_io.array_bytes(str(path), read, nbytes, offset)
    assert restored.tobytes() == data.tobytes()
    assert restored.ctypes.data % ALIGN == offset  # 64-byte aligned: jax adopts it as is
    # A zarr.json that names another offset: the size, or else the shard index, says so.
    with pytest.raises(CheckpointCorruptError, match=f"at offset {offset + 1} is stored in"):
        chunk_io.read_chunk(str(path), nbytes, algorithm=None, offset=offset + 1)
    with pytest.raises(CheckpointCorruptError, match=f"shard index .* offset {offset + 1}"):
        chunk_io.array_bytes(str(path), read, nbytes - 1, offset + 1)
    for past in {offset, (offset + 16) % ALIGN}:  # lined up with the file's blocks, or not
        out = placed(np.zeros(nbytes, np.uint8), past)
        index, checksum = chunk_io.read_chunk_into(str(path), out, algorithm=ALGORITHM,
                                                   direct=direct, offset=offset)
        assert checksum == crc and out.tobytes() == data.tobytes()
        chunk_io.check_index(str(path), index, nbytes, offset)
    index, _ = chunk_io.read_chunk_into(str(path), np.zeros(nbytes - 1, np.uint8),
                                        algorithm=None, direct=direct, offset=offset + 1)
    with pytest.raises(CheckpointCorruptError, match=f"shard index .* offset {offset + 1}"):
        chunk_io.check_index(str(path), index, nbytes - 1, offset + 1)


def write_recording(monkeypatch, path, data, offset):
    """``chunk_io.write_chunk`` of ``data`` to ``path``, recording each ``pwrite`` as
    (position, length, source address, O_DIRECT or not): (size, crc, writes). Skips where
    the filesystem refuses O_DIRECT."""
    import fcntl

    writes: list[tuple[int, int, int, bool]] = []
    pwrite = os.pwrite

    def recording(fd, view, position):
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        writes.append((position, len(view), np.frombuffer(view, np.uint8).ctypes.data, direct))
        return pwrite(fd, view, position)

    monkeypatch.setattr(chunk_io.os, "pwrite", recording)
    size, crc = chunk_io.write_chunk(str(path), data, algorithm=ALGORITHM, offset=offset)
    if os.stat(path.parent).st_dev in chunk_io._no_direct:
        pytest.skip("this filesystem refuses O_DIRECT")
    return size, crc, writes


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
@pytest.mark.parametrize("past_page,offset", [(64, 64), (16, 64), (0, 0)],
                         ids=["zero-copy", "bounce", "aligned"])
@pytest.mark.parametrize("huge", [False, True], ids=["4k-bounce", "huge-bounce"])
def test_write_chunk_sends_only_the_last_partial_block_through_the_page_cache(
        tmp_path, monkeypatch, past_page, offset, huge):
    """Every whole block of a chunk file, the first one included when the array starts
    past the file's beginning, is written with O_DIRECT; what goes through the page cache
    is the last partial block and the shard index, less than a block and 20 bytes."""
    bounce_of_kind(monkeypatch, huge)
    nbytes = 2 * PIECE + 3 * ALIGN + 100
    data = placed(random_array("uint8", (nbytes,), np.random.default_rng(1)), past_page)
    path = tmp_path / "chunk"
    size, _, writes = write_recording(monkeypatch, path, data, offset)
    whole = size - size % ALIGN
    assert [(position, length) for position, length, _, direct in writes
            if not direct] == [(whole, size - whole)]
    assert path.read_bytes() == bytes(offset) + data.tobytes() + zarr_format.shard_index(nbytes,
                                                                                     offset)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
def test_write_chunk_checksums_a_piece_of_the_array_while_writing_it(tmp_path, monkeypatch):
    """A piece written from the array's own memory is checksummed during its write, not
    before it: here each checksum of a whole piece waits until that piece's write has
    started (done in turn on one thread, it would wait forever; the timeout says so).
    Pieces are written from the array's memory where the bounce buffer has no huge
    pages (elsewhere they are copied through it: the next test)."""
    bounce_of_kind(monkeypatch, False)
    nbytes = 2 * PIECE + ALIGN
    data = placed(random_array("uint8", (nbytes,), np.random.default_rng(2)), 0)
    started: dict[int, threading.Event] = {}
    lock = threading.Lock()

    def event(length: int) -> threading.Event:
        with lock:
            return started.setdefault(length, threading.Event())

    pwrite, extend = os.pwrite, chunk_io.extend

    def writing(fd, view, position):
        event(position).set()
        return pwrite(fd, view, position)

    def checksumming(algorithm, crc, memory):
        if len(memory) == PIECE:  # a whole piece of the array, at its file position
            position = np.asarray(memory).ctypes.data - data.ctypes.data
            assert event(position).wait(timeout=10), "checksummed before its write began"
        return extend(algorithm, crc, memory)

    monkeypatch.setattr(chunk_io.os, "pwrite", writing)
    monkeypatch.setattr(chunk_io, "extend", checksumming)
    path = tmp_path / "chunk"
    size, crc = chunk_io.write_chunk(str(path), data, algorithm=ALGORITHM, offset=0)
    if os.stat(tmp_path).st_dev in chunk_io._no_direct:
        pytest.skip("this filesystem refuses O_DIRECT")
    assert (size, crc) == file_checksum(str(path), ALGORITHM)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
@pytest.mark.parametrize("past_page,offset", [(64, 64), (0, 0)], ids=["jax-like", "aligned"])
def test_write_chunk_writes_every_block_from_a_huge_page_bounce_buffer(
        tmp_path, monkeypatch, past_page, offset):
    """Where huge pages back the thread's bounce buffer, every O_DIRECT write of an array
    in jax's memory (a nonzero offset) comes from it: the device then gets a few large
    requests where the array's own 4 KiB pages make many small ones
    (benchmarks/results/save-write-floor_cpu2core_2026-11-25.md). One of our own
    page-aligned buffers at offset 0 (staging, packs: numpy's huge pages) is written from
    its own memory, with no copy.
    The checksum is that of the bytes written either way."""
    bounce_of_kind(monkeypatch, True)
    nbytes = 2 * PIECE + 3 * ALIGN + 100
    data = placed(random_array("uint8", (nbytes,), np.random.default_rng(3)), past_page)
    path = tmp_path / "chunk"
    size, crc, writes = write_recording(monkeypatch, path, data, offset)
    sources = [address for _, _, address, direct in writes if direct]
    bounce, huge = chunk_io._bounce()
    assert huge
    start, end = bounce.ctypes.data, bounce.ctypes.data + bounce.nbytes
    first = data.ctypes.data
    if offset:  # from the bounce buffer; the array's memory only where the copy lagged
        # Copied pieces grow from a megabyte (the first write waits only for its copy)
        # to PIECE: 1, 1, 2, 4, 8 MiB, then the last whole blocks.
        assert [length for _, length, _, direct in writes if direct][:5] == [
            1 << 20, 1 << 20, 2 << 20, 4 << 20, PIECE]
        assert start <= sources[0] < end
        assert all(start <= source < end or first <= source < first + nbytes
                   for source in sources)
    else:  # each from the array itself, one piece after another
        assert len(sources) == 3
        assert all(first <= source < first + nbytes for source in sources)
    assert path.read_bytes() == bytes(offset) + data.tobytes() + zarr_format.shard_index(nbytes,
                                                                                     offset)
    assert (size, crc) == file_checksum(str(path), ALGORITHM)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
def test_a_copy_that_falls_behind_the_device_hands_the_rest_to_the_arrays_memory(
        tmp_path, monkeypatch):
    """The copy of the next piece into the bounce buffer runs on a checksum thread while
    the piece before is written. Where that thread has not even started it when a write
    of a whole ``PIECE`` is done (here: its one thread is held from the 4 MiB piece's write
    until a write from the array's memory), the rest of the file is written from the
    array's own memory, the thread's next file too, and the one after that tries the copy
    again. The bytes and checksums are right throughout."""
    bounce_of_kind(monkeypatch, True)
    nbytes = 3 * PIECE + 100  # pieces of 1, 1, 2, 4, 8 and 8 MiB
    data = placed(random_array("uint8", (nbytes,), np.random.default_rng(5)), 64)
    held = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(chunk_io._checksummer, "_pool", pool)
    pwrite = os.pwrite
    sources: list[int] = []
    bounce = chunk_io._bounce()[0].ctypes.data
    hold = [True]

    def recording(fd, view, position):
        if len(view) >= ALIGN:
            source = np.frombuffer(view, np.uint8).ctypes.data
            sources.append(source)
            if len(view) == PIECE // 2 and hold[0]:  # the copy of the 8 MiB piece is ahead
                hold[0] = False
                pool.submit(held.wait, 10)  # and holds the thread after it
            if not bounce <= source < bounce + 2 * PIECE:
                held.set()
        return pwrite(fd, view, position)

    monkeypatch.setattr(chunk_io.os, "pwrite", recording)
    try:
        kinds = []
        for index in range(3):
            sources.clear()
            path = tmp_path / f"chunk{index}"
            size, crc = chunk_io.write_chunk(str(path), data, algorithm=ALGORITHM, offset=64)
            if os.stat(tmp_path).st_dev in chunk_io._no_direct:
                pytest.skip("this filesystem refuses O_DIRECT")
            assert (size, crc) == file_checksum(str(path), ALGORITHM)
            assert path.read_bytes() == (bytes(64) + data.tobytes()
                                         + zarr_format.shard_index(nbytes, 64))
            kinds.append(["bounce" if bounce <= source < bounce + 2 * PIECE else "array"
                          for source in sources])
    finally:
        held.set()
        pool.shutdown()
    assert held.is_set() and not hold[0]
    assert kinds[0] == ["bounce"] * 5 + ["array"]  # the last 8 MiB from the array
    assert kinds[1] == ["bounce"] + ["array"] * 3  # the first block (the zeros) is copied
    # The third file tries the copy again: its pieces up to the first whole PIECE come from
    # the bounce buffer (the last may fall back again when the machine is busy).
    assert kinds[2][:5] == ["bounce"] * 5 and len(kinds[2]) == 6


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")
def test_the_bounce_buffer_is_private_memory_that_asks_for_huge_pages(monkeypatch):
    """Huge pages need private anonymous memory (Python's ``mmap`` maps shared memory by
    default, which never gets them here), aligned to a huge page and advised to use them;
    one buffer per thread, made once."""
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE here")
    monkeypatch.setattr(chunk_io, "_local", threading.local())
    bounce, _ = chunk_io._bounce()
    assert bounce.nbytes == 2 * PIECE  # one half filled while the other is written
    assert bounce.ctypes.data % (2 << 20) == 0
    flags = mapping_flags(bounce.ctypes.data)
    assert "hg" in flags and "sh" not in flags, flags
    assert chunk_io._bounce()[0] is bounce
    with concurrent.futures.ThreadPoolExecutor(1) as other:
        assert other.submit(lambda: chunk_io._bounce()[0]).result() is not bounce


def test_write_chunk_refuses_an_offset_outside_a_block(tmp_path):
    with pytest.raises(ValueError, match="offset 4096"):
        chunk_io.write_chunk(str(tmp_path / "c"), np.zeros(8, np.uint8), algorithm=ALGORITHM,
                            offset=ALIGN)
    assert not (tmp_path / "c").exists()


def test_parse_metadata_takes_orbaxs_form_and_ours_only():
    plain = zarr_format.metadata_text((3, 4), "float32")
    assert zarr_format.parse_metadata(plain) == ((3, 4), np.dtype("float32"), 0)
    ours = zarr_format.metadata_text((3, 4), "float32", 64)
    assert json.loads(ours)["attributes"] == {"jaxckpt": {"chunk_offset": 64}}
    assert zarr_format.parse_metadata(ours) == ((3, 4), np.dtype("float32"), 64)
    document = json.loads(plain)
    for attributes in ({"other": 1}, {"jaxckpt": {"chunk_offset": 64}, "other": 1},
                       {"jaxckpt": {"chunk_offset": 64, "more": 1}}, {"jaxckpt": 64}, [],
                       {"jaxckpt": {"chunk_offset": -1}}, {"jaxckpt": {"chunk_offset": ALIGN}},
                       {"jaxckpt": {"chunk_offset": True}}, {"jaxckpt": {"chunk_offset": 6.0}},
                       {"jaxckpt": {"chunk_offset": "64"}}):
        text = json.dumps({**document, "attributes": attributes})
        assert zarr_format.parse_metadata(text) is None, attributes


@pytest.fixture(scope="module")
def offsets(tmp_path_factory, backends):
    """The same arrays written by Orbax and by zarr_io, in memory that sits 64 and 448
    bytes past a page boundary, as jax's host buffers do."""
    rng = np.random.default_rng(5)
    state = {"at_64": placed(random_array("float32", (3, PIECE // 8 + 11), rng), 64),
             "at_448": placed(random_array("bfloat16", (ZERO_COPY_MIN,), rng), 448),
             "jax": jnp.asarray(random_array("float32", (ZERO_COPY_MIN // 2,), rng))}
    root = tmp_path_factory.mktemp("offsets")
    handles = {}
    for kind in ("orbax", "native"):
        handles[kind] = backends(kind, 0).write(str(root / kind), state, asynchronous=False)
        handles[kind].wait()
    return root / "orbax", root / "native", state, handles["native"]


def test_offset_files_are_orbaxs_bytes_after_the_zeros(offsets):
    orbax_dir, native_dir, state, _ = offsets
    names = stored_names(native_dir)
    expected = {"at_64": 64, "at_448": 448,
                "jax": np.asarray(state["jax"]).ctypes.data % ALIGN}
    for key, offset in expected.items():
        name = names[f"['{key}']"]
        (rel,) = [rel for rel in chunk_files(native_dir) if rel.startswith(f"arrays/{name}/")]
        assert stored_chunk(native_dir, rel) == (offset, stored_chunk(orbax_dir, rel)[1])
        ours = json.loads((native_dir / "arrays" / name / "zarr.json").read_text())
        theirs = json.loads((orbax_dir / "arrays" / name / "zarr.json").read_text())
        if offset:
            assert ours.pop("attributes") == {"jaxckpt": {"chunk_offset": offset}}
        assert ours == theirs


def test_plain_orbax_restores_offset_files_bit_for_bit(offsets):
    _, native_dir, state, _ = offsets
    names = stored_names(native_dir)
    restored = ocp.PyTreeCheckpointer().restore(native_dir / "arrays")
    for key, value in state.items():
        assert_bitwise_equal(restored[names[f"['{key}']"]], np.asarray(value))


def test_offset_files_are_read_natively_and_checksummed(offsets, backends):
    _, native_dir, state, handle = offsets
    assert_checksums_are_the_files(handle, native_dir)
    claims, _ = offer_chunks(native_dir, chunk_entries(handle))
    restored = backends("native", 0).read(str(native_dir), like_of(state), claims=claims)
    assert_same_tree(restored, state)
    assert claims.unclaimed(str(native_dir)) == []  # read natively, every file checked
    assert claims.problems(str(native_dir)) == []
    assert restored["at_64"].ctypes.data % ALIGN == 64  # the bytes where the read put them
    assert restored["at_448"].ctypes.data % ALIGN == 448


def test_a_reader_that_does_not_know_the_attribute_hands_the_array_to_orbax(offsets, backends,
                                                                           tmp_path):
    """What a reader from before offsets does with such a checkpoint: it finds a zarr.json
    that is not exactly tensorstore's, so Orbax reads it, correctly."""
    _, native_dir, state, _ = offsets
    copy = tmp_path / "copy"
    shutil.copytree(native_dir, copy)
    for path in (copy / "arrays").glob("*/zarr.json"):
        document = json.loads(path.read_text())
        if "attributes" in document:
            document["attributes"] = {"jaxckpt": {"chunk_offset": 64, "newer": True}}
            path.write_text(json.dumps(document))
    claims, offered = offer_chunks(copy)
    restored = backends("native", 0).read(str(copy), like_of(state), claims=claims)
    assert_same_tree(restored, state)
    assert claims.unclaimed(str(copy)) == offered  # Orbax read them


# ------------------------------------------------------------------------- fallbacks


def test_an_array_zarr_io_cannot_write_sends_the_whole_write_to_orbax(backends, tmp_path):
    state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4),
             "int4": np.array([1, -2, 7, -8, 0], ml_dtypes.int4)}
    handle = backends("native", 0).write(str(tmp_path / "ckpt"), state, asynchronous=False)
    handle.wait()
    assert handle.checksums is None  # Orbax wrote it
    claims, offered = offer_chunks(tmp_path / "ckpt")
    assert offered

    restored = backends("native", 0).read(str(tmp_path / "ckpt"), like_of(state), claims=claims)

    assert_same_tree(restored, state)
    # One array not in zarr_io's layout: Orbax reads them all.
    assert claims.unclaimed(str(tmp_path / "ckpt")) == offered


def test_buffered_io_writes_the_same_files_and_reads_them_back(tmp_path):
    rng = np.random.default_rng(2)
    state = {"pieces": random_array("float32", (3 * PIECE // 8 + 5,), rng),
             "small": random_array("bfloat16", (3, 7), rng)}
    direct, buffered = OrbaxBackend(pack_leaf_bytes=0), OrbaxBackend(pack_leaf_bytes=0,
                                                                     direct_io=False)
    try:
        direct.write(str(tmp_path / "direct"), state, asynchronous=False).wait()
        handle = buffered.write(str(tmp_path / "buffered"), state, asynchronous=False)
        handle.wait()
        assert_checksums_are_the_files(handle, tmp_path / "buffered")
        for rel in chunk_files(tmp_path / "buffered"):  # offsets may differ: data_offset
            assert (stored_chunk(tmp_path / "buffered", rel)[1]
                    == stored_chunk(tmp_path / "direct", rel)[1]), rel
        claims, _ = offer_chunks(tmp_path / "buffered", chunk_entries(handle))
        restored = buffered.read(str(tmp_path / "buffered"), like_of(state), claims=claims)
        assert_same_tree(restored, state)
        assert claims.unclaimed(str(tmp_path / "buffered")) == []
        assert claims.problems(str(tmp_path / "buffered")) == []
    finally:
        direct.close()
        buffered.close()


def test_a_filesystem_that_refuses_o_direct_gets_buffered_io(backends):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    directory = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        try:
            os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
        else:
            pytest.skip("/dev/shm accepts O_DIRECT here (tmpfs does since Linux 6.6) and no "
                        "other filesystem at hand refuses it")
        state = mixed_state()
        handle = backends("native", 0).write(str(directory / "ckpt"), state, asynchronous=False)
        handle.wait()
        assert os.stat(directory).st_dev in chunk_io._no_direct
        assert_checksums_are_the_files(handle, directory / "ckpt")
        assert_same_tree(backends("native", 0).read(str(directory / "ckpt"), like_of(state)),
                         state)
    finally:
        shutil.rmtree(directory)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_failed_native_write_leaves_no_arrays_directory(tmp_path, asynchronous):
    backend = OrbaxBackend()
    try:
        with _FileSizeLimit(2 << 20), pytest.raises(OSError, match="File too large"):
            backend.write(str(tmp_path / "ckpt"), {"w": np.ones(1 << 20, np.float32)},
                          asynchronous=asynchronous).wait()
    finally:
        backend.close()
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["tree.json"]  # no arrays, no arrays.tmp-*


# ------------------------------------------------------------------------------ damage


def test_array_bytes_refuses_a_damaged_shard_index(tmp_path):
    data = random_array("float32", (1000,), np.random.default_rng(3))
    path = tmp_path / "chunk"
    chunk_io.write_chunk(str(path), data, algorithm=ALGORITHM)
    content, _ = chunk_io.read_chunk(str(path), data.nbytes, algorithm=None)
    assert chunk_io.array_bytes(str(path), content, data.nbytes).tobytes() == data.tobytes()
    for offset in (data.nbytes + 9, data.nbytes + 18):  # its length field, its crc32c
        flip_byte(path, offset)
        content, _ = chunk_io.read_chunk(str(path), data.nbytes, algorithm=None)
        with pytest.raises(CheckpointCorruptError, match="shard index"):
            chunk_io.array_bytes(str(path), content, data.nbytes)
        flip_byte(path, offset)  # undo


def test_read_chunk_refuses_a_truncated_file(tmp_path):
    data = np.arange(5000, dtype=np.int32)
    path = tmp_path / "chunk"
    chunk_io.write_chunk(str(path), data, algorithm=ALGORITHM)
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(CheckpointCorruptError, match=f"{data.nbytes + 19} bytes"):
        chunk_io.read_chunk(str(path), data.nbytes, algorithm=ALGORITHM)


@pytest.mark.parametrize("where", ["data", "index"])
def test_the_native_reads_checksum_catches_what_the_read_alone_misses(backends, tmp_path, where):
    state = {"w": random_array("float32", (1 << 18,), np.random.default_rng(4))}
    handle = backends("native", 0).write(str(tmp_path / "ckpt"), state, asynchronous=False)
    handle.wait()
    ((rel, path),) = chunk_files(tmp_path / "ckpt").items()
    flip_byte(path, state["w"].nbytes // 2 if where == "data" else path.stat().st_size - 8)
    # As a restore does: the checksums of the commit, not of the damaged file.
    claims, _ = offer_chunks(tmp_path / "ckpt", chunk_entries(handle))

    if where == "data":  # one wrong number: the read itself cannot tell
        restored = backends("native", 0).read(str(tmp_path / "ckpt"), like_of(state),
                                              claims=claims)
        assert restored["w"].tobytes() != state["w"].tobytes()
    else:
        with pytest.raises(CheckpointCorruptError, match="shard index"):
            backends("native", 0).read(str(tmp_path / "ckpt"), like_of(state), claims=claims)
    assert claims.unclaimed(str(tmp_path / "ckpt")) == []
    (problem,) = claims.problems(str(tmp_path / "ckpt"))
    assert problem.startswith(f"{rel}: {ALGORITHM} ") and "contents altered" in problem


def multi_piece_state(step: int) -> dict:
    rng = np.random.default_rng(10 + step)
    return {"big": jnp.asarray(rng.standard_normal(PIECE // 4 + 1000, dtype=np.float32)),
            "w": jnp.full((8, 8), float(step), jnp.float32), "key": jax.random.key(step)}


@pytest.mark.parametrize("where", ["second-piece", "index-length", "index-crc"])
def test_damaged_chunk_makes_recovery_fall_back_to_the_previous_step(tmp_path, where):
    with CheckpointManager(tmp_path, recover=RecoverConfig(keep_last_n=None), mode="sync",
                           preemption_signals=()) as mgr:
        for step in (0, 1):
            mgr.save(StepInfo(0, step, step), multi_piece_state(step))
    ckpt = step_dir(tmp_path, 1)
    name = stored_names(ckpt / "state")["['big']"]
    ((rel, path),) = [(f"state/{r}", p) for r, p in chunk_files(ckpt / "state").items()
                      if r.startswith(f"arrays/{name}/")]
    size = path.stat().st_size
    flip_byte(path, {"second-piece": PIECE + 100, "index-length": size - 9,
                     "index-crc": size - 2}[where])

    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), multi_piece_state(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(tmp_path, preemption_signals=()) as mgr:
            recovered = mgr.recover(like)

    assert recovered.step_info.global_step == 0
    assert_same_tree(recovered.state, multi_piece_state(0))
    messages = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert any(str(ckpt) in m and f"{rel}: {ALGORITHM}" in m for m in messages), messages


# ------------------------------------------------------------------------- DeferredChecks


def test_each_offered_file_is_claimed_once_and_none_after_close(tmp_path):
    claims, _ = offer_chunks(tmp_path, [("a/x", {"size": 3, "crc32c": "0000000a"}),
                                        ("b", {"size": 4, "crc32c": "0000000b"})])
    assert claims.claim(f"{tmp_path}/a/./x") == ("crc32c", "0000000a")  # any spelling
    assert claims.claim(str(tmp_path / "a" / "x")) is None  # already claimed
    assert claims.claim(str(tmp_path / "other")) is None  # never offered
    claims.close()
    assert claims.claim(str(tmp_path / "b")) is None
    assert claims.unclaimed(str(tmp_path)) == [("b", {"size": 4, "crc32c": "0000000b"})]


def test_unclaimed_waits_for_close(tmp_path):
    claims, offered = offer_chunks(tmp_path, [("x", {"size": 1, "crc32c": "00000001"})])
    got = []
    waiter = threading.Thread(target=lambda: got.append(claims.unclaimed(str(tmp_path))))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and got == []
    claims.close()
    waiter.join(5)
    assert got == [offered]


def test_settle_reports_a_wrong_checksum_and_a_missing_one(tmp_path):
    claims, _ = offer_chunks(tmp_path, [(name, {"size": 1, "crc32c": "00000001"})
                                        for name in ("good", "bad", "never")])
    for name in ("good", "bad", "never"):
        assert claims.claim(str(tmp_path / name)) is not None
    claims.close()
    claims.settle(str(tmp_path / "good"), "00000001")
    claims.settle(str(tmp_path / "bad"), "deadbeef")
    problems = claims.problems(str(tmp_path))
    assert len(problems) == 2
    assert problems[0].startswith("bad: crc32c deadbeef") and "contents altered" in problems[0]
    assert problems[1].startswith("never: ") and "never computed" in problems[1]


# ------------------------------------------------------------------ commit(known=...)


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "recover" / "step_00000000"
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(b"x" * 100)
    size, crc = file_checksum(str(path / "data.bin"), ALGORITHM)
    return CheckpointStore(tmp_path), str(path), {"size": size, ALGORITHM: crc}


def test_commit_takes_a_writers_checksum_without_reading_the_file(written):
    store, path, info = written
    lying = {"size": info["size"], ALGORITHM: "%08x" % (int(info[ALGORITHM], 16) ^ 1)}
    store.commit(path, 0, known={"data.bin": lying})
    assert store.read_manifest(path).files["data.bin"] == lying
    (problem,) = store.verify(path, checksums=True)
    assert problem.startswith("data.bin: ") and "contents altered" in problem


@pytest.mark.parametrize("case", ["no-such-file", "other-algorithm", "wrong-size"])
def test_commit_refuses_a_bad_known_entry(written, case):
    store, path, info = written
    other = "crc32" if ALGORITHM == "crc32c" else "crc32c"
    known = {"no-such-file": {"missing.bin": info},
             "other-algorithm": {"data.bin": {"size": info["size"], other: "00000000"}},
             "wrong-size": {"data.bin": {**info, "size": info["size"] + 1}}}[case]
    error = CheckpointWriteError if case == "wrong-size" else ValueError
    with pytest.raises(error):
        store.commit(path, 0, known=known)
    assert store.read_manifest(path) is None


# ------------------------------------------------------------------ chunk grids (sharded)


def test_parse_grid_takes_a_regular_grid_that_divides_the_shape_only():
    grid = zarr_format.metadata_text((8, 4), "float32", chunk_shape=(2, 4))
    assert zarr_format.parse_grid(grid) == ((8, 4), np.dtype("float32"), 0, (2, 4))
    assert zarr_format.parse_metadata(grid) is None  # not one chunk
    single = zarr_format.metadata_text((8, 4), "float32")
    assert zarr_format.parse_grid(single) == ((8, 4), np.dtype("float32"), 0, (8, 4))
    uneven = zarr_format.metadata_text((8, 4), "float32", chunk_shape=(3, 4))
    assert zarr_format.parse_grid(uneven) is None
    document = json.loads(grid)
    document["codecs"][0]["configuration"]["chunk_shape"] = [1, 4]  # inner != outer
    assert zarr_format.parse_grid(json.dumps(document)) is None
    with pytest.raises(ValueError, match="single-chunk"):
        zarr_format.metadata_text((8, 4), "float32", 64, chunk_shape=(2, 4))


def test_orbaxs_sharded_array_is_read_natively_chunk_by_chunk(tmp_path):
    """An array Orbax wrote from shards (a grid of chunk files, as several processes write
    it) is read by zarr_io, every chunk file claimed and checksummed, bit for bit."""
    from jaxckpt.backends.orbax.read import ToDevice, read_native

    mesh = jax.make_mesh((4, 2), ("a", "b"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    value = random_array("bfloat16", (8, 6), np.random.default_rng(3))
    array = jax.device_put(value, sharding)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True,
                                          use_compression=False)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(tmp_path / "arrays",
                          args=ocp.args.PyTreeSave(item={"leaf_000000": array}))
    grid = zarr_format.parse_grid((tmp_path / "arrays/leaf_000000/zarr.json").read_bytes())
    assert grid is not None and grid[3] != grid[0]  # several chunks
    claims, offered = offer_chunks(tmp_path)
    assert len(offered) == 8
    restore_args = {"leaf_000000": ToDevice(sharding=sharding, global_shape=(8, 6),
                                            dtype=value.dtype)}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        restored = read_native(str(tmp_path / "arrays"), restore_args,
                               claims, pool=pool, files=LocalArrayFiles(direct=True))
    assert restored is not None
    assert restored["leaf_000000"].sharding == sharding
    assert_bitwise_equal(np.asarray(restored["leaf_000000"]), value)
    assert claims.unclaimed(str(tmp_path)) == [] and claims.problems(str(tmp_path)) == []


def test_a_missing_chunk_file_of_a_grid_is_a_damaged_checkpoint(tmp_path):
    from jaxckpt.backends.orbax.read import TO_HOST, read_native, unreadable_is_corrupt

    arrays = tmp_path / "arrays"
    (arrays / "leaf_000000/c/0").mkdir(parents=True)
    (arrays / "leaf_000000/zarr.json").write_text(
        zarr_format.metadata_text((4, 2), "int32", chunk_shape=(2, 2)))
    chunk_io.write_chunk(str(arrays / "leaf_000000/c/0/0"), np.zeros((2, 2), np.int32),
                        algorithm=ALGORITHM)
    restore_args = {"leaf_000000": TO_HOST}
    with concurrent.futures.ThreadPoolExecutor(2) as pool, \
            pytest.raises(CheckpointCorruptError, match="cannot be read"), \
            unreadable_is_corrupt(str(tmp_path)):
        read_native(str(arrays), restore_args, None, pool=pool,
                    files=LocalArrayFiles(direct=True))


# ------------------------------------------ the packs read while like is matched


def packed_state() -> dict:
    """Small leaves in several packs (a 64 KiB pack limit) and one array stored alone."""
    rng = np.random.default_rng(21)
    small = {f"p{index:02d}": jnp.asarray(rng.standard_normal((2048,), dtype=np.float32))
             for index in range(24)}
    return {"small": small, "big": jnp.asarray(rng.standard_normal((1 << 17,),
                                                                   dtype=np.float32))}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A checkpoint of ``packed_state`` (its directory, the state, its pack names) and the
    backend that wrote it."""
    backend = OrbaxBackend(pack_leaf_bytes=16 << 10, pack_bytes=64 << 10)
    directory = tmp_path_factory.mktemp("packed") / "ckpt"
    state = packed_state()
    backend.write(str(directory), state, asynchronous=False).wait()
    packs = [pack["name"] for pack in json.loads((directory / "tree.json").read_text())["packs"]]
    assert len(packs) >= 3
    yield directory, state, packs
    backend.close()


def recording_reads(monkeypatch, packs: list[str]) -> dict:
    """Counts of the packs' chunk reads begun and ended, recorded by ``chunk_io.read_chunk``
    itself (the real one runs)."""
    counts = {"begun": 0, "ended": 0, "all_begun": threading.Event()}
    lock = threading.Lock()
    real = chunk_io.read_chunk

    def read_chunk(path, *args, **kwargs):
        is_pack = any(f"/{name}/" in path for name in packs)
        with lock:
            counts["begun"] += is_pack
            if counts["begun"] == len(packs):
                counts["all_begun"].set()
        try:
            return real(path, *args, **kwargs)
        finally:
            with lock:
                counts["ended"] += is_pack

    monkeypatch.setattr(chunk_io, "read_chunk", read_chunk)
    return counts


def test_the_packs_reads_begin_before_like_is_matched(packed, monkeypatch):
    from jaxckpt.backends.orbax import match

    directory, state, packs = packed
    counts = recording_reads(monkeypatch, packs)
    seen_by_compare = []
    real_compare = match.compare

    def compare(*args, **kwargs):  # the order: every pack's read begins before this ends
        counts["all_begun"].wait(timeout=10)
        seen_by_compare.append(counts["begun"])
        return real_compare(*args, **kwargs)

    monkeypatch.setattr(match, "compare", compare)
    claims, _ = offer_chunks(directory)
    backend = OrbaxBackend()
    try:
        restored = backend.read(str(directory), like_of(state), claims=claims)
    finally:
        backend.close()
    assert seen_by_compare == [len(packs)]
    assert counts["begun"] == counts["ended"] == len(packs)  # each pack read once
    assert_tree_bitwise_equal(restored, state)
    # Checked as before: every chunk file claimed and settled, none left unchecked.
    assert claims.unclaimed(str(directory)) == []
    assert claims.problems(str(directory)) == []


def test_a_like_mismatch_after_the_packs_reads_began_ends_them(packed, monkeypatch):
    from jaxckpt.backends.orbax import match
    from jaxckpt.errors import TreeMismatchError

    directory, state, packs = packed
    wrong = like_of(state)
    wrong["small"]["p03"] = jax.ShapeDtypeStruct((7,), jnp.float32)
    with pytest.raises(TreeMismatchError) as without_reads:  # matching alone: no reads
        match.match_like(epath_of(directory), str(directory), wrong)
    counts = recording_reads(monkeypatch, packs)
    real_compare = match.compare

    def compare(*args, **kwargs):  # some pack is being read, or was, when matching fails
        while counts["begun"] == 0:
            threading.Event().wait(0.001)
        return real_compare(*args, **kwargs)

    monkeypatch.setattr(match, "compare", compare)
    fds = len(os.listdir("/proc/self/fd"))
    claims, _ = offer_chunks(directory)
    backend = OrbaxBackend()
    try:
        with pytest.raises(TreeMismatchError) as with_reads:
            backend.read(str(directory), wrong, claims=claims)
        # Every read begun has ended when the error comes; none is still queued.
        assert counts["begun"] == counts["ended"] >= 1
        assert len(os.listdir("/proc/self/fd")) == fds
        assert str(with_reads.value) == str(without_reads.value)
        assert with_reads.value.problems == without_reads.value.problems
        begun = counts["begun"]
        # The next restore with the same backend reads everything again, and right.
        claims, _ = offer_chunks(directory)
        restored = backend.read(str(directory), like_of(state), claims=claims)
    finally:
        backend.close()
    assert counts["begun"] == begun + len(packs)
    assert_tree_bitwise_equal(restored, state)
    assert claims.problems(str(directory)) == []


def test_a_damaged_pack_read_while_like_is_matched_is_caught(packed, tmp_path):
    directory, state, packs = packed
    copy = tmp_path / "ckpt"
    shutil.copytree(directory, copy)
    claims, entries = offer_chunks(copy)  # the checksums of the undamaged files
    (pack_file,) = [path for rel, path in chunk_files(copy).items() if f"/{packs[0]}/" in
                    f"/{rel}"]
    flip_byte(pack_file, 100)
    backend = OrbaxBackend()
    try:
        backend.read(str(copy), like_of(state), claims=claims)
    finally:
        backend.close()
    (problem,) = claims.problems(str(copy))
    assert problem.startswith(f"arrays/{packs[0]}/") and "contents altered" in problem


def epath_of(directory: Path):
    from etils import epath

    return epath.Path(directory)


def assert_tree_bitwise_equal(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert_bitwise_equal(got, want)
