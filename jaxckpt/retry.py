"""Restarting a failed training run from its latest checkpoint, a bounded number of times.

Owns: the retry loop for a command (``run_command``, behind ``jaxckpt run``) and for an
in-process function (``run_with_retries``); each attempt calls ``recover`` at start and sees
``JAXCKPT_RETRY_ATTEMPT``. Not retried: a clean exit; SIGINT; a termination request (to the
supervisor, forwarded, or a child ended by SIGTERM, as after ``on_preemption="exit"``); exit
codes listed as final (default 2 and 78); in-process, configuration and tree-mismatch
errors, which fail the same way every time.

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .errors import ConfigError, TreeMismatchError

__all__ = ["RetryPolicy", "run_command", "run_with_retries", "ATTEMPT_ENV"]

log = logging.getLogger("jaxckpt")
ATTEMPT_ENV = "JAXCKPT_RETRY_ATTEMPT"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How often and how patiently to restart."""

    retries: int = 3
    """Restarts after the first attempt (0: run once)."""
    backoff_s: float = 1.0
    """Wait before the first restart; doubles each time."""
    max_backoff_s: float = 60.0
    """Upper bound of the wait between restarts."""
    final_exit_codes: tuple[int, ...] = (2, 78)
    """Exit codes that mean "retrying cannot help" (usage and configuration errors)."""

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"RetryPolicy.retries must be an int >= 0, got {self.retries!r}.")
        for name in ("backoff_s", "max_backoff_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"RetryPolicy.{name} must be a number >= 0, got {value!r}.")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt`` (1 = first restart)."""
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_command(argv: Sequence[str], policy: RetryPolicy = RetryPolicy(), *,
                sleep: Callable[[float], None] = time.sleep) -> int:
    """Run ``argv`` until it succeeds, fails finally, or retries are used up.

    Returns the last exit status in shell convention (128 + signal for a signal death).
    SIGINT/SIGTERM sent to this supervisor are forwarded to the child and end the loop.
    """
    if not argv:
        raise ConfigError("jaxckpt run needs a command after '--', e.g. "
                          "jaxckpt run --retries 3 -- python train.py")
    stop: dict[str, int | None] = {"signal": None}
    child: dict[str, subprocess.Popen | None] = {"proc": None}
    stopped = threading.Event()  # wakes a backoff sleep early

    def forward(signum: int, frame: Any) -> None:
        stop["signal"] = signum
        stopped.set()
        proc = child["proc"]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        attempt = 0
        while True:
            env = dict(os.environ, **{ATTEMPT_ENV: str(attempt)})
            child["proc"] = proc = subprocess.Popen(list(argv), env=env)
            code = proc.wait()
            child["proc"] = None
            status = 128 - code if code < 0 else code
            if code == 0:
                return 0
            if stop["signal"] is not None:
                log.warning("jaxckpt run: stopping after %s (supervisor got %s)", _describe(code),
                            signal.Signals(stop["signal"]).name)
                return status
            if code == -signal.SIGINT or code == 130:
                log.warning("jaxckpt run: interrupted by the user; not retrying")
                return status
            if code == -signal.SIGTERM or code == 128 + signal.SIGTERM:
                log.warning("jaxckpt run: %s, a request to stop (e.g. preemption, after its "
                            "checkpoint); not retrying", _describe(code))
                return status
            if code in policy.final_exit_codes:
                log.warning("jaxckpt run: %s is final (a usage or configuration error); "
                            "not retrying", _describe(code))
                return status
            if attempt >= policy.retries:
                log.error("jaxckpt run: %s, and all %d retries are used up", _describe(code),
                          policy.retries)
                return status
            attempt += 1
            delay = policy.delay(attempt)
            log.warning("jaxckpt run: %s; restart %d of %d in %.1f s (resumes from the latest "
                        "checkpoint)", _describe(code), attempt, policy.retries, delay)
            if sleep is time.sleep:
                stopped.wait(delay)  # a SIGTERM/SIGINT during the wait ends it at once
            else:
                sleep(delay)
            if stop["signal"] is not None:
                log.warning("jaxckpt run: supervisor got %s while waiting to restart; not "
                            "restarting", signal.Signals(stop["signal"]).name)
                return status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


#: In-process failures that a restart cannot fix.
FINAL_ERRORS: tuple[type[BaseException], ...] = (ConfigError, TreeMismatchError, KeyboardInterrupt,
                                                 SystemExit)


def run_with_retries(train: Callable[[int], T], policy: RetryPolicy = RetryPolicy(), *,
                     final_errors: tuple[type[BaseException], ...] = FINAL_ERRORS,
                     sleep: Callable[[float], None] = time.sleep) -> T:
    """Call ``train(attempt)`` until it returns; re-raise a final error or the last one.

    ``train`` should build its CheckpointManager and call ``recover`` each time, and close the
    manager on the way out (a ``with`` block), so a retry resumes from the latest checkpoint.
    """
    attempt = 0
    while True:
        try:
            return train(attempt)
        except final_errors:
            raise
        except Exception as exc:
            if attempt >= policy.retries:
                raise
            attempt += 1
            delay = policy.delay(attempt)
            log.warning("jaxckpt: attempt failed with %s: %s; restart %d of %d in %.1f s",
                        type(exc).__name__, exc, attempt, policy.retries, delay)
            sleep(delay)
