"""CheckpointManager over the real Orbax backend: triggers, reports, retention, recovery."""

import json
import os
import random
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt import (
    CheckpointManager,
    CheckpointNotFoundError,
    CheckpointWarning,
    ConfigError,
    Every,
    ExportConfig,
    RecoverConfig,
    RootLockedError,
    StepInfo,
)
from jaxckpt.core.layout import COMMIT_MARKER

from support.loaders import Loader


def tree(value=0.0):
    return {"w": jnp.full((8, 4), value, jnp.float32), "b": jnp.arange(4, dtype=jnp.int32),
            "key": jax.random.key(7)}


def like():
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree())


def run_steps(mgr, steps, spe=None, loader=None, every_value=True):
    info = StepInfo(0, 0, 0, spe)
    saved = []
    for _ in range(steps):
        if loader is not None:
            loader.position += 1
        reports = mgr.maybe_save(info, tree(float(info.global_step)),
                                 stateful={"loader": loader} if loader else None,
                                 metrics={"loss": 1.0 / (info.global_step + 1)})
        saved += [(r.kind, r.step) for r in reports]
        info = info.next()
    return saved, info


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_saves_on_trigger_and_reports_what_they_cost(tmp_path, mode):
    seen = []
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=3), keep_last_n=None),
                           mode=mode, on_report=seen.append) as mgr:
        saved, _ = run_steps(mgr, 10)
        mgr.wait()
    assert saved == [("recover", 2), ("recover", 5), ("recover", 8)]
    assert [r.step for r in seen] == [2, 5, 8]
    for report in seen:
        assert report.done() and report.error is None and report.mode == mode
        assert 0 < report.blocking_s <= report.total_s
        assert report.bytes > 8 * 4 * 4 and report.bandwidth_gbps > 0
        assert report.path.endswith(f"step_{report.step:08d}")
        assert os.path.exists(os.path.join(report.path, COMMIT_MARKER))
        assert report.metrics()["time/saving"] == report.blocking_s
        manifest = json.load(open(os.path.join(report.path, COMMIT_MARKER)))
        assert manifest["total_bytes"] == report.bytes


def test_epoch_trigger_fires_at_epoch_end(tmp_path):
    with CheckpointManager(tmp_path,
                           recover=RecoverConfig(every=Every(epochs=1), keep_last_n=None)) as mgr:
        saved, _ = run_steps(mgr, 9, spe=4)
    assert saved == [("recover", 3), ("recover", 7)]


def test_recover_restores_state_counters_loader_and_rng(tmp_path):
    loader = Loader()
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=5))) as mgr:
        assert mgr.recover(like(), stateful={"loader": loader}) is None
        random.seed(3)
        np.random.seed(4)
        run_steps(mgr, 5, spe=3, loader=loader)
        expected_draws = (random.random(), np.random.rand())
    random.seed(0)
    np.random.seed(0)
    fresh = Loader()
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=5))) as mgr:
        result = mgr.recover(like(), stateful={"loader": fresh})
    assert result.step_info == StepInfo(1, 1, 4, 3)
    assert result.step_info.next() == StepInfo(1, 2, 5, 3)
    assert fresh.position == 5
    assert (random.random(), np.random.rand()) == expected_draws
    assert result.metrics == {"loss": 0.2}
    np.testing.assert_array_equal(result.state["w"], np.full((8, 4), 4.0, np.float32))
    assert jax.random.key_impl(result.state["key"]) == jax.random.key_impl(jax.random.key(0))
    assert bool((jax.random.key_data(result.state["key"]) ==
                 jax.random.key_data(jax.random.key(7))).all())


def test_stateful_given_to_recover_is_saved_by_later_saves(tmp_path):
    loader = Loader()
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=2))) as mgr:
        mgr.recover(like(), stateful={"loader": loader})
        loader.position = 42
        mgr.maybe_save(StepInfo(0, 1, 1), tree())
    fresh = Loader()
    with CheckpointManager(tmp_path) as mgr:
        mgr.recover(like(), stateful={"loader": fresh})
    assert fresh.position == 42


@pytest.mark.parametrize("keep, expected", [(None, [1, 3, 5, 7]), (1, [7]), (2, [5, 7])])
def test_retention_keeps_latest_n_committed(tmp_path, keep, expected):
    with CheckpointManager(tmp_path,
                           recover=RecoverConfig(every=Every(steps=2), keep_last_n=keep)) as mgr:
        run_steps(mgr, 8)
    assert CheckpointManager.committed_steps.__get__(mgr)() == expected
    assert sorted(os.listdir(tmp_path / "recover")) == [f"step_{s:08d}" for s in expected]


