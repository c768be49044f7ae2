"""The seam between the framework-agnostic manager and an array-writing backend.

Owns: the ``Backend`` protocol (write a state into a directory, read it back into a
``like`` tree, the process facts the manager needs, the declared :class:`BackendFeatures`),
the ``WriteHandle`` protocol, :func:`check_backend` (the check of a ``backend=`` argument)
and :class:`SingleProcess`. Every member the manager uses is stated here and required: the
manager never probes a backend with ``getattr``; a backend implements a member it has no
use for trivially.

Must not import: jax, orbax, torch. Backends live in their own modules
(``backends.orbax.backend``, ``torch_bridge.dcp.backend``) and are imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

from jaxckpt.errors import ConfigError

if TYPE_CHECKING:
    from jaxckpt.commit.deferred_checks import DeferredChecks
    from jaxckpt.storage.base import Storage

__all__ = ["Backend", "BackendFeatures", "IncrementalBase", "ObjectStorageBackend", "WriteHandle",
           "SingleProcess", "check_backend"]


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendFeatures:
    """What a backend can do beyond the required members, declared once by the backend.

    Each field changes how the manager drives the backend; the defaults describe a backend
    that writes synchronously and reads into new values, with nothing optional.
    """

    supports_async: bool = False
    """``write(..., asynchronous=True)`` returns once the state is staged, before the data is
    written; the manager's save mode "auto" then means "async". False: the manager refuses
    mode "async" and "auto" means "sync"."""
    reads_in_place: bool = False
    """``read`` loads into the objects of ``like`` (e.g. live torch modules), so what it read
    cannot be thrown away: the manager verifies every checksum before reading instead of
    checking those of large data files while ``read`` runs (but see ``verifies_reads``)."""
    verifies_reads: bool = False
    """``read`` uses its ``claims`` (a ``deferred_checks.DeferredChecks``): it checks the deferred
    checksums of the files it reads whole as it reads them, so the manager's verifier skips
    those. False: the manager passes ``claims=None``. With ``reads_in_place`` as well, the
    backend promises more: it claims every offered file its read loads from, checks each
    claimed file before it loads anything into the live objects, and on a mismatch loads
    nothing and raises; the manager then defers the data checksums of a single-process
    restore to it (one pass over the bytes instead of two), and checks every file first in
    a run of several processes (only the primary is given claims)."""
    takes_read_ahead: bool = False
    """With ``verifies_reads`` and ``reads_in_place``: a full single-process ``read`` claims
    every deferred file of the state it is given and loads each one whole from one fetch,
    taking the bytes from ``claims.fetched`` where the manager fetched them ahead (an
    object-store root: ``read_ahead``). False: the manager fetches nothing ahead."""
    export_needs_copy: bool = False
    """Exporters always receive ``host_copy(state)`` (e.g. torch state dicts rather than live
    modules), whatever the export mode. False: a sync single-process export gets ``state``."""
    incremental: bool = False
    """``write`` takes ``base=`` (an :class:`IncrementalBase`) and may leave out files whose
    bytes the base already holds, naming them in ``WriteHandle.references``; ``read`` follows
    the ``references`` it is given. False: the manager never passes a base
    (``RecoverConfig(incremental=True)`` is refused for this backend)."""
    object_storage: bool = False
    """The backend writes and reads locations of a ``jaxckpt.storage.base.Storage`` (an object
    store's URLs) once handed that storage by ``attach_storage`` (it is an
    :class:`ObjectStorageBackend`). False: the manager refuses an object-store root for this
    backend, before anything is written."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IncrementalBase:
    """What an incremental write may refer to instead of writing: the newest committed
    checkpoint of the root (retention never deletes it while a save is in flight).

    Keys are ``core.layout.ref_key`` strings: a file's path relative to the root's
    ``recover/`` directory, ``step_{S:08d}/<path inside checkpoint S>``, always naming the
    checkpoint that physically holds the bytes (never a reference to a reference).
    """

    step: int
    """The base checkpoint's global step."""
    directory: str
    """The base checkpoint's backend directory (``.../recover/step_{B:08d}/state``), where the
    backend finds its own metadata of the base (tree.json, DCP's .metadata)."""
    recover_dir: str
    """The root's ``recover/`` directory: every key below is relative to it."""
    files: Mapping[str, Mapping[str, Any]]
    """Every file the base uses (its own and those it refers to) that is still present with
    its recorded size, by key: its manifest entry (``size``, ``crc32c``, and ``xxh128``, the
    content hash of ``core.content_hash``, where its writer computed one). A backend refers
    only to keys listed here, and only where the entry's ``xxh128`` equals the hash of the
    bytes it would write (plus the same shape, dtype and sharding, which it checks in its
    own metadata)."""


