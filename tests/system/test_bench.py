"""``jaxckpt bench --quick``: every row runs and the report is complete (the numbers come from
full runs; this keeps the benchmark working)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from jaxckpt.tools import cli
from jaxckpt.tools.bench import BenchConfig, BenchResult, _Target, format_table, held
from jaxckpt.tools.bench.rows_back import BACK_PHASES

from support.harness import Worker, repo_env, run_all
from support.two_processes import free_port


def test_quick_bench_runs_every_row_and_reports_every_target(capsys, tmp_path):
    code = cli.main(["bench", "--quick", "--json", "--dir", str(tmp_path)])
    captured = capsys.readouterr()

    assert code == 0, captured.err
    report = json.loads(captured.out)
    rows = report["rows"]
    jax_rows = ["copy", "write", "read", "orbax_save", "orbax_restore", "jx_sync", "jx_blocking",
                "jx_async", "jx_restore", "jx_read", "jx_verify", "jx_read_bare",
                "fresh_memory", "many_jx_sync",
                "many_jx_restore", "many_orbax_save", "train_plain", "train_ckpt"]
    jax_rows += ["lv_save_0", "lv_save_1", "lv_save_2", "lv_restore_0", "lv_restore_1",
                 "lv_restore_2", "first_import", "first_save", "second_save", "first_restore"]
    # Each leaf count's fresh process (issue 33: the first save and restore of many leaves).
    jax_rows += [f"{key}_{name}" for key in ("first_save", "second_save", "first_restore")
                 for name in ("few", "many")]
    for key in jax_rows:
        assert rows[key]["median_s"] is not None and rows[key]["median_s"] > 0, key
        assert rows[key]["spread_s"][0] <= rows[key]["median_s"] <= rows[key]["spread_s"][1]
    # torch and HF rows are measured, or say why not (torch_bridge is written elsewhere).
    for key in ("torch_save", "dcp_save", "dcp_blocking", "dcpm_blocking", "dcpm_sync",
                "st_save", "hf_export", "hf_dcp_export", "hf_dcp_baseline", "hf_save_pretrained",
                "hf_torch_export", "hf_host_copy", "hf_export_blocking"):
        assert rows[key]["median_s"] is not None or rows[key]["unavailable"], key
    assert rows["jx_sync"]["gb_per_s"] > 0
    # The 2-process rows (bench.multiprocess): the same bytes saved by 1 process, then by 2.
    assert rows["mp_save_1"]["median_s"] > 0 and rows["mp_save_2"]["median_s"] > 0
    assert len(rows["mp_save_2"]["samples_s"]) == 5
    assert report["facts"]["multiprocess"]["rounds"] == 5
    # The O_DIRECT floors run wherever the filesystem takes O_DIRECT, or say why not.
    for key in ("write_direct", "read_direct"):
        assert rows[key]["median_s"] is not None or rows[key]["unavailable"], key
    targets = {t["target"]: t for t in report["targets"]}
    assert targets["async blocking / host copy"]["value"] is not None
    assert targets["restore throughput / bare read of its files, side by side"]["value"] > 0
    counts = BenchConfig.quick().leaf_counts
    for kind in ("save", "restore"):
        for count in counts[1:]:
            target = targets[f"{count} leaves {kind} / {counts[0]} leaves, same bytes"]
            assert target["value"] > 0 and target["met_with_margin"] in (True, False)
            assert target["spread"][0] <= target["value"] <= target["spread"][1]
    for kind in ("save", "restore"):
        name = f"fresh process: {counts[2]} leaves first {kind} / {counts[0]} leaves, same bytes"
        assert targets[name]["value"] > 0 and targets[name]["limit"] == 2.0, name
    # The "back" section: a fresh process per library from its start to its first jitted
    # step after the restore, split into phases that add up to the whole; the read floor of
    # the same bytes beside them (issue 33, time back to training).
    for who in ("jaxckpt", "orbax"):
        phases = [rows[f"back_{who}_{key}"]["median_s"] for key, _ in BACK_PHASES]
        assert all(seconds is not None and seconds >= 0 for seconds in phases), who
        assert sum(phases) == pytest.approx(rows[f"back_{who}_total"]["median_s"], rel=1e-6)
    assert rows["back_floor"]["median_s"] > 0
    for name, limit in (("jaxckpt restart / Orbax restart, whole process", 0.8),
                        ("jaxckpt restore phase / raw read of its files", 1.2)):
        target = targets[f"back to training: {name}"]
        assert target["value"] > 0 and target["limit"] == limit, name
    for name in ("DcpCheckpointManager sync save throughput / dcp.save",
                 "DcpCheckpointManager restore throughput / dcp.load"):
        assert name in targets
    assert any("RSS growth" in name for name in targets)
    # The transformers model's export: each ratio of issue 30 is reported, measured here.
    for name in ("torch HF export throughput / save_pretrained",
                 "async HF export blocking / host copy of its tensors"):
        assert targets[name]["value"] > 0, name
    # The export writes a tensor at a time from the model's own memory: its peak growth can
    # be nothing at all (0.0), never negative, and is measured (not None).
    peak = targets["torch HF export peak extra memory / largest shard"]["value"]
    assert peak is not None and peak >= 0
    largest = report["facts"]["hf_torch_memory"]["largest_shard_mib"]
    assert 0 < largest <= BenchConfig.quick().hf_shard_mb
    assert any("reference item" in name for name in targets)
    assert report["facts"]["aux"]["mib_written_when_unchanged"]
    assert report["facts"]["memory"]["saves"] == BenchConfig.quick().memory_saves
    assert report["facts"]["train"]["saves_per_run"] >= 1
    # The local tier's rows: the loop's blocking time with and without it.
    for key in ("local_loop_plain", "local_loop_tiered", "local_durable_plain",
                "local_durable_tiered", "local_save"):
        assert rows[key]["median_s"] is not None and rows[key]["median_s"] > 0, key
    assert report["facts"]["local_tier"]["saves_tiered"]["local"] >= 1
    assert targets["durable save blocking with a local tier / without"]["value"] > 0
    # incremental=True against plain saves: the times, and the bytes through the writer.
    # The same for DcpCheckpointManager on torch copies of the same bytes, side by side.
    for key in ("inc_plain", "inc_incr", "inc_all_plain", "inc_all_incr", "inc_incr_blocking",
                "inc_dcp_plain", "inc_dcp_incr", "inc_dcp_all_plain", "inc_dcp_all_incr"):
        assert rows[key]["median_s"] is not None and rows[key]["median_s"] > 0, key
    for name in ("incremental save time / plain save, frozen + trained",
                 "incremental save time / plain save, every leaf changed",
                 "DCP incremental save time / plain save, frozen + trained",
                 "DCP incremental save time / plain save, every tensor changed"):
        assert targets[name]["value"] > 0, name
    written = report["facts"]["incremental"]
    trained = written["trained_mib"] / (written["trained_mib"] + written["frozen_mib"])
    # Only the trained part and the metadata are written again.
    for what in ("", "DCP "):
        bytes_ratio = targets[f"{what}incremental save bytes written / plain save, "
                              "frozen + trained"]
        assert trained < bytes_ratio["value"] < trained + 0.02, what
    assert not list(tmp_path.iterdir()), "the bench leaves no files behind"


def test_ratios_are_medians_of_per_round_ratios():
    result = BenchResult(config=BenchConfig(repeats=3))
    # Round 2 ran on a loaded machine: both sides slowed together, the ratio did not move.
    result.samples = {"jx_sync": [1.0, 4.0, 1.1], "write": [0.8, 3.2, 0.88]}
    target = _Target(label="t", numerator="jx_sync", denominator="write", op=">=", limit=0.8,
                     invert=True)
    assert result.ratio(target) == pytest.approx(0.8)
    assert result.median("jx_sync") == 1.1


def test_saves_are_held_to_the_o_direct_floor_of_the_same_state():
    """Sync and async saves, each against the O_DIRECT write of the same bytes in the same
    round, >= 0.9, the label naming the state's size and leaves."""
    result = BenchResult(config=BenchConfig(size_mb=512, leaves=16, repeats=3,
                                            sections=("jax",)))
    result.samples = {"jx_sync": [1.0, 2.0, 1.0], "jx_async": [0.5, 2.0, 1.0],
                      "write_direct": [0.9, 1.0, 0.95]}
    targets = {t["target"]: t for t in result.targets()}
    sync = targets["sync save / O_DIRECT floor, 512 MiB in 16 leaves"]
    assert (sync["value"], sync["op"], sync["limit"]) == (pytest.approx(0.9), ">=", 0.9)
    assert targets["async save / O_DIRECT floor, 512 MiB in 16 leaves"]["value"] == \
        pytest.approx(0.95)


