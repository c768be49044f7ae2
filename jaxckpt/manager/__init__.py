"""CheckpointManager and its parts: the facade a training loop holds, and what it drives.

Owns: ``CheckpointManager`` (``manager``), one recovery save (``save``) and its background
thread (``background``), finding and restoring the checkpoint to resume from (``restore``),
exports (``export``), what the loop gets back (``reports``), preemption signals
(``preemption``), the fast local tier (``local_tier``), taking a root for one job (``root``),
the driver state beside the arrays (``driver_state``, ``loader_state``), the shared state of
the parts (``context``) and the checks of the manager's arguments (``arguments``).

May import: the standard library, numpy and, of jaxckpt, ``core``, ``storage``, ``commit``,
``backends.base``, ``config`` and ``errors``. The one way to a framework is the lazy load of
the default Orbax backend in ``manager``.

Must not import: jax, orbax, torch, torch_bridge.
"""

from jaxckpt.manager.manager import CheckpointManager
from jaxckpt.manager.reports import Recovered, SaveReport

__all__ = ["CheckpointManager", "Recovered", "SaveReport"]
