"""A multi-process backend over plain files, so that a test can run a real CheckpointManager
in several processes without jax.distributed or a torch process group (each of those costs
seconds of imports per process on a 2-core machine).

Process facts: ``barrier`` and ``broadcast_int`` meet through files in a directory the
processes of one launch share (a fresh one per launch: barrier names repeat across launches).
Arrays: every process writes each entry of a flat dict of NumPy arrays as
``{name}.p{index}.npy``; reads take the primary's copy (the state is replicated). Everything
else (driver state, commit, retention, recovery) is the manager's own code.

Imports NumPy and jaxckpt.backends.base only. One instance per process, used by its training thread
(the manager's commit thread only waits on handles, which hold no state).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from jaxckpt.backends.base import SingleProcess


class _Written:
    """The handle of a write that finished before ``write`` returned."""

    checksums = None  # the commit checksums the files itself

    def wait(self) -> None:
        return None


class FileGroupBackend(SingleProcess):
    """Process ``index`` of ``count``, meeting the others in ``sync_dir``."""

    name = "file-group"

    def __init__(self, sync_dir: str, index: int, count: int, *, timeout_s: float = 60.0):
        self.process_index = index
        self.process_count = count
        self._sync = sync_dir
        self._timeout_s = timeout_s
        self._broadcasts = 0
        os.makedirs(sync_dir, exist_ok=True)

    def _wait(self, ready: Any, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + min(timeout_s, self._timeout_s)
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {self.process_index}: timed out waiting for {what}")
            time.sleep(0.005)

    def barrier(self, name: str, timeout_s: float) -> None:
        where = os.path.join(self._sync, "barrier." + name)
        os.makedirs(where, exist_ok=True)
        open(os.path.join(where, f"p{self.process_index}"), "w").close()
        self._wait(lambda: len(os.listdir(where)) >= self.process_count, f"barrier {name}",
                   timeout_s)

    def broadcast_int(self, value: int) -> int:
        self._broadcasts += 1
        path = os.path.join(self._sync, f"broadcast.{self._broadcasts}")
        if self.process_index == 0:
            with open(path + ".tmp", "w") as file:
                file.write(str(int(value)))
            os.rename(path + ".tmp", path)
            return value
        self._wait(lambda: os.path.exists(path), f"broadcast {self._broadcasts}", 60.0)
        with open(path) as file:
            return int(file.read())

    def write(self, directory: str, state: Any, *, asynchronous: bool) -> _Written:
        os.makedirs(directory, exist_ok=True)
        for name, value in state.items():
            np.save(os.path.join(directory, f"{name}.p{self.process_index}.npy"), np.asarray(value))
        return _Written()

    def read(self, directory: str, like: Any, *, claims: Any = None,
             partial: bool = False) -> Any:
        # Every name of ``like`` is read whether or not ``partial``: a subtree is just fewer.
        if claims is not None:
            claims.close()
        return {name: np.load(os.path.join(directory, f"{name}.p0.npy")) for name in like}

    def host_copy(self, state: Any) -> Any:
        return {name: np.array(value) for name, value in state.items()}

    def versions(self) -> dict[str, str]:
        return {"numpy": np.__version__}