def test_floors_are_the_fastest_way_in_each_round():
    result = BenchResult(config=BenchConfig(repeats=3))
    result.samples = {"write": [1.0, 0.9, 2.0], "write_files": [0.7, 1.2, 1.5],
                      "write_direct": [0.8, 0.6, 1.8], "read": [0.5, 0.4, 0.6],
                      "read_files": [0.6, 0.5, 0.3]}
    result.derive_floors()
    assert result.samples["write_best"] == [0.7, 0.6, 1.5]
    # Without the O_DIRECT row (a filesystem that refuses it) the other two decide.
    assert result.samples["read_best"] == [0.5, 0.4, 0.3]


def test_table_marks_unmeasured_rows_unavailable_with_the_reason():
    config = BenchConfig.quick(sections=("torch",))
    result = BenchResult(config=config)
    result.unavailable["torch"] = "torch not installed (No module named 'torch')"
    text = format_table(result)
    assert "dcp.async_save: blocking" in text and "unavailable" in text
    assert "torch not installed" in text


@pytest.mark.parametrize("field, value", [("size_mb", 0), ("repeats", 0),
                                          ("sections", ("jax", "disk")), ("many_leaves", -1)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        BenchConfig(**{field: value})


def test_cli_reports_a_bad_setting_as_usage_error(capsys):
    assert cli.main(["bench", "--quick", "--sections", "jax,nope"]) == cli.EXIT_USAGE
    assert "nope" in capsys.readouterr().err


def test_cli_names_a_dir_it_cannot_make(capsys, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    assert cli.main(["bench", "--trainers", "--quick", "--dir",
                     str(tmp_path / "file" / "under")]) == cli.EXIT_USAGE
    assert "--dir" in capsys.readouterr().err


def test_quick_scale_run_reports_every_size_memory_and_consecutive_saves(capsys, tmp_path):
    workdir = tmp_path / "not-made-yet"  # --dir is made when missing
    code = cli.main(["bench", "--scale", "--quick", "--json", "--dir", str(workdir)])
    captured = capsys.readouterr()

    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert [size["mib"] for size in report["sizes"]] == [4, 8]
    assert report["stopped"]
    for size in report["sizes"]:
        for key in ("save_s", "blocking_s", "restore_s", "save_extra", "restore_extra"):
            assert len(size[key]) == 1 and size[key][0] >= 0, key
    assert len(report["saves"]["rss"]) == 6 and len(report["saves"]["save_s"]) == 6
    assert len(report["saves"]["floor_s"]) == 6
    for size in report["sizes"]:
        assert len(size["floor_s"]) == 1 and size["floor_s"][0] > 0
    names = [target["target"] for target in report["targets"]]
    assert any("time per GiB" in name for name in names)
    assert any("peak extra host memory" in name for name in names)
    assert any("consecutive" in name or "RSS growth" in name for name in names)
    assert not list(workdir.iterdir()), "the scale run leaves no files behind"


@pytest.mark.parametrize("value, op, limit, plain, with_margin", [
    (0.85, ">=", 0.8, True, False), (0.9, ">=", 0.8, True, True),
    (1.4, "<=", 1.5, True, False), (1.3, "<=", 1.5, True, True),
    (1.6, "<=", 1.5, False, False), (None, ">=", 1.0, None, None)])
def test_targets_hold_with_a_ten_percent_margin(value, op, limit, plain, with_margin):
    assert held(value, op, limit) is plain
    assert held(value, op, limit, 0.10) is with_margin


def _resident() -> int:
    import os

    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="no /proc")
def test_rows_start_with_the_memory_earlier_rows_freed_handed_back():
    """A read floor must read into new memory, as a restore does: memory that an earlier
    row freed but malloc kept (faulted in already) is handed back before each row."""
    import ctypes

    from jaxckpt.tools import bench

    try:
        ctypes.CDLL(None).malloc_trim  # noqa: B018 - glibc only
    except AttributeError:
        pytest.skip("not glibc: nothing to hand back")
    piece = 64 << 10  # under malloc's mmap threshold: from its heap
    held = [bytearray(b"x" * piece) for _ in range(1024)]  # 64 MiB, faulted in
    top = bytearray(b"y" * piece)  # keeps the heap's top in use: no automatic trim
    before = _resident()
    del held
    assert before - _resident() < 16 << 20  # kept by malloc, still resident
    bench._settle()
    assert before - _resident() > 32 << 20
    del top


def _scale_result(restore: dict[int, list[float]], floor: dict[int, list[float]],
                  save_s: list[float], floor_s: list[float]) -> dict:
    sizes = [{"mib": mib, "bytes": mib << 20, "save_s": [1.0] * len(restore[mib]),
              "restore_s": restore[mib], "floor_s": floor[mib], "save_extra": [0],
              "restore_extra": [0]} for mib in sorted(restore)]
    return {"sizes": sizes, "saves": {"rss": [1 << 30] * len(save_s), "save_s": save_s,
                                      "floor_s": floor_s}}


def test_scale_targets_hold_restore_and_saves_against_floors_taken_beside_them():
    """The disk's own drift and new memory's growing cost (both measured beside each row)
    are not the library's: restore / read floor per round, largest size against 1 GiB,
    and the saves' drift over the raw write floor taken after each of them."""
    from jaxckpt.tools.bench.scale import ScaleConfig, scale_targets

    # Restore per GiB doubles from 1 to 4 GiB, and so does the floor beside it, round by
    # round; the saves drift by half, and so does the write floor after each.
    restore = {1024: [1.0, 2.0], 4096: [8.0, 16.0]}
    floor = {1024: [0.5, 1.0], 4096: [4.0, 8.0]}
    save_s = [1.0] * 10 + [1.5] * 10
    targets = {t["target"]: t for t in scale_targets(
        ScaleConfig(saves=20, leaf_mb=64),
        _scale_result(restore, floor, save_s, [t / 2 for t in save_s]))}

    raw = targets["restore time per GiB, 4096 MiB / 1024 MiB"]
    assert raw["value"] == pytest.approx(2.0) and raw["met"] is False
    relative = targets["restore / read floor of the same size, 4096 MiB / 1024 MiB"]
    assert relative["spread"] == pytest.approx([1.0, 1.0]) and relative["met"] is True
    drift = targets["save time, last 10 saves / 10 after the first 5"]
    assert drift["met"] is False
    own = targets["save / raw write floor after it, last 10 saves / 10 after the first 5"]
    assert own["value"] == pytest.approx(1.0) and own["met"] is True


def test_write_floor_keeps_the_previous_copy_until_the_new_one_is_written(tmp_path,
                                                                         monkeypatch):
    """The floor writes as the manager does with keep_last_n=1: a new directory each
    time, the previous copy deleted only after the new one is durable."""
    import numpy as np

    from jaxckpt.tools.bench import floors
    from jaxckpt.tools.bench.scale import _FloorWriter

    root = tmp_path / "floor"
    during: list[list[str]] = []

    def recorder(real):
        def recording(path, data):
            if "copy_" in str(path):  # not the O_DIRECT probe
                during.append(sorted(p.name for p in root.iterdir()))
            return real(path, data)
        return recording

    for name in ("_raw_write_direct", "_raw_write"):
        monkeypatch.setattr(floors, name, recorder(getattr(floors, name)))
    state = {f"layer_{i}": {"w": np.arange(1000 + i, dtype=np.float32)} for i in range(3)}
    writer = _FloorWriter(state, str(root))
    after: list[list[str]] = []
    try:
        for _ in range(3):
            assert writer.write() > 0
            after.append(sorted(p.name for p in root.iterdir()))
        for index, leaf in enumerate(state.values()):
            data = np.fromfile(root / "copy_00002" / f"leaf_{index:05d}", dtype=np.uint8)
            assert bytes(data[:leaf["w"].nbytes]) == leaf["w"].tobytes()
    finally:
        writer.close()
    assert during == [["copy_00000"]] * 3 + [["copy_00000", "copy_00001"]] * 3 + [
        ["copy_00001", "copy_00002"]] * 3
    assert after == [["copy_00000"], ["copy_00001"], ["copy_00002"]]
    assert not root.exists()

def test_restore_and_its_floor_each_start_right_after_new_memory_was_freed(tmp_path,
                                                                           monkeypatch):
    """The second of the two rows reads into the memory the first freed a moment before;
    the first met what the saves left, at 4 GiB memory the VM's host had taken back
    (docs/performance.md, Eleventh round (scale4g)). Each row, whichever goes first,
    follows a primer of its own size, after the page cache is dropped."""
    from types import SimpleNamespace

    from jaxckpt.tools.bench import scale as bench_scale

    events: list[tuple[str, int] | str] = []
    state_dir = tmp_path / "step" / "state"
    state_dir.mkdir(parents=True)
    (state_dir / "leaf").write_bytes(b"x" * 8192)
    monkeypatch.setattr(bench_scale, "_drop_page_cache", lambda: events.append("drop"))
    monkeypatch.setattr(bench_scale, "_prime_new_memory",
                        lambda nbytes: events.append(("prime", nbytes)))
    monkeypatch.setattr(bench_scale, "_read_fresh",
                        lambda path, size: events.append("floor") or bytearray(size))
    saver = SimpleNamespace(manager=SimpleNamespace(
        restore=lambda like: events.append("restore") or {}))
    found: dict[str, list[float]] = {"restore_s": [], "floor_s": [], "restore_extra": []}
    for turn in (0, 1):
        bench_scale._restore_and_floor(saver, {}, str(tmp_path / "step"), 8192, found, turn)

    row = [("prime", 8192)]
    assert events == (["drop", *row, "restore", "drop", *row, "floor"]
                      + ["drop", *row, "floor", "drop", *row, "restore"])
    assert len(found["restore_s"]) == len(found["floor_s"]) == 2


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="no /proc")
def test_memory_primer_faults_in_every_page_and_frees_it():
    import resource

    from jaxckpt.tools.bench.scale import _prime_new_memory

    nbytes = 32 << 20
    before_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    before = _resident()
    _prime_new_memory(nbytes)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before_faults
    assert faults >= nbytes // 4096, "every page of the primer is faulted in"
    assert _resident() - before < 4 << 20, "and freed before the row starts"


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="no /proc")
def test_read_floors_read_into_the_memory_a_restore_hands_over(tmp_path, monkeypatch):
    """A read floor reads into the kind of memory a restore reads into (``fresh_blocks``,
    not advised to use huge pages), not numpy's: numpy's huge pages cost 0.5x to 2.5x the
    restore's memory on this VM depending on how long ago they were freed, so a floor in
    them measured the memory's history (docs/performance.md, Tenth round (rawread))."""
    import os

    import numpy as np

    from jaxckpt.storage import buffers
    from jaxckpt.tools import bench

    from support.memory import mapping_flags, numpy_huge_page_advice

    handed: list[tuple[int, int]] = []
    real_fresh = buffers.fresh_blocks

    def spy(nbytes):
        blocks = real_fresh(nbytes)
        handed.append((blocks.ctypes.data, blocks.ctypes.data + blocks.nbytes))
        return blocks

    monkeypatch.setattr(buffers, "fresh_blocks", spy)
    nbytes = 8 << 20  # numpy advises huge pages from 4 MiB on
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    path = tmp_path / "leaf"
    path.write_bytes(data.tobytes())
    readers = [bench._raw_read]
    if bench._direct_refused(str(tmp_path)) == "":
        readers.append(bench._raw_read_direct)
    with numpy_huge_page_advice():
        for read in readers:
            handed.clear()
            out = read(str(path), nbytes)
            np.testing.assert_array_equal(out, data)
            address = out.ctypes.data
            assert any(start <= address < end for start, end in handed), read.__name__
            assert "hg" not in mapping_flags(address), read.__name__
        handed.clear()
        bench._touch_fresh(nbytes)  # the "page faults" row touches the same kind
        assert len(handed) == 1
        if bench._raw_read_direct in readers:  # the row shown beside it: numpy's memory
            out = bench._raw_read_direct(str(path), nbytes, numpy_memory=True)
            np.testing.assert_array_equal(out, data)
            assert "hg" in mapping_flags(out.ctypes.data)
    os.unlink(path)


