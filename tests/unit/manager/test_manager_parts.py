"""The parts of CheckpointManager, each on its own: no full manager, no array backend.

The pipeline with fake save functions, the preemption agreement with fake broadcasts, the
root preparation, export and recovery retention on a real filesystem.
"""

import os
import signal
import threading
import time
import warnings

import pytest

from jaxckpt import (
    CheckpointWarning,
    CheckpointWriteError,
    Every,
    ExportConfig,
    RecoverConfig,
    StepInfo,
)
from jaxckpt.backends.base import BackendFeatures, SingleProcess
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.commit.verification import Verifier, plan
from jaxckpt.core.layout import COMMIT_MARKER, export_dirname
from jaxckpt.core.policy import SaveTrigger
from jaxckpt.errors import CheckpointCorruptError, CheckpointNotFoundError, RootLockedError
from jaxckpt.manager.background import SavePipeline
from jaxckpt.manager.context import ManagerContext
from jaxckpt.manager.export import Exporter
from jaxckpt.manager.preemption import Preemption
from jaxckpt.manager.reports import SaveReport
from jaxckpt.manager.root import prepare_root
from jaxckpt.manager.save import Saver


def pipeline(**kwargs):
    options = dict(on_report=None, on_write_error="raise", clock=time.monotonic,
                   commit_timeout_s=5.0)
    options.update(kwargs)
    return SavePipeline(**options)


def report(step=3, mode="sync", kind="recover"):
    return SaveReport(kind=kind, step=step, path=f"/ckpt/step_{step}", mode=mode,
                      reason="forced")


def fail():
    raise OSError(28, "No space left on device")


# ------------------------------------------------------------------------------- pipeline


def test_a_failed_sync_save_raises_at_once_chained_to_its_cause_and_runs_its_cleanup():
    cleaned = threading.Event()
    jobs = pipeline()
    saved = report(mode="sync")
    with pytest.raises(CheckpointWriteError, match=r"recover save of step 3 to /ckpt/step_3 "
                                                   r"failed: OSError") as caught:
        jobs.run(saved, fail, time.perf_counter(), after=pytest.fail,
                 on_failure=cleaned.set)
    assert isinstance(caught.value.__cause__, OSError)
    assert saved.done() and isinstance(saved.error, OSError) and saved.total_s is not None
    jobs.drain()
    assert cleaned.is_set(), "the partial directory's cleanup did not run"
    jobs.raise_unraised()  # raised once already: not again
    jobs.shutdown()


def test_a_failed_async_save_is_raised_by_the_next_call_only_once():
    jobs = pipeline()
    saved = report(mode="async")
    jobs.run(saved, fail, time.perf_counter())
    jobs.drain()
    assert saved.done() and saved.error is not None
    with pytest.raises(CheckpointWriteError, match="step 3"):
        jobs.raise_unraised()
    jobs.raise_unraised()
    with pytest.raises(CheckpointWriteError):
        saved.wait()  # the report itself still says what happened
    jobs.shutdown()


def test_a_failure_raised_by_report_wait_is_not_raised_again_by_the_pipeline():
    jobs = pipeline()
    saved = report(mode="async")
    jobs.run(saved, fail, time.perf_counter())
    with pytest.raises(CheckpointWriteError):
        saved.wait(timeout=5.0)
    jobs.drain()
    jobs.raise_unraised()
    jobs.shutdown()


def test_with_on_write_error_warn_a_failure_is_a_warning_naming_the_step():
    jobs = pipeline(on_write_error="warn")
    saved = report(step=7, mode="async")
    jobs.run(saved, fail, time.perf_counter())
    jobs.drain()
    with pytest.warns(CheckpointWarning, match="recover save of step 7 .* failed"):
        jobs.raise_unraised()
    jobs.shutdown()


def test_a_save_that_fails_to_start_is_reported_like_a_background_failure():
    cleaned = threading.Event()
    jobs = pipeline()
    saved = report()
    with pytest.raises(CheckpointWriteError, match="No space left"):
        jobs.failed_to_start(saved, OSError(28, "No space left on device"),
                             time.perf_counter(), cleaned.set)
    assert saved.done() and saved.blocking_s == saved.total_s
    jobs.drain()
    assert cleaned.is_set()
    jobs.shutdown()


