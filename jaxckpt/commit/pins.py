"""Checkpoints pinned by hand: ``{root}/pins.json``, which retention never deletes.

Owns: the pins file (``{"format": "jaxckpt.pins/1", "steps": [...]}``, written whole by the
storage, read afresh by every retention pass) and the lock that orders a pin against
retention: a checkpoint pinned by a ``pin()`` that returned is never deleted by a pass
that was already deciding.

Must not import: jax, orbax, torch.

Concurrency: ``pin``/``unpin`` (training thread) and retention (background thread) hold
``lock`` while they read and act on the pins; only the primary process writes the file.
"""

from __future__ import annotations

import json
import os
import threading

from jaxckpt.commit.store import CheckpointStore
from jaxckpt.core.layout import PINS_FILE
from jaxckpt.errors import CheckpointCorruptError, CheckpointNotFoundError

__all__ = ["Pins", "PINS_FORMAT"]

PINS_FORMAT = "jaxckpt.pins/1"


class Pins:
    """The pinned steps of one root."""

    def __init__(self, store: CheckpointStore, *, primary: bool = True):
        self._store = store
        self._primary = primary
        self.lock = threading.Lock()
        self.path = os.path.join(store.root, PINS_FILE)

    def read(self) -> set[int]:
        """The pinned steps (empty when nothing was ever pinned); ``CheckpointCorruptError``
        when the file cannot be understood (retention then deletes nothing)."""
        try:
            data = self._store.storage.read(self.path)
        except FileNotFoundError:
            return set()
        try:
            body = json.loads(data)
            if body.get("format") != PINS_FORMAT:
                raise ValueError(f"format {body.get('format')!r}, expected {PINS_FORMAT!r}")
            return {int(step) for step in body["steps"]}
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CheckpointCorruptError(
                f"{self.path} is not a pins file jaxckpt can read ({exc}); fix or remove it "
                f"(pins protect checkpoints from retention, which deletes nothing meanwhile)."
            ) from exc

    def pin(self, step: int) -> None:
        """Pin ``step``: a committed checkpoint must exist at it."""
        with self.lock:
            committed = self._store.committed_steps()
            if step not in committed:
                raise CheckpointNotFoundError(
                    f"cannot pin step {step}: no committed checkpoint at it under "
                    f"{self._store.recover_dir}; committed steps: {committed or 'none'}.")
            self._write(self.read() | {step})

    def unpin(self, step: int) -> None:
        """Unpin ``step`` (nothing happens when it was not pinned); retention may then delete
        it after the next save."""
        with self.lock:
            pinned = self.read()
            if step in pinned:
                self._write(pinned - {step})

    def _write(self, steps: set[int]) -> None:
        if self._primary:
            body = {"format": PINS_FORMAT, "steps": sorted(steps)}
            self._store.storage.write(self.path, json.dumps(body).encode())
