"""Who holds a root lease: this process's identity as a lease records it, and what can be
told from here about the process a lease names.

Owns: ``this_process`` (host name, boot id, pid namespace, pid, start time: together they
name one process, which a pid alone does not across hosts, containers, boots and pid
reuse) and ``holder_status`` (this process, a running one of this host, a gone one, or one
that cannot be checked from here, as anywhere but Linux).

Must not import: jax, orbax, torch, boto3, google.

Concurrency: pure functions of /proc and the record given; ``this_process`` caches its
answer per pid (a forked child computes its own).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Literal

__all__ = ["HolderStatus", "holder_status", "this_process"]

HolderStatus = Literal["this process", "running here", "gone", "elsewhere"]

_cached: dict[int, dict[str, Any]] = {}


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as file:
            return file.read().strip()
    except (OSError, ValueError):
        return None


def _namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of process ``pid``, or None when
    /proc does not say. The command name in parentheses may hold spaces and parentheses: the
    fields are counted from the last ")"."""
    text = _read(f"/proc/{pid}/stat")
    if text is None or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    try:
        return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)
    except (IndexError, ValueError):
        return None


def this_process() -> dict[str, Any]:
    """The calling process as a lease records it: ``host``, ``pid``, and where /proc tells
    them, ``boot``, ``pid_ns`` and ``start`` (None otherwise)."""
    pid = os.getpid()
    if pid not in _cached:
        stat = _stat(pid)
        _cached.clear()
        _cached[pid] = {"host": socket.gethostname(), "pid": pid,
                        "boot": _read("/proc/sys/kernel/random/boot_id"),
                        "pid_ns": _namespace(), "start": stat[1] if stat else None}
    return dict(_cached[pid])


def holder_status(record: dict[str, Any]) -> HolderStatus:
    """What can be told from here about the process a lease record names (module
    docstring): "this process"; "running here" (a process of this host's process table with
    that pid and start time); "gone" (this host's process table has no such process any
    more); "elsewhere" (another host, another boot or pid namespace, or not checkable)."""
    me = this_process()
    if me["start"] is None or any(record.get(key) != me[key]
                                  for key in ("host", "boot", "pid_ns")):
        return "elsewhere"
    pid, start = record.get("pid"), record.get("start")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or \
            not isinstance(start, int):
        return "elsewhere"
    if pid == me["pid"]:
        return "this process" if start == me["start"] else "gone"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass  # another user's process: it exists
    stat = _stat(pid)
    if stat is None:
        return "elsewhere"  # exists, but /proc hides it: cannot tell a reused pid
    state, started = stat
    if state in ("Z", "X") or started != start:
        return "gone"  # killed and not yet reaped, or the pid now names another process
    return "running here"