@runtime_checkable
class WriteHandle(Protocol):
    """A write started by :meth:`Backend.write`.

    Concurrency contract: ``wait`` is called from the manager's background commit thread (at
    least once; a handle allows any number of calls), which need not be the thread that
    started the write. ``checksums`` is read on that thread after ``wait`` returned.
    """

    def wait(self) -> None:
        """Block until this process's part of the write is finished and its data durable.

        May block for as long as the write takes. Raises whatever made the write fail (the
        manager chains it with the step and path); later calls raise the same error.
        """

    @property
    def checksums(self) -> Mapping[str, Mapping[str, Any]] | None:
        """Manifest entries (``{"size": n, "crc32c": hex}``, the commit's algorithm) of the
        files the backend computed from the bytes it wrote and made durable itself, by path
        relative to the directory it wrote; the commit takes those instead of reading the
        files back (it still checks their sizes). None: not computed, the commit checksums
        every file. Read after ``wait`` returned; never blocks.

        An incremental backend adds ``"xxh128"`` (``core.content_hash``) to the entries of
        the data files it may later refer to."""

    @property
    def references(self) -> Mapping[str, Mapping[str, Any]] | None:
        """Files of the write's ``IncrementalBase`` this checkpoint uses instead of writing
        them again: ``{key: the base's entry}`` (keys of ``IncrementalBase.files``). None or
        empty: the write refers to nothing (always so without a base). Read after ``wait``
        returned; never blocks."""


@runtime_checkable
class Backend(Protocol):
    """What the manager needs from a framework.

    A backend writes the array state of one checkpoint into ``directory`` (a directory that
    does not exist yet; the backend creates it, and it should only appear complete, e.g. via a
    temp name + rename) and reads it back. Everything else (when to save, the commit marker,
    driver state, retention) is the manager's job.

    Threads: every method is called from one thread, the training loop's (the manager's
    caller); only a write handle's ``wait`` and ``checksums`` run on the manager's commit
    thread, possibly while the training thread calls ``write`` or ``barrier`` again.
    Processes: in a run of several processes every process calls ``write``, ``read``,
    ``host_copy``, ``barrier`` and ``broadcast_int`` in the same order with the same
    arguments (they may be collectives); ``rng_state``/``set_rng_state`` are per process.
    """

    #: short name recorded in driver.json, e.g. "orbax" or "dcp"; a checkpoint is read only
    #: by a backend of the same name.
    name: str

    @property
    def features(self) -> BackendFeatures:
        """What this backend can do beyond the required members; constant for its life."""

    @property
    def process_index(self) -> int:
        """This process's index in the run, 0 on the primary. Never blocks."""

    @property
    def process_count(self) -> int:
        """The number of processes in the run (1 for a single process). Never blocks."""

    def barrier(self, name: str, timeout_s: float) -> None:
        """Block until every process reached the barrier ``name`` (unique per run), at most
        ``timeout_s`` seconds (then raise). Returns at once in a single process."""

    def broadcast_int(self, value: int) -> int:
        """Return the primary process's ``value`` on every process. A collective: blocks
        until every process called it; returns ``value`` at once in a single process."""

    def write(self, directory: str, state: Any, *, asynchronous: bool,
              base: IncrementalBase | None = None) -> WriteHandle:
        """Start writing ``state`` into ``directory``.

        Blocks until the state is staged: from then on the caller may mutate, donate or free
        the arrays it passed. With ``asynchronous=False`` the write is finished on return.
        Called on every process with the same directory. Raises, before any I/O, naming the
        tree path of a value that cannot be written.

        ``base``: given only to a backend with ``features.incremental`` when the run saves
        incrementally; see :class:`IncrementalBase`. Before the root's first commit it is a
        base with no ``files`` (step -1, directory ""): the backend refers to nothing but
        still records the content hashes the next save compares.
        """

    def read(self, directory: str, like: Any, *, claims: DeferredChecks | None = None,
             partial: bool = False,
             references: Mapping[str, Mapping[str, Any]] | None = None) -> Any:
        """Read the state in ``directory`` into the structure, shapes, dtypes and placement of
        ``like`` (concrete or abstract leaves). Raises ``TreeMismatchError`` listing every
        mismatching tree path. Blocks until the data is read.

        ``partial``: ``like`` is a subtree of what was saved; what it leaves out is not read
        (and not a mismatch), a path of ``like`` that was never saved still is. A backend
        that reads whole files per array limits ``claims`` to them (``DeferredChecks.limit``).

        ``claims``: given only to a backend with ``features.verifies_reads`` (None
        otherwise); the backend claims the files it checks itself and must ``close`` the
        claims before its bulk read (a backend that claims nothing closes them at once).
        The value returned goes through :meth:`finish_read` before the caller sees it.

        ``references``: the checkpoint's references (its manifest's ``refs``: ``{key:
        entry}``, keys relative to ``recover/``, the parent of the checkpoint directory that
        holds ``directory``), given only to a backend with ``features.incremental``, already
        verified by the manager. The backend reads data from these files and from
        ``directory``, never from any other file.
        """

    def finish_read(self, value: Any) -> Any:
        """The final value of what :meth:`read` returned (the state, or one item), called once
        the checkpoint is judged valid. A backend that fills the caller's live objects
        without ``reads_in_place`` (OrbaxBackend with live NNX objects) does it here, so that
        a read the manager throws away (its checksums failed alongside it) never changes
        them; others return ``value``."""

    def host_copy(self, state: Any) -> Any:
        """A copy of ``state`` in host memory that stays valid while training goes on (used
        by exports). May gather shards across processes: then a collective."""

    def versions(self) -> dict[str, str]:
        """Versions of the libraries this backend writes with (recorded in driver.json).
        Called at every save on the training thread: cheap."""

    def rng_state(self) -> Any:
        """JSON-safe (codec) state of framework-global RNGs of this process, or None."""

    def set_rng_state(self, state: Any) -> None:
        """Restore what :meth:`rng_state` returned (missing entries warn, not raise)."""

    def left_out(self, saved: Any, scope: dict[str, Any]) -> str | None:
        """A warning naming objects of ``scope`` (the local variables of the code that called
        the first save) whose state ``saved`` leaves out, or None. A diagnostic: the manager
        ignores what it raises."""

    def close(self) -> None:
        """Wait for writes in flight (their errors stay on their handles) and release the
        backend's resources. Called by a manager that created its backend itself; a backend
        a caller passed in is closed by that caller. Idempotent."""


