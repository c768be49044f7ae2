"""What an incremental write already knows about a chunk file's bytes without reading them.

Owns: :class:`KnownHashes` (with :class:`Seen`, what one write's caller saw of its arrays),
kept by one backend across its saves, per storage name (one
chunk file of a single-process native write): the ``jax.Array`` objects whose bytes the
last write of that name put in the file (weak references: an old trained array must not
stay alive on its device for the sake of a hash), where they start in the file and the
content hash of the file. A ``jax.Array`` is immutable, so the very same object, not
deleted, holds the same bytes: its file's hash is known without staging, filling or
hashing anything. Also per name: how many writes in a row found the file changed, so that a
file that changes at every save (a trained parameter) is written without hashing it, the
hash pass being pure cost there; two writes in every ``PROBE_EVERY`` hash it again, so a
file that stopped changing is referred to again soon.

Must not import: torch, orbax. Concurrency: used by every hashing thread of a write (a lock).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

__all__ = ["KnownHashes", "Seen", "PROBE_EVERY", "HOT_AFTER"]

#: Writes in a row that found a file changed before the next ones skip its hash.
HOT_AFTER = 2
#: A file skipped for being hot is still hashed at two writes in a row of every this many.
PROBE_EVERY = 8


class _Known:
    __slots__ = ("refs", "offset", "digest", "changed", "writes")

    def __init__(self) -> None:
        self.refs: tuple[weakref.ref[Any], ...] = ()
        self.offset = -1
        self.digest: str | None = None
        self.changed = 0  # writes in a row that found the file changed (or did not look)
        self.writes = 0


def _same_objects(refs: tuple[weakref.ref[Any], ...], objects: tuple[Any, ...]) -> bool:
    if not objects or len(refs) != len(objects):
        return False
    for ref, obj in zip(refs, objects, strict=True):
        if ref() is not obj or not isinstance(obj, jax.Array) or obj.is_deleted():
            return False
    return True


def _weak(objects: tuple[Any, ...]) -> tuple[weakref.ref[Any], ...]:
    """Weak references to ``objects`` when every one is a live jax.Array, else ()."""
    try:
        if all(isinstance(obj, jax.Array) and not obj.is_deleted() for obj in objects):
            return tuple(weakref.ref(obj) for obj in objects)
    except TypeError:  # an array type without weak references: never known by identity
        pass
    return ()


class Seen(NamedTuple):
    """What a write's caller thread saw of one storage name's arrays (``KnownHashes.see``):
    taken before ``write`` returns, so that nothing of the write holds the arrays
    themselves (an async write would otherwise keep old arrays alive on their device)."""

    refs: tuple[weakref.ref[Any], ...]
    """Weak references to the arrays (() unless every one is a live jax.Array)."""
    kept: bool
    """The very arrays the last write of this name held."""
    known: tuple[int, str] | None
    """Their file's (offset, content hash), when kept and hashed then."""


class KnownHashes:
    """The hashes of chunk files known from the identity of their arrays (see the module
    docstring). One per backend; each incremental write asks ``see`` on its caller's
    thread, then its hashing threads ask ``skip_hash`` and ``record`` per storage name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, _Known] = {}

    def see(self, objects: Mapping[str, tuple[Any, ...]]) -> dict[str, Seen]:
        """``objects``: by storage name, the leaves (in plan order) whose bytes make up that
        name's chunk file in this write."""
        seen: dict[str, Seen] = {}
        with self._lock:
            for name, arrays in objects.items():
                known = self._by_name.get(name)
                kept = known is not None and _same_objects(known.refs, arrays)
                if kept:
                    assert known is not None
                    digest = None if known.digest is None else (known.offset, known.digest)
                    seen[name] = Seen(known.refs, True, digest)
                else:
                    seen[name] = Seen(_weak(arrays), False, None)
        return seen

    def skip_hash(self, name: str, seen: Seen) -> bool:
        """Whether this write of ``name`` may write its file without hashing it: the file
        changed in each of the last ``HOT_AFTER`` writes, its arrays are new ones, and this
        is not a probing write. A file written unhashed is never referred to by content."""
        with self._lock:
            known = self._by_name.get(name)
            if known is None or known.changed < HOT_AFTER or seen.kept:
                return False  # (kept since the last write: likely frozen now, look)
            # Probing takes two writes in a row: the first records a hash, the second
            # compares with it (the file before the first had none).
            return known.writes % PROBE_EVERY > 1

    def record(self, name: str, seen: Seen, offset: int, digest: str | None, *,
               changed: bool | None) -> None:
        """What this write of ``name`` found: the file's offset and hash (None: not hashed)
        and whether it differs from the base's file (True also when not hashed; None: the
        base has no such file to compare with, which leaves the count as it was)."""
        with self._lock:
            known = self._by_name.setdefault(name, _Known())
            known.writes += 1
            if changed is not None:
                known.changed = known.changed + 1 if changed else 0
            if digest is None:
                known.refs, known.offset, known.digest = (), -1, None
            else:
                known.refs, known.offset, known.digest = seen.refs, offset, digest