def test_a_successful_save_reports_then_runs_housekeeping_on_the_background_thread():
    seen, housekeeping = [], []
    jobs = pipeline(on_report=seen.append)
    saved = report(mode="sync")
    jobs.run(saved, lambda: None, time.perf_counter(),
             after=lambda: housekeeping.append(threading.current_thread().name),
             on_failure=pytest.fail)
    jobs.drain()
    assert seen == [saved] and saved.done() and saved.blocking_s == saved.total_s
    assert housekeeping and housekeeping[0].startswith("jaxckpt-commit")
    jobs.shutdown()


def test_a_raising_on_report_hook_or_retention_never_fails_the_save():
    def bad_hook(_):
        raise RuntimeError("logger down")

    def bad_retention():
        raise OSError("busy")

    jobs = pipeline(on_report=bad_hook)
    saved = report(mode="async")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jobs.run(saved, lambda: None, time.perf_counter(), after=bad_retention)
        jobs.drain()
    jobs.raise_unraised()
    assert saved.error is None and saved.done()
    assert any("retention after /ckpt/step_3 failed" in str(w.message) for w in record)
    jobs.shutdown()


def test_wait_for_gives_up_after_the_commit_timeout():
    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]

    jobs = pipeline(clock=clock, commit_timeout_s=3.0)
    with pytest.raises(TimeoutError, match="gave up after 3.0 s waiting for the primary"):
        jobs.wait_for(lambda: False, "the primary")
    jobs.wait_for(lambda: True, "nothing")
    jobs.shutdown()


# ----------------------------------------------------------------------------- preemption


def test_a_single_process_keeps_its_own_decision_without_a_broadcast():
    decide = Preemption(process_count=1, broadcast=pytest.fail, timed=True)
    assert decide.agree("steps", None, False) == ("steps", None, False)
    assert decide.agree(None, "epochs", True) == (None, "epochs", True)


def test_processes_take_the_primarys_decision_when_time_triggers_are_set():
    sent = []

    def primary_says(bits):
        sent.append(bits)
        return 0b111  # the primary: recover, export and preempt

    decide = Preemption(process_count=2, broadcast=primary_says, timed=True)
    assert decide.agree(None, None, False) == ("seconds", "seconds", True)
    assert decide.agree("steps", None, False) == ("steps", "seconds", True)
    assert sent == [0, 1]
    nothing = Preemption(process_count=2, broadcast=lambda bits: 0, timed=True)
    assert nothing.agree("seconds", "seconds", True) == (None, None, False)


def test_every_process_learns_the_primarys_signal_to_end_by():
    # A process the scheduler's signal did not reach still ends by the primary's signal.
    primary = Preemption(process_count=2, broadcast=lambda bits: bits, timed=True)
    primary.request(signal.SIGTERM)
    assert primary.agree(None, None, primary.requested) == (None, None, True)
    assert primary.cause == signal.SIGTERM
    sent = []
    other = Preemption(process_count=2, timed=True,
                       broadcast=lambda bits: sent.append(bits) or 4 | signal.SIGTERM << 3)
    assert other.agree(None, None, other.requested) == (None, None, True)
    assert sent == [0] and other.cause == signal.SIGTERM
    single = Preemption(process_count=1, broadcast=pytest.fail, timed=False)
    single.request()  # request_preemption_save() without a signal: nothing to end by
    assert single.agree(None, None, single.requested)[2] and single.cause == 0


def test_on_preemption_accepts_exit_or_continue_and_names_both(tmp_path):
    from jaxckpt import CheckpointManager, ConfigError

    with pytest.raises(ConfigError, match=r"on_preemption must be 'exit' .* or 'continue'"):
        CheckpointManager(tmp_path / "root", backend=SingleProcess(), on_preemption="stop")
    assert not (tmp_path / "root").exists()


def test_step_triggers_without_signal_handlers_agree_without_a_broadcast():
    decide = Preemption(process_count=4, broadcast=pytest.fail, timed=False)
    assert decide.agree("steps", None, False) == ("steps", None, False)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers are installed from the main thread only")
def test_a_signal_is_recorded_as_a_request_and_the_old_handler_comes_back():
    previous = signal.getsignal(signal.SIGUSR1)
    decide = Preemption(process_count=1, broadcast=pytest.fail, timed=False)
    decide.install((signal.SIGUSR1,))
    try:
        assert not decide.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert decide.requested and not decide.preempted
        decide.mark_preempted()
        assert decide.preempted and not decide.requested
    finally:
        decide.restore()
    assert signal.getsignal(signal.SIGUSR1) == previous