def test_keep_last_zero_writes_only_forced_saves(tmp_path):
    with CheckpointManager(tmp_path, recover=RecoverConfig(keep_last_n=0)) as mgr:
        saved, info = run_steps(mgr, 4)
        assert saved == []
        mgr.save(StepInfo(0, 3, 3), tree())
        assert mgr.maybe_save(StepInfo(0, 4, 4), tree()) == []
        mgr.save(StepInfo(0, 4, 4), tree())
        mgr.wait()
        assert mgr.committed_steps() == [4]


@pytest.mark.parametrize("mode", ["off", "disabled"])
def test_recovery_off_writes_nothing_and_never_resumes(tmp_path, mode):
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1))) as mgr:
        run_steps(mgr, 2)
    with CheckpointManager(tmp_path, recover=RecoverConfig(mode=mode, every=Every(steps=1))) as mgr:
        assert mgr.recover(like()) is None
        saved, _ = run_steps(mgr, 3)
        assert saved == []
        # explicit restore still works whatever the mode
        assert mgr.restore(like()).step_info.global_step == 1


def test_forced_save_of_an_already_saved_step_returns_that_report(tmp_path):
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=2))) as mgr:
        (report,) = mgr.maybe_save(StepInfo(0, 1, 1), tree())
        assert mgr.save(StepInfo(0, 1, 1), tree()) is report


def test_second_job_on_the_same_root_is_refused(tmp_path):
    with CheckpointManager(tmp_path):
        with pytest.raises(RootLockedError, match="in use by another running job"):
            CheckpointManager(tmp_path)
    CheckpointManager(tmp_path).close()  # released on close


def test_partial_checkpoint_is_cleaned_and_never_restored(tmp_path):
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=2))) as mgr:
        run_steps(mgr, 2)
    partial = tmp_path / "recover" / "step_00000003"
    (partial / "state").mkdir(parents=True)
    (partial / "driver.json").write_text("{}")
    with CheckpointManager(tmp_path) as mgr:
        assert not partial.exists()
        assert mgr.recover(like()).step_info.global_step == 1


def test_corrupt_newest_falls_back_with_a_warning_naming_it(tmp_path):
    with CheckpointManager(tmp_path,
                           recover=RecoverConfig(every=Every(steps=2), keep_last_n=3)) as mgr:
        run_steps(mgr, 4)
    newest = tmp_path / "recover" / "step_00000003"
    victim = next(p for p in (newest / "state").rglob("*") if p.is_file() and p.stat().st_size > 64)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with CheckpointManager(tmp_path,
                           recover=RecoverConfig(every=Every(steps=2), keep_last_n=3)) as mgr:
        with pytest.warns(CheckpointWarning, match=r"step_00000003.*crc32"):
            result = mgr.recover(like())
        assert result.step_info.global_step == 1
        assert result.skipped and "step_00000003" in result.skipped[0]
        # the corrupt one is moved aside so redoing step 3 can save there again
        assert not newest.exists()
        mgr.maybe_save(StepInfo(0, 3, 3), tree(3.0))
        mgr.wait()
        assert mgr.committed_steps() == [1, 3]


def test_restore_of_a_missing_step_lists_available_steps(tmp_path):
    with CheckpointManager(tmp_path,
                           recover=RecoverConfig(every=Every(steps=2), keep_last_n=None)) as mgr:
        run_steps(mgr, 4)
        with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint for step 2.*\[1, 3\]"):
            mgr.restore(like(), step=2)
        assert mgr.restore(like(), step=1).step_info.global_step == 1


def test_restore_with_nothing_saved_raises_not_found(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="no valid recovery checkpoint"):
            mgr.restore(like())


def test_redoing_steps_after_restoring_an_older_one_keeps_the_discarded_future(tmp_path):
    with CheckpointManager(tmp_path,
                           recover=RecoverConfig(every=Every(steps=2), keep_last_n=None)) as mgr:
        run_steps(mgr, 4)
        mgr.restore(like(), step=1)
        with pytest.warns(CheckpointWarning, match="moved to"):
            mgr.save(StepInfo(0, 3, 3), tree(-1.0))
        mgr.wait()
    assert len(os.listdir(tmp_path / "recover" / "superseded")) == 1
    with CheckpointManager(tmp_path) as mgr:
        assert float(mgr.recover(like()).state["w"][0, 0]) == -1.0


