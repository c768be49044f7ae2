"""The one stateful test loader: a data loader reduced to its position.

It speaks the ``state_dict``/``load_state_dict`` protocol a real loader (torchdata's
StatefulDataLoader, a user's own) speaks, and its state is small JSON (``{"position": n}``),
so a test sees exactly where a restore put it. Tests that need a loader that does more on
purpose (fails, holds non-JSON state, shuffles real data, matches a stored file's keys) keep a
local class and say why. Imports nothing from the library.

Not thread-safe; one instance belongs to one test (the manager reads it on the caller's thread).
"""

from __future__ import annotations


class Loader:
    """A loader whose whole state is how far it has read."""

    def __init__(self, position: int = 0):
        self.position = position

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
