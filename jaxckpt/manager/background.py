"""The save pipeline's thread and its error propagation.

Owns: ``SavePipeline``: the manager's one background thread (commits, exports, deletions,
strictly in order); running the rest of a save inline (sync) or there (async), then its
retention there in both modes; the ``on_report`` hook; each failure recorded on its report
and raised at the next call as ``CheckpointWriteError`` (or warned); ``wait_for``, the
bounded wait of a commit for the other processes.

Must not import: jax, orbax, torch, or the other parts of the manager: what a save does is
handed in as functions, so the pipeline is tested with fakes.

Concurrency: called from the training thread; jobs run on the background thread. The list
of failed reports, under the pipeline's lock, is the only state both threads touch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

from jaxckpt.errors import CheckpointWarning
from jaxckpt.manager.reports import SaveReport, deliver, delivered, mark_done, write_error

__all__ = ["SavePipeline"]

log = logging.getLogger("jaxckpt")

_POLL_S = 0.01


class SavePipeline:
    """One background thread plus the failures it has not reported yet."""

    def __init__(self, *, on_report: Callable[[SaveReport], Any] | None,
                 on_write_error: Literal["raise", "warn"], clock: Callable[[], float],
                 commit_timeout_s: float):
        self._on_report = on_report
        self._on_write_error = on_write_error
        self._clock = clock
        self._commit_timeout_s = commit_timeout_s
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="jaxckpt-commit")
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._unraised: list[SaveReport] = []
        self._lock = threading.Lock()

    def run(self, report: SaveReport, finish: Callable[[], None], start: float, *,
            after: Callable[[], None] | None = None,
            on_failure: Callable[[], None] | None = None) -> None:
        """Run the rest of a save inline (sync) or on the background thread (async); then
        ``after`` (retention) on the background thread in both modes, only if the save
        succeeded. Housekeeping never runs on the training thread; it blocks it only in a
        sync save, which returns once the retention after its commit ran."""

        def job() -> None:
            try:
                finish()
            except BaseException as exc:  # noqa: BLE001 - recorded, raised on the next call
                report.error = exc
                with self._lock:
                    self._unraised.append(report)
            finally:
                report.total_s = time.perf_counter() - start
                if report.mode == "sync":
                    report.blocking_s = report.total_s
                mark_done(report)
            if report.error is None and self._on_report is not None:
                try:
                    self._on_report(report)
                except Exception as exc:  # noqa: BLE001 - a logging hook must not kill saves
                    log.warning("jaxckpt: on_report callback raised %r", exc)

        def housekeeping() -> None:
            if report.error is not None:
                if on_failure is not None:
                    with contextlib.suppress(Exception):
                        on_failure()
                return
            if after is None:
                return
            try:
                after()
            except Exception as exc:  # noqa: BLE001 - retention must never stop training
                warnings.warn(f"retention after {report.path} failed: {exc!r}; it is retried "
                              f"after the next save.", CheckpointWarning, stacklevel=2)

        if report.mode == "sync":
            job()
            # Retention still runs on the background thread (in order with what is queued
            # there), but a sync save waits for it: once it returns, the root's committed
            # checkpoints are what the rules keep (committed_steps() is not stale).
            self.submit(housekeeping)
            self.drain()
            self.raise_unraised(stacklevel=5)  # past run, the part's save and the manager
        else:
            def job_then_housekeeping() -> None:
                job()
                housekeeping()

            self.submit(job_then_housekeeping)

    def submit(self, job: Callable[[], Any]) -> None:
        """Queue ``job`` on the background thread, after everything queued before it."""
        self._pending.append(self._worker.submit(job))

    def failed_to_start(self, report: SaveReport, exc: BaseException, start: float,
                        cleanup: Callable[[], None]) -> SaveReport:
        """A save that failed on the training thread is reported like a background failure:
        CheckpointWriteError now (or a warning), and ``cleanup`` (removing its partial
        directory) queued on the background thread."""
        report.error = exc
        report.total_s = report.blocking_s = time.perf_counter() - start
        mark_done(report)
        with self._lock:
            self._unraised.append(report)
        self.submit(cleanup)
        self.raise_unraised(stacklevel=5)  # past this, the part's save and the manager
        return report

    def drain(self) -> None:
        """Block until every queued job ran (they never raise: errors land on reports)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def raise_unraised(self, *, stacklevel: int = 3) -> None:
        """Raise the first failure not yet raised (or warn each, with "warn"). A warning
        points ``stacklevel`` frames up (as ``warnings.warn`` counts, this function being
        1): the default suits a call from the manager's public method, so that it points at
        the user's call; deeper callers pass more."""
        with self._lock:
            failed, self._unraised = self._unraised, []
        failed = [r for r in failed if not delivered(r)]
        if not failed:
            return
        if self._on_write_error == "warn":
            for report in failed:
                assert report.error is not None
                warnings.warn(str(write_error(report, report.error)), CheckpointWarning,
                              stacklevel=stacklevel)
            return
        raise deliver(failed[0])

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        """Poll ``condition`` until it holds; ``TimeoutError`` after the commit timeout."""
        deadline = self._clock() + self._commit_timeout_s
        while not condition():
            if self._clock() > deadline:
                raise TimeoutError(f"gave up after {self._commit_timeout_s} s waiting for {what}")
            time.sleep(_POLL_S)

    def shutdown(self) -> None:
        """Stop the background thread once the queued jobs ran."""
        self._worker.shutdown(wait=True)
