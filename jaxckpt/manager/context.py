"""The state the manager's parts share, in one explicit object.

Owns: :class:`ManagerContext`, what more than one part of a ``CheckpointManager`` reads or
writes: store, backend and process facts, configs, triggers, the steps being read, the item
versions on disk, the last report of each kind, the restored step, the pins. Each part gets
the context instead of reaching into another part.

Must not import: jax, orbax, torch, or any part of the manager (the parts import this).

Concurrency: built once by the manager; ``reading`` and ``written_items`` are shared with
the background thread under ``state_lock``; the other fields change on the training thread.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxckpt.backends.base import Backend
from jaxckpt.commit.pins import Pins
from jaxckpt.commit.store import CheckpointStore
from jaxckpt.config import ExportConfig, RecoverConfig
from jaxckpt.core.policy import SaveTrigger

if TYPE_CHECKING:
    from jaxckpt.manager.reports import SaveReport

__all__ = ["ManagerContext"]


@dataclasses.dataclass(kw_only=True, slots=True, eq=False)
class ManagerContext:
    """What the parts of one manager share."""

    store: CheckpointStore
    """The root's directory lifecycle: naming, commit, listing, verification, deletion."""
    backend: Backend
    """Writes and reads the arrays; answers the process facts."""
    recover_config: RecoverConfig
    export_config: ExportConfig | None
    process_index: int
    """This process's index (``backend.process_index``, read once)."""
    process_count: int
    """How many processes write each checkpoint (``backend.process_count``, read once)."""
    recover_trigger: SaveTrigger
    export_trigger: SaveTrigger | None
    state_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    """Guards ``reading`` and ``written_items`` (the background thread touches both)."""
    reading: set[int] = dataclasses.field(default_factory=set)
    """Steps being restored right now: retention keeps its hands off them."""
    written_items: dict[str, set[int]] = dataclasses.field(default_factory=dict)
    """Committed versions on disk per item name: an item version is never written twice."""
    last: dict[str, SaveReport] = dataclasses.field(default_factory=dict)
    """The last report of each kind ("recover", "export"): a save of the same step returns it."""
    restored_step: int | None = None
    """The step the last restore resumed from (a save of it is already committed)."""
    default_stateful: Mapping[str, Any] | None = None
    """The ``stateful`` objects given to ``recover``: saved when a save names none."""
    pins: Pins | None = None
    """The root's pinned steps (``pins.json``), with the lock that orders pins and retention;
    None: nothing is ever pinned (a context built without a root's pins, e.g. in tests)."""

    @property
    def primary(self) -> bool:
        """The primary process decides, writes the driver state and the marker, and deletes."""
        return self.process_index == 0

    def barrier(self, name: str, timeout_s: float) -> None:
        """A barrier of every process, or nothing in a single-process run."""
        if self.process_count > 1:
            self.backend.barrier(name, timeout_s)

