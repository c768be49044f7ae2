"""The process facts of a ``jax.distributed`` run, for the Orbax backend.

Owns: the barrier and the integer broadcast (and ``ProcessFacts``, the backend's members
that ask for them) the manager asks a backend for, done in JAX's
coordination service (as Orbax's own background thread does) rather than in device
collectives, and the host copy of a state that gathers arrays sharded across processes.
In a single process every one of them is the identity (or a plain copy).

Must not import: torch. Stateless apart from the broadcast counter below.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import numpy as np

from jaxckpt.backends.orbax.tree import is_key_dtype

__all__ = ["ProcessFacts", "barrier", "broadcast_int", "host_copy"]

# Distinguishes successive broadcast_int calls in the coordination service's key-value
# store. Module-wide so that two backends in one process never reuse a key; every process
# must therefore make the same sequence of broadcast_int calls (they are collectives).
_broadcast_counter = itertools.count()


def barrier(name: str, timeout_s: float) -> None:
    """Block until every process reached barrier ``name`` (names must be unique per run).

    Safe from any thread: it waits in the coordination service (as Orbax's background
    thread does), not in a device collective.
    """
    if jax.process_count() == 1:
        return
    import orbax.checkpoint as ocp

    timeout_ms = max(1, int(timeout_s * 1000))
    if ocp.multihost.is_jax_distributed_client_initialized():
        ocp.multihost.get_barrier_sync_fn()(key=f"jaxckpt/{name}", timeout_ms=timeout_ms)
    else:
        ocp.multihost.sync_global_processes(f"jaxckpt/{name}",
                                            timeout=max(1, int(timeout_s)))


def broadcast_int(value: int, *, timeout_s: float) -> int:
    """Process 0's ``value`` on every process; the others wait for it at most
    ``timeout_s``. A collective: all processes call it, in the same order."""
    if jax.process_count() == 1:
        return int(value)
    import orbax.checkpoint as ocp

    if not ocp.multihost.is_jax_distributed_client_initialized():
        # Device collective fallback; values go through a jax array (int32 unless x64).
        from jax.experimental import multihost_utils

        return int(multihost_utils.broadcast_one_to_all(np.int32(value)))
    client = ocp.multihost.get_jax_distributed_client()
    key = f"jaxckpt/broadcast_int/{next(_broadcast_counter)}"
    if jax.process_index() == 0:
        client.key_value_set(key, str(int(value)), allow_overwrite=True)
        return int(value)
    timeout_ms = max(1, int(timeout_s * 1000))
    return int(client.blocking_key_value_get(key, timeout_ms))


def host_copy(state: Any) -> Any:
    """A copy of ``state`` in host memory, independent of the training loop's buffers
    (which may be donated or freed). Array leaves become numpy arrays; typed keys stay
    typed keys, rebuilt from a host copy of their data on the default device; Python
    scalars are kept. Arrays sharded across processes are gathered, which makes this a
    collective that every process must call."""

    def to_host(array: jax.Array) -> np.ndarray:
        if array.is_fully_addressable:
            return np.array(array, copy=True)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))

    def copy_leaf(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array):
            if is_key_dtype(leaf.dtype):
                impl = str(jax.random.key_impl(leaf))
                # jax annotates jax.Array; it takes any array (numpy here) at run time.
                return jax.random.wrap_key_data(
                    to_host(jax.random.key_data(leaf)),  # type: ignore[arg-type]
                    impl=impl)
            return to_host(leaf)
        if isinstance(leaf, (np.ndarray, np.generic)):
            return np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf
        return leaf

    return jax.tree_util.tree_map(copy_leaf, state)


class ProcessFacts:
    """The members of the Orbax backend that say which process this is and wait for the
    others (``Backend.process_index``, ``process_count``, ``barrier``, ``broadcast_int``).
    Needs ``self.options`` (``OrbaxOptions``: its ``collective_timeout_s``)."""

    options: Any

    @property
    def process_index(self) -> int:
        return jax.process_index()

    @property
    def process_count(self) -> int:
        return jax.process_count()

    def barrier(self, name: str, timeout_s: float) -> None:
        """Block until every process reached barrier ``name`` (names must be unique per run).
        Safe from any thread: it waits in the coordination service, not in a device
        collective."""
        barrier(name, timeout_s)

    def broadcast_int(self, value: int) -> int:
        """Process 0's ``value`` on every process. A collective: all processes call it, in
        the same order."""
        return broadcast_int(value, timeout_s=self.options.collective_timeout_s)
