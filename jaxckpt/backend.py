"""The seam between the framework-agnostic manager and an array-writing backend.

Owns: the small protocol a backend implements (write a state into a directory, read it back
into a ``like`` tree, and the process facts the manager needs), plus the single-process
default for those facts.

Must not import: jax, orbax, torch. Backends live in their own modules (``orbax_backend``,
``torch_bridge.dcp_backend``) and are imported lazily.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Backend", "WriteHandle", "SingleProcess"]


@runtime_checkable
class WriteHandle(Protocol):
    """A write started by :meth:`Backend.write`.

    Concurrency contract: ``wait`` is called exactly once, from the manager's background
    commit thread; it must be safe to call from a thread other than the one that started the
    write.

    Optional attribute ``checksums``, read after ``wait``: manifest entries
    (``{"size": n, "crc32c": hex}``, the commit's algorithm) of files the backend computed
    from the bytes it wrote and made durable itself, by path relative to the directory it
    wrote. The commit takes those instead of reading the files back (it still checks their
    sizes). None or absent: the commit checksums every file.
    """

    def wait(self) -> None:
        """Block until this process's part of the write is finished and its data durable.

        Raises whatever made the write fail (the manager chains it with the step and path).
        """


@runtime_checkable
class Backend(Protocol):
    """What the manager needs from a framework.

    A backend writes the array state of one checkpoint into ``directory`` (a directory that
    does not exist yet; the backend creates it, and it should only appear complete, e.g. via a
    temp name + rename) and reads it back. Everything else (when to save, the commit marker,
    driver state, retention) is the manager's job.

    Optional attributes: ``export_needs_copy = True`` makes exporters always receive
    ``host_copy(state)`` (e.g. torch state dicts rather than live modules), whatever the export
    mode; ``reads_in_place = True`` says that ``read`` loads into the objects of ``like``
    (so what it read cannot be discarded): the manager then verifies every checksum before
    reading, instead of checking those of large data files while ``read`` runs;
    ``verifies_reads = True`` says that ``read`` takes ``claims=`` (a ``store.ReadClaims``)
    and checks the deferred checksums of the files it reads whole as it reads them, so that
    the manager's verifier skips those; ``close()`` is called by a manager that created its
    backend itself; ``finish_read(value)`` is called by the manager on what ``read``
    returned (the state and each item) once the checkpoint is judged valid, and returns the
    final value: a backend that fills the caller's live objects (OrbaxBackend with live NNX
    objects) does it there, so that a read the manager throws away (its checksums failed
    alongside it) never changes them; ``left_out(saved, scope)`` returns a warning naming
    objects of ``scope`` (the local variables of the code that called the first save) whose
    state ``saved`` leaves out, or None.
    """

    #: short name recorded in driver.json, e.g. "orbax" or "dcp".
    name: str
    #: whether ``write(..., asynchronous=True)`` returns before the data is written.
    supports_async: bool

    @property
    def process_index(self) -> int: ...

    @property
    def process_count(self) -> int: ...

    def write(self, directory: str, state: Any, *, asynchronous: bool) -> WriteHandle:
        """Start writing ``state`` into ``directory``.

        Returns once the state is staged: from then on the caller may mutate, donate or free
        the arrays it passed. With ``asynchronous=False`` the write is finished on return.
        Called on every process with the same directory.
        """

    def read(self, directory: str, like: Any) -> Any:
        """Read the state in ``directory`` into the structure, shapes, dtypes and placement of
        ``like`` (concrete or abstract leaves). Raises ``TreeMismatchError`` listing every
        mismatching tree path."""

    def host_copy(self, state: Any) -> Any:
        """A copy of ``state`` in host memory that stays valid while training goes on (used
        by background exports)."""

    def versions(self) -> dict[str, str]:
        """Versions of the libraries this backend writes with (recorded in driver.json)."""

    def rng_state(self) -> Any:
        """JSON-safe (codec) state of framework-global RNGs of this process, or None."""

    def set_rng_state(self, state: Any) -> None:
        """Restore what :meth:`rng_state` returned (missing entries warn, not raise)."""

    def barrier(self, name: str, timeout_s: float) -> None:
        """Block until every process reached the barrier ``name``."""

    def broadcast_int(self, value: int) -> int:
        """Return the primary process's ``value`` on every process."""


class SingleProcess:
    """Process facts for a single-process run: every collective is the identity."""

    process_index = 0
    process_count = 1

    def barrier(self, name: str, timeout_s: float) -> None:
        return None

    def broadcast_int(self, value: int) -> int:
        return value
