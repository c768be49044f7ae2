"""The line protocol between a test worker process and the harness that reads its stdout.

A worker announces events (``STEP 3``, ``DONE``) as whole lines on its stdout. Native
libraries inside the worker write to the same descriptor: gloo, under ``jax.distributed`` or
``torch.distributed``, prints "[Gloo] Rank 1 is connected to 1 peer ranks ..." in several
writes, and a worker's line landed between two of them ("[Gloo] Rank DONE"), so the harness
never saw ``DONE`` (CI, session 10). ``claim_stdout()`` keeps the harness's pipe on a private
descriptor, which ``sys.stdout`` and ``emit`` write to, and points descriptor 1 at stderr,
where native chatter can no longer split a protocol line.

Imports only the standard library: workers load it before jax or torch.
"""

from __future__ import annotations

import os
import sys

_lines_fd = 1


def claim_stdout() -> None:
    """Keep the harness's pipe for Python's lines (``emit``, ``print``) and send what native
    code writes to descriptor 1 to stderr. Call it first thing in a worker."""
    global _lines_fd
    if _lines_fd != 1:
        return
    sys.stdout.flush()
    _lines_fd = os.dup(1)  # not inherited by the worker's own children
    os.dup2(2, 1)  # native code writing to descriptor 1 now writes to stderr
    # Python's print() stays on the harness's pipe, a line at a time.
    sys.stdout = open(_lines_fd, "w", buffering=1, closefd=False)  # noqa: SIM115


def emit(line: str) -> None:
    """One protocol line, in one write (a SIGKILL right after it cannot cut it)."""
    os.write(_lines_fd, (line + "\n").encode())