class ObjectStorageBackend(Backend, Protocol):
    """A backend that declares ``features.object_storage``: it has this member too (others
    need not, so it is not part of :class:`Backend`)."""

    def attach_storage(self, storage: Storage) -> None:
        """Write and read the locations of ``storage`` (URLs of an object-store root) through
        it from now on. Called once by the manager, before any write or read."""


#: What :func:`check_backend` requires: the members a manager uses while it opens and
#: closes, before any save or restore (test stubs implement just these).
_CHECKED = ("name", "features", "process_index", "process_count", "barrier", "broadcast_int",
            "close")


def check_backend(backend: Any) -> None:
    """Raise ConfigError unless ``backend`` has the members of :class:`Backend` a manager
    needs from the start (``_CHECKED``): a typo such as ``backend="orbax"`` fails at
    construction, naming the fix, rather than deep inside the first save."""
    missing = [name for name in _CHECKED if not hasattr(backend, name)]
    if missing:
        raise ConfigError(
            f"backend must be a jaxckpt.backends.base.Backend object, got {backend!r}. Leave "
            f"backend=None for Orbax (JAX) or pass an instance such as "
            f"jaxckpt.backends.orbax.backend.OrbaxBackend(); for PyTorch use "
            f"torch_bridge.DcpCheckpointManager. (Missing: {', '.join(missing)}.)")


class SingleProcess:
    """The trivial members of a single-process backend with no optional capability.

    Process facts of a single process (every collective is the identity), no features
    (synchronous writes only), nothing to close, finish or warn about, no global RNG. A
    backend subclasses this and adds ``name``, ``write``, ``read``, ``host_copy`` and
    ``versions``, overriding what it does differently (``features`` among them).
    Stateless: safe from any thread.
    """

    features = BackendFeatures()
    process_index = 0
    process_count = 1

    def barrier(self, name: str, timeout_s: float) -> None:
        return None

    def broadcast_int(self, value: int) -> int:
        return value

    def finish_read(self, value: Any) -> Any:
        return value

    def left_out(self, saved: Any, scope: dict[str, Any]) -> str | None:
        return None

    def rng_state(self) -> Any:
        return None

    def set_rng_state(self, state: Any) -> None:
        return None

    def close(self) -> None:
        return None
