"""Running a group of cooperating worker processes (one job of 1 or 2 processes) in which one
may SIGKILL itself, as a cluster scheduler would: when a process dies, the survivors are
killed too after a grace period (they would otherwise wait in a barrier or a collective until
their own timeouts), and the whole job is started again later.

Used by tests/system/test_multiprocess_kill.py for both frameworks. Owns starting, watching
and reaping the group and reading what it left on a checkpoint root (committed steps, their
verification); what the lines mean and what to assert stay in the tests. The root is a
parameter: a local path or an ``s3://`` / ``gs://`` URL (with its ``storage_options``), read
through the library's own ``Storage`` and ``CheckpointStore``, never with ``os``.

Concurrency: used from the test thread only; each ``Worker`` has its own reader thread.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxckpt.commit.store import CheckpointStore
from jaxckpt.storage.url import parse_root

from support.harness import Worker, repo_env


@dataclasses.dataclass
class Outcome:
    """What one process of a job did."""

    code: int
    lines: list[str]
    stderr: str
    killed_by_harness: bool  # a survivor the harness killed after its peer died

    def tagged(self, tag: str) -> list[str]:
        return [line[len(tag) + 1:] for line in self.lines if line.split(" ", 1)[0] == tag]

    @property
    def died_by_itself(self) -> bool:
        """SIGKILLed by its own kill point (not by the harness)."""
        return self.code == -signal.SIGKILL and not self.killed_by_harness


def run_job(commands: Sequence[Sequence[str]], *, env: Mapping[str, str],
            grace_s: float = 2.0, timeout_s: float = 120.0) -> list[Outcome]:
    """Start one process per command, wait for all. When one exits killed (or failed) while
    others still run, the others are SIGKILLed ``grace_s`` later. Every process is reaped
    before this returns, whatever happens."""
    workers = [Worker(list(argv), env=repo_env(env), timeout_s=timeout_s) for argv in commands]
    harness_killed = [False] * len(workers)
    try:
        deadline = time.monotonic() + timeout_s
        first_death: float | None = None
        while any(w.proc.poll() is None for w in workers):
            now = time.monotonic()
            if first_death is None and any(w.proc.poll() not in (None, 0) for w in workers):
                first_death = now
            if (first_death is not None and now >= first_death + grace_s) or now > deadline:
                for i, worker in enumerate(workers):
                    if worker.kill():
                        harness_killed[i] = True
            time.sleep(0.02)
        outcomes = []
        for i, worker in enumerate(workers):
            worker.deadline = time.monotonic() + 30
            code = worker.finish()
            outcomes.append(Outcome(code=code, lines=list(worker.lines),
                                    stderr=worker.stderr(limit=1 << 16),
                                    killed_by_harness=harness_killed[i]))
        return outcomes
    finally:
        for worker in workers:
            worker.close()


#: ``storage_options`` of an object-store root (endpoint, credentials, lease), or None.
Options = Mapping[str, Any] | None


def open_store(root: str, storage_options: Options = None) -> CheckpointStore:
    """The store of ``root``: a local path or an object-store URL (``jaxckpt.storage.url``),
    whose client ``storage_options`` configures, as the workers' managers do."""
    kind, target = parse_root(root, storage_options)
    if kind == "local":
        return CheckpointStore(str(target))
    return CheckpointStore(root, storage=target)  # type: ignore[arg-type]


def committed_steps(root: str, storage_options: Options = None) -> list[int]:
    """Steps with a commit marker under ``root`` (none when the root does not exist yet)."""
    return open_store(root, storage_options).committed_steps()


def step_entries(root: str, step: int, storage_options: Options = None) -> list[str]:
    """The names directly inside step ``step``'s directory (empty when there is none)."""
    store = open_store(root, storage_options)
    path = store.step_path(step)
    return sorted(store.storage.list_names(path)) if store.storage.is_prefix(path) else []


def broken_committed(root: str, storage_options: Options = None) -> dict[int, list[str]]:
    """Every committed checkpoint that fails verification against its manifest, with its
    problems (the check ``jaxckpt verify`` runs)."""
    store = open_store(root, storage_options)
    out = {}
    for step in store.committed_steps():
        problems = store.verify(str(store.step_path(step)))
        if problems:
            out[step] = [str(p) for p in problems]
    return out
