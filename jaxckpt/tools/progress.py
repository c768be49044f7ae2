"""Progress displays for long commands (``export-hf``, ``import-hf``, ``ls``, ``verify``).

Owns: ``make_progress(desc)``, a ``progress(done, total)`` callable with ``close()`` that
draws on stderr (tqdm when installed, else one updating line), in bytes or in plain counts,
and ``wanted`` (the default: progress only when stderr is a terminal, so logs and pipes get
the report alone). Callers may call it from several threads: updates are serialised here.

Must not import: jax, orbax, torch (the pure commands use it without any extra).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Literal

Unit = Literal["B", "count"]


def wanted(flag: bool | None) -> bool:
    """An explicit ``--progress``/``--no-progress`` wins; unset means "when stderr is a
    terminal"."""
    return sys.stderr.isatty() if flag is None else flag


class _LineProgress:
    """One updating stderr line, redrawn at most five times a second."""

    def __init__(self, desc: str, unit: Unit):
        self.desc = desc
        self.unit = unit
        self._last = 0.0
        self._lock = threading.Lock()

    def _text(self, done: int, total: int) -> str:
        share = 100 * done / max(total, 1)
        if self.unit == "B":
            return f"{self.desc}: {share:5.1f}% ({done / 2**20:.1f}/{total / 2**20:.1f} MiB)"
        return f"{self.desc}: {done}/{total}"

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            now = time.monotonic()
            if done < total and now - self._last < 0.2:
                return
            self._last = now
            sys.stderr.write(f"\r{self._text(done, total)}")
            sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


class _TqdmProgress:
    def __init__(self, tqdm: Any, desc: str, unit: Unit):
        options = ({"unit": "B", "unit_scale": True, "unit_divisor": 1024} if unit == "B"
                   else {"unit": ""})
        self._bar = tqdm(total=0, desc=desc, file=sys.stderr, **options)
        self._done = 0
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            if self._bar.total != total:
                self._bar.total = total
            if done > self._done:
                self._bar.update(done - self._done)
                self._done = done

    def close(self) -> None:
        self._bar.close()


def make_progress(desc: str, enabled: bool = True, *, unit: Unit = "B") -> Any:
    """A ``progress(done, total)`` callable with ``close()``; None when disabled."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _LineProgress(desc, unit)
    return _TqdmProgress(tqdm, desc, unit)