def test_bad_arguments_name_the_parameter(tmp_path):
    with pytest.raises(ConfigError, match="recover must be a jaxckpt.RecoverConfig"):
        CheckpointManager(tmp_path, recover={"every": 10})
    with pytest.raises(ConfigError, match="mode must be one of"):
        CheckpointManager(tmp_path / "a", mode="fast")
    with CheckpointManager(tmp_path / "b") as mgr:
        with pytest.raises(ConfigError, match="step_info must be a jaxckpt.StepInfo"):
            mgr.maybe_save(10, tree())
        with pytest.raises(ConfigError, match=r"stateful\['loader'\]"):
            mgr.save(StepInfo(), tree(), stateful={"loader": object()})


def test_closed_manager_refuses_work(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.close()
    mgr.close()  # idempotent
    with pytest.raises(jaxckpt.CheckpointError, match="closed"):
        mgr.save(StepInfo(), tree())


def test_export_runs_on_its_own_cadence_into_named_dirs(tmp_path):
    calls = []

    def exporter(state, out_dir):
        calls.append(out_dir)
        np.save(os.path.join(out_dir, "w.npy"), np.asarray(state["w"]), allow_pickle=False)

    config = ExportConfig(every=Every(steps=4), exporter=exporter, keep_last_n=1)
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=3)),
                           export=config) as mgr:
        saved, _ = run_steps(mgr, 8, spe=4)
    assert saved == [("recover", 2), ("export", 3), ("recover", 5), ("export", 7)]
    assert all(os.path.basename(c).startswith(".tmp-") for c in calls)
    assert sorted(os.listdir(tmp_path / "export")) == ["epoch1epochstep3globalstep7"]
    np.testing.assert_array_equal(
        np.load(tmp_path / "export" / "epoch1epochstep3globalstep7" / "w.npy"),
        np.full((8, 4), 7.0, np.float32))


def test_failing_exporter_surfaces_at_next_call_and_leaves_no_half_export(tmp_path):
    def exporter(state, out_dir):
        open(os.path.join(out_dir, "half.bin"), "wb").write(b"x")
        raise OSError("disk on fire")

    config = ExportConfig(every=Every(steps=1), exporter=exporter, mode="async")
    mgr = CheckpointManager(tmp_path, export=config)
    mgr.maybe_save(StepInfo(), tree())
    with pytest.raises(jaxckpt.CheckpointWriteError,
                       match="export save of step 0.*disk on fire") as info:
        mgr.wait()
    assert isinstance(info.value.__cause__, OSError)
    mgr.close()
    assert [n for n in os.listdir(tmp_path / "export") if not n.startswith(".tmp-")] == []
    CheckpointManager(tmp_path).close()  # start-up cleanup removes the debris
    assert os.listdir(tmp_path / "export") == []


