"""The kill harness: a worker subprocess in its own session, whose stdout lines a thread
forwards, SIGKILLed as a whole process group at a chosen line or moment, every wait bounded.

Used by the system tests that kill training processes (exact resume, the crash harness,
preemption, the torch resume) and by the NNX SIGKILL test. Owns starting, reading, killing
and cleaning up a process; what a line means and what to check afterwards stay in the tests.
Imports nothing from the library.

Concurrency: one ``Worker`` belongs to the test thread that made it; only its reader thread
touches the pipe, and it hands lines over through a queue.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from support.paths import REPO

#: A line to kill at, or a test of each line (it may keep state: "the first STEP after ...").
KillAt = str | Callable[[str], bool]


def repo_env(base: Mapping[str, str] | None = None, **overrides: str) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``overrides`` and the repository
    first on PYTHONPATH, so a worker imports this checkout's jaxckpt."""
    env = dict(os.environ if base is None else base, **overrides)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


class Worker:
    """One subprocess in its own session (``start_new_session``), so that a kill or a
    cleanup reaches everything it started. Its stderr goes to a temporary file (read with
    ``stderr()``); its stdout lines are collected in ``lines`` as they are read."""

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None, timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self._stderr = tempfile.TemporaryFile()
        self._stderr_text: str | None = None
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=self._stderr,
                                     env=None if env is None else dict(env), cwd=cwd,
                                     start_new_session=True)
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.lines: list[str] = []
        self.killed = False  # a SIGKILL was sent while the worker still ran
        self._queue: queue.Queue[tuple[str, float] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._queue.put((raw.decode(errors="replace").rstrip("\n"), time.monotonic()))
        self._queue.put(None)

    # ---------------------------------------------------------------------- reading

    def next_line(self) -> tuple[str, float] | None:
        """The next stdout line and the monotonic time it was read, or None at end of
        output. Raises TimeoutError when the worker stays silent past its deadline."""
        try:
            item = self._queue.get(timeout=max(0.01, self.deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"worker silent past its {self.timeout_s} s; last lines "
                               f"{self.lines[-5:]}; stderr: {self.stderr()}") from None
        if item is not None:
            self.lines.append(item[0])
        return item

    def wait_for(self, prefix: str) -> str:
        """Read up to the first line starting with ``prefix`` and return it."""
        while True:
            try:
                item = self.next_line()
            except TimeoutError:
                raise AssertionError(f"timed out waiting for {prefix!r}: {self.lines[-10:]}") \
                    from None
            if item is None:
                raise AssertionError(f"exited before {prefix!r}: {self.lines[-10:]}\n"
                                     f"{self.stderr()}")
            if item[0].startswith(prefix):
                return item[0]

    def tagged(self, tag: str) -> list[str]:
        """What follows ``tag`` on each line that starts with it (``"SAVING 9"`` -> "9")."""
        return [line[len(tag) + 1:] for line in self.lines if line.split(" ", 1)[0] == tag]

    def stderr(self, limit: int = 3000) -> str:
        """The last ``limit`` characters the worker wrote to stderr so far."""
        if self._stderr_text is not None:
            return self._stderr_text[-limit:]
        # pread, not seek and read: the worker writes through the same open file, whose
        # offset a seek would move back under its next write (overwriting what it wrote).
        fd, pieces, offset = self._stderr.fileno(), [], 0
        while piece := os.pread(fd, 1 << 20, offset):
            pieces.append(piece)
            offset += len(piece)
        return b"".join(pieces).decode(errors="replace")[-limit:]

    # ---------------------------------------------------------------- running, killing

    def run(self, kill_at: KillAt | None = None, *, delay_s: float = 0.0,
            kill_after_s: float | None = None, drain: bool = True) -> int:
        """Read lines to the end and return the exit status (``-SIGKILL`` when killed).

        ``kill_at``: SIGKILL the group ``delay_s`` after the first line that is (or passes)
        it, timed from when that line was read. ``kill_after_s``: SIGKILL the group that
        long after the start, before reading. ``drain``: after a kill, keep reading what the
        worker wrote before it died (False: ``lines`` ends at the kill line). Whatever
        happens, the group is killed and reaped before this returns or raises."""
        try:
            if kill_after_s is not None:
                time.sleep(max(0.0, self.started + kill_after_s - time.monotonic()))
                self.kill()
            while (item := self.next_line()) is not None:
                line, read_at = item
                if kill_at is not None and not self.killed and _matches(kill_at, line):
                    time.sleep(max(0.0, read_at + delay_s - time.monotonic()))
                    self.kill()
                    if not drain:
                        break
            return self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        finally:
            self.close()

    def finish(self) -> int:
        """Read the remaining lines and return the exit status (no kill); bounded by the
        deadline."""
        while self.next_line() is not None:
            pass
        return self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker process alone (not its group)."""
        os.kill(self.proc.pid, signum)

    def kill(self) -> bool:
        """SIGKILL the worker's process group. False when it had already exited."""
        if self.proc.poll() is not None:
            return False
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.killed = True
        return True

    def close(self) -> None:
        """Kill the group if it still runs, reap it, keep its stderr and stop reading."""
        self.kill()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=10)
        if self._stderr_text is None:
            self._stderr_text = self.stderr(limit=1 << 20)
            self._stderr.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _matches(kill_at: KillAt, line: str) -> bool:
    return kill_at(line) if callable(kill_at) else line == kill_at


def run_all(workers: Sequence[Worker]) -> tuple[list[int], list[str]]:
    """Wait for every worker to finish (each bounded by its deadline) and return their exit
    statuses and outputs (stdout lines, then stderr). Every group is killed on the way out."""
    try:
        codes = [worker.finish() for worker in workers]
    finally:
        for worker in workers:
            worker.close()
    outputs = ["\n".join(worker.lines) + "\n" + worker.stderr(limit=1 << 20)
               for worker in workers]
    return codes, outputs