# ------------------------------------------------------------- root, retention, verification


def context(root, *, recover=None, export=None):
    recover = recover or RecoverConfig()
    return ManagerContext(
        store=CheckpointStore(root), backend=SingleProcess(), recover_config=recover,
        export_config=export, process_index=0, process_count=1,
        recover_trigger=SaveTrigger(recover.every),
        export_trigger=SaveTrigger(export.every) if export else None)


def test_a_second_job_is_refused_the_root_until_the_first_lets_go(tmp_path):
    store = CheckpointStore(tmp_path / "root")
    os.makedirs(store.step_path(4))  # an interrupted save
    lock = prepare_root(store)
    assert not os.path.exists(store.step_path(4)), "partial checkpoint left behind"
    with pytest.raises(RootLockedError, match="in use by another running job"):
        prepare_root(store)
    lock.release()
    prepare_root(store).release()


def write_export(state, out_dir):
    with open(os.path.join(out_dir, "model.bin"), "wb") as handle:
        handle.write(b"x" * state)
    return state


def test_exports_keep_the_newest_keep_last_n(tmp_path):
    export = ExportConfig(every=Every(steps=1), exporter=write_export, mode="sync",
                          keep_last_n=2)
    ctx = context(tmp_path, export=export)
    ctx.store.ensure_dirs()
    jobs = pipeline()
    exporter = Exporter(ctx, jobs, mode="sync")
    for step in range(4):
        saved = exporter.save(StepInfo(0, step, step, None), 10 + step, "steps")
        assert saved.done() and saved.bytes == 10 + step
    jobs.drain()
    jobs.shutdown()
    assert [step for step, _ in ctx.store.export_entries()] == [2, 3]
    assert sorted(os.listdir(ctx.store.export_dir)) == [export_dirname(0, 2, 2),
                                                        export_dirname(0, 3, 3)]


def commit_step(store, step):
    path = store.step_path(step)
    os.makedirs(os.path.join(path, "state"))
    with open(os.path.join(path, "state", "data"), "wb") as handle:
        handle.write(b"\0" * 8)
    store.commit(path, step)


def test_recovery_retention_keeps_the_newest_and_any_checkpoint_being_read(tmp_path):
    ctx = context(tmp_path, recover=RecoverConfig(keep_last_n=1))
    ctx.store.ensure_dirs()
    for step in range(4):
        commit_step(ctx.store, step)
    ctx.reading.add(1)  # being restored right now
    jobs = pipeline()
    saver = Saver(ctx, jobs, mode="sync", item_cadences={}, export_record=None)
    saver.apply_retention()
    jobs.shutdown()
    assert ctx.store.committed_steps() == [1, 3]


def test_checksums_of_bulk_files_are_deferred_unless_the_backend_reads_in_place(tmp_path):
    class InPlace(SingleProcess):
        features = BackendFeatures(reads_in_place=True)

    checks = RecoverConfig(verify="checksums")
    deferred = plan(checks, SingleProcess(), {"ref": None})
    assert deferred.checksums and deferred.defer_over is not None
    assert deferred.deferred_items == frozenset({"ref"})
    upfront = plan(checks, InPlace(), {"ref": None})
    assert upfront.checksums and upfront.defer_over is None and not upfront.deferred_items
    sizes = plan(RecoverConfig(verify="sizes"), SingleProcess(), None)
    assert not sizes.checksums and sizes.defer_over is None


def test_a_requested_step_that_was_never_committed_is_named_with_the_steps_there_are(tmp_path):
    ctx = context(tmp_path)
    ctx.store.ensure_dirs()
    commit_step(ctx.store, 2)
    verifier = Verifier(ctx.store, primary=True)
    checks = plan(ctx.recover_config, ctx.backend, None)
    assert verifier.check_requested(2, checks) == 2
    with pytest.raises(CheckpointNotFoundError,
                       match=r"no checkpoint for step 5 .* committed steps are \[2\]"):
        verifier.check_requested(5, checks)
    os.remove(os.path.join(ctx.store.step_path(2), "state", "data"))
    assert os.path.exists(os.path.join(ctx.store.step_path(2), COMMIT_MARKER))
    with pytest.raises(CheckpointCorruptError, match="failed verification"):
        verifier.check_requested(2, checks)
