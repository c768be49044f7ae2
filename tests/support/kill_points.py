"""Kill points for the multi-process kill trials: a worker process SIGKILLs itself at a named
seam of one save, or records what it did to the root, driven by environment variables.

Installed by the worker scripts on their manager (``install(mgr)``) after it is made; the
hooks wrap the instance's backend ``write`` and the store's ``mark_done``, ``commit`` and
``delete``, so the library itself carries no test code. Works for any backend (Orbax, DCP).

``JAXCKPT_KILL_POINT="PROCESS:POINT:STEP[:DELAY_S]"``: process ``PROCESS`` dies at ``POINT``
of the save of step ``STEP`` (at once, or ``DELAY_S`` later from a timer thread, so a random
delay lands anywhere in what follows the point). Points, in the order a save passes them:

    staging    the backend is asked to stage the arrays (after the save's start barrier)
    writing    staging returned: the write runs in the background
    done       this process's writes finished; it is about to drop its ``done.p{i}`` (the
               handshake the primary waits on before it commits)
    commit     the primary is about to commit (every ``done.p{i}`` is there)
    retention  the primary's first deletion after that step committed

``JAXCKPT_HOLD_COMMIT_S=X``: the primary sleeps X seconds before each commit (a slow commit,
so a process that did not wait for the marker would be seen).

``JAXCKPT_AUDIT=PATH``: every mutating call process ``i`` makes through the root's
``Storage`` is appended to ``PATH.p{i}`` as a JSON line ``{"op": ..., "path": ...}``.

Imports nothing from the library at module level; the workers import it by path.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from typing import Any

__all__ = ["POINTS", "install", "parse", "spec"]

POINTS = ("staging", "writing", "done", "commit", "retention")
_MUTATING = ("write", "create", "delete", "delete_prefix", "delete_unless_reading",
             "make_prefix", "rename_posix")


def spec(process: int, point: str, step: int, delay_s: float = 0.0) -> str:
    """The ``JAXCKPT_KILL_POINT`` value for one kill."""
    if point not in POINTS:
        raise ValueError(f"unknown kill point {point!r}; one of {POINTS}")
    return f"{process}:{point}:{step}:{delay_s:.4f}"


def parse(value: str) -> tuple[int, str, int, float]:
    """(process, point, step, delay_s) of a ``JAXCKPT_KILL_POINT`` value."""
    parts = value.split(":")
    process, point, step = int(parts[0]), parts[1], int(parts[2])
    delay_s = float(parts[3]) if len(parts) > 3 else 0.0
    if point not in POINTS:
        raise ValueError(f"unknown kill point {point!r}; one of {POINTS}")
    return process, point, step, delay_s


def _step_of(path: str) -> int | None:
    match = re.search(r"step_(\d+)", path)
    return int(match.group(1)) if match else None


def _die(delay_s: float) -> None:
    """SIGKILL this process now, or ``delay_s`` from now while it goes on."""
    if delay_s <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
    timer = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()


def install(mgr: Any, environ: dict[str, str] | None = None) -> None:
    """Wrap ``mgr``'s backend and store as the environment asks (nothing when it asks
    nothing)."""
    env = os.environ if environ is None else environ
    index = mgr.backend.process_index
    store = mgr.store
    audit = env.get("JAXCKPT_AUDIT")
    if audit:
        _audit(store.storage, f"{audit}.p{index}")
    hold_s = float(env.get("JAXCKPT_HOLD_COMMIT_S") or 0)
    if hold_s and index == 0:
        commit = store.commit

        def held_commit(path: str, step: int, **kwargs: Any) -> Any:
            time.sleep(hold_s)
            return commit(path, step, **kwargs)

        store.commit = held_commit
    value = env.get("JAXCKPT_KILL_POINT")
    if not value:
        return
    process, point, at_step, delay_s = parse(value)
    if process != index:
        return
    if point in ("staging", "writing"):
        _wrap_write(mgr.backend, point, at_step, delay_s)
    elif point == "done":
        mark_done = store.mark_done

        def dying_mark_done(path: str, process_index: int, *args: Any, **kwargs: Any) -> None:
            if _step_of(path) == at_step and "items" not in path:
                _die(delay_s)
            mark_done(path, process_index, *args, **kwargs)

        store.mark_done = dying_mark_done
    else:
        _wrap_commit_and_delete(store, point, at_step, delay_s)


def _wrap_write(backend: Any, point: str, at_step: int, delay_s: float) -> None:
    write = backend.write

    def dying_write(directory: str, state: Any, *, asynchronous: bool) -> Any:
        hit = _step_of(directory) == at_step and "items" not in directory
        if hit and point == "staging":
            _die(delay_s)
        handle = write(directory, state, asynchronous=asynchronous)
        if hit and point == "writing":
            _die(delay_s)
        return handle

    backend.write = dying_write


def _wrap_commit_and_delete(store: Any, point: str, at_step: int, delay_s: float) -> None:
    commit, delete = store.commit, store.delete
    committed = threading.Event()

    def dying_commit(path: str, step: int, **kwargs: Any) -> Any:
        if step == at_step and "items" not in path and point == "commit":
            _die(delay_s)
        manifest = commit(path, step, **kwargs)
        if step == at_step:
            committed.set()
        return manifest

    def dying_delete(path: str) -> bool:
        if point == "retention" and committed.is_set():
            committed.clear()
            _die(delay_s)
        return delete(path)

    store.commit, store.delete = dying_commit, dying_delete


def _audit(storage: Any, path: str) -> None:
    lock = threading.Lock()
    for name in _MUTATING:
        method = getattr(storage, name, None)
        if method is None:
            continue

        def recorded(target: str, *args: Any, _method: Any = method, _name: str = name,
                     **kwargs: Any) -> Any:
            with lock, open(path, "a") as out:
                out.write(json.dumps({"op": _name, "path": str(target)}) + "\n")
            return _method(target, *args, **kwargs)

        setattr(storage, name, recorded)