def test_read_floors_read_on_as_many_threads_as_a_restore():
    """Into the restore's 4 KiB pages a read on 4 threads took 0.54 s where 8 took 0.40 s
    (512 MiB): a floor on fewer threads than the restore would be a slower floor."""
    from jaxckpt.backends.orbax.options import OrbaxOptions
    from jaxckpt.tools import bench

    assert bench._READ_THREADS == OrbaxOptions().read_threads


LAGGING_EXIT = """\
import os, sys, threading
from jaxckpt.tools.bench import multiprocess as bench_multiprocess

exit_now = os._exit


def exit_late(code):
    threading.Event().wait(2.0)  # this process leaves 2 s after process 0
    exit_now(code)


os._exit = exit_late
bench_multiprocess.main(sys.argv[1:])
"""


def test_the_two_process_bench_worker_that_leaves_last_exits_cleanly(tmp_path):
    """The 2-process bench row: process 0 hosts jax.distributed's coordination service, and
    a process still connected when it exits aborts (SIGABRT) once it lags by more than about
    0.1 s. Process 1 is made to leave 2 s late: both must still exit 0 with a report."""
    port = str(free_port())
    env = repo_env({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
                   JAX_PLATFORMS="cpu")
    args = ["--count", "2", "--port", port, "--root", str(tmp_path / "root"), "--size-mb", "1"]
    workers = [Worker([sys.executable, "-m", "jaxckpt.tools.bench.multiprocess", "--index", "0",
                       *args], env=env, timeout_s=180),
               Worker([sys.executable, "-c", LAGGING_EXIT, "--index", "1", *args], env=env,
                      timeout_s=180)]
    codes, outputs = run_all(workers)
    assert codes == [0, 0], "\n---\n".join(output[-3000:] for output in outputs)
    assert all("REPORT " in output for output in outputs)