WRITE_FAILURE = textwrap.dedent("""
    import os, resource, signal, sys, warnings
    import jax.numpy as jnp
    import jaxckpt
    from jaxckpt import CheckpointManager, RecoverConfig, Every, StepInfo
    root, policy = sys.argv[1], sys.argv[2]
    mgr = CheckpointManager(root, recover=RecoverConfig(every=Every(steps=1), keep_last_n=1),
                            mode="async", on_write_error=policy)
    mgr.save(StepInfo(0, 0, 0), {"w": jnp.ones((16,), jnp.float32)}).wait()
    # From now on no file may grow past 64 KiB: the next save fails for real in the background.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
    big = {"w": jnp.ones((1 << 20,), jnp.float32)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = mgr.maybe_save(StepInfo(0, 1, 1), big)[0]
        try:
            mgr.maybe_save(StepInfo(0, 2, 2), big)
            print("NO-RAISE", [str(w.message)[:200] for w in caught])
        except jaxckpt.CheckpointWriteError as exc:
            print("RAISED", exc, "| CAUSE", type(exc.__cause__).__name__)
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.mark.parametrize("policy", ["raise", "warn"])
def test_background_write_failure_is_raised_at_next_call_and_earlier_checkpoint_survives(
        tmp_path, policy):
    script = tmp_path / "fail.py"
    script.write_text(WRITE_FAILURE)
    root = tmp_path / "root"
    out = subprocess.run([sys.executable, str(script), str(root), policy], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    if policy == "raise":
        assert "RAISED recover save of step 1" in out.stdout, out.stdout + out.stderr[-2000:]
        assert "step_00000001" in out.stdout
    else:
        assert "NO-RAISE" in out.stdout and "save of step 1" in out.stdout, out.stdout
    # Step 0 is still the latest valid checkpoint; step 1 never committed.
    with CheckpointManager(root) as mgr:
        assert mgr.committed_steps()[0] == 0
        result = mgr.recover({"w": jax.ShapeDtypeStruct((16,), jnp.float32)})
    assert result.step_info.global_step in (0, 2)
    assert not os.path.exists(root / "recover" / "step_00000001")


def test_saving_the_step_just_restored_does_not_rewrite_it(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(StepInfo(0, 5, 5), tree(5.0))
    marker = tmp_path / "recover" / "step_00000005" / COMMIT_MARKER
    before = marker.stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        with CheckpointManager(tmp_path) as mgr:
            result = mgr.recover(like())
            report = mgr.save(result.step_info, result.state, mode="sync")
    assert report.done() and report.bytes > 0 and report.step == 5
    assert marker.stat().st_mtime_ns == before
    assert not (tmp_path / "recover" / "superseded").exists()


def test_sync_save_runs_retention_off_the_training_thread(tmp_path):
    import threading

    from jaxckpt.commit.store import CheckpointStore

    threads = []
    original = CheckpointStore.delete

    def spy(self, path):
        threads.append(threading.current_thread().name)
        return original(self, path)

    CheckpointStore.delete = spy
    try:
        with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=1), keep_last_n=1),
                               mode="sync") as mgr:
            run_steps(mgr, 3)
            mgr.wait()
            assert mgr.committed_steps() == [2]
    finally:
        CheckpointStore.delete = original
    assert threads and all(name.startswith("jaxckpt-commit") for name in threads)


def test_error_seen_through_report_wait_is_not_raised_twice(tmp_path):
    def exporter(state, out_dir):
        raise OSError("no space left on device")

    mgr = CheckpointManager(tmp_path, export=ExportConfig(every=Every(steps=1), exporter=exporter,
                                                          mode="async"))
    (report,) = mgr.maybe_save(StepInfo(), tree())
    with pytest.raises(jaxckpt.CheckpointWriteError, match="no space left"):
        report.wait()
    # The next call does not raise step 0's error again; the second export fails too ...
    mgr.maybe_save(StepInfo(0, 1, 1), tree())
    with pytest.raises(jaxckpt.CheckpointWriteError, match="step 1"):  # ... and is raised once
        mgr.close()


def test_a_function_as_state_is_called_only_when_a_save_is_due(tmp_path):
    calls = []

    def build(value):
        calls.append(value)
        return tree(value)

    export_dir = []
    export = ExportConfig(every=Every(steps=4),
                          exporter=lambda state, out: export_dir.append(float(state["w"][0, 0])))
    with CheckpointManager(tmp_path, recover=RecoverConfig(every=Every(steps=3), keep_last_n=None),
                           export=export, mode="sync") as mgr:
        info = StepInfo(0, 0, 0)
        for _ in range(8):
            value = float(info.global_step)
            mgr.maybe_save(info, lambda value=value: build(value))
            info = info.next()
        # A forced save takes a function too (no step: the last completed one, 7).
        mgr.save(state=lambda: build(99.0))
        mgr.wait()
        # Steps 2 and 5 (recovery), 3 and 7 (export), the final save: one call each.
        assert calls == [2.0, 3.0, 5.0, 7.0, 99.0]
        assert export_dir == [3.0, 7.0]
        recovered = mgr.recover(like())
    assert recovered.step_info.global_step == 7
    assert float(recovered.state["w"][0, 0]) == 99.0


def test_a_forced_save_of_a_step_already_saved_does_not_build_the_state(tmp_path):
    with CheckpointManager(tmp_path, recover=RecoverConfig(keep_last_n=None), mode="sync") as mgr:
        first = mgr.save(StepInfo(0, 3, 3), tree(3.0))
        calls = []
        again = mgr.save(StepInfo(0, 3, 3), lambda: calls.append(1) or tree(4.0))
    assert again is first and calls == []
