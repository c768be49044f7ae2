"""The commit manifest: what a checkpoint's ``COMMITTED`` marker says, and checks against it.

Owns: the manifest's format (``jaxckpt.commit/2``: every file's size and crc32c, optionally
its xxh128 content hash; ``jaxckpt.commit/3`` adds ``refs``, the files of earlier checkpoints
an incremental checkpoint uses, by ref key; format 1, crc32, is still read), parsing it with
every sanity check a restore relies on (paths stay inside the checkpoint, refs name earlier
checkpoints, one known checksum per entry, a step, a time, at least one file), serialising it
(byte-identical across releases: tests/integration/test_golden_checkpoint.py), which
entries' checksums may be deferred to the read (``DEFER_CHECKSUMS_OVER``), and the wording
of what is wrong with one file compared with its entry.

Pure: no I/O (the store observes sizes and checksums through its storage and hands them
here). Must not import: jax, orbax, torch, os.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from ..errors import CheckpointCorruptError
from .checksum import ALGORITHMS
from .content_hash import HASH_NAME, is_hash
from .layout import COMMIT_MARKER, parse_ref_key

__all__ = [
    "MANIFEST_FORMAT",
    "REFS_MANIFEST_FORMAT",
    "READABLE_MANIFEST_FORMATS",
    "DEFER_CHECKSUMS_OVER",
    "Manifest",
    "algorithm_of",
    "safe_relpath",
    "is_metadata",
    "deferrable",
    "size_problem",
    "checksum_problem",
    "outside_problem",
    "missing_problem",
    "unreadable_problem",
    "unlisted_problem",
]

# Format 2 records crc32c checksums (jaxckpt/checksum.py); format 1, crc32. Format 3 is
# format 2 plus ``refs`` and ``referenced_bytes``, written only when a checkpoint refers to
# files of earlier ones (so that a plain checkpoint stays byte-identical to format 2, and a
# release that cannot follow refs refuses a checkpoint it would restore incompletely).
MANIFEST_FORMAT = "jaxckpt.commit/2"
REFS_MANIFEST_FORMAT = "jaxckpt.commit/3"
READABLE_MANIFEST_FORMATS = ("jaxckpt.commit/1", MANIFEST_FORMAT, REFS_MANIFEST_FORMAT)

#: Files larger than this many bytes may have their checksum checked while a backend reads the
#: checkpoint instead of before (``CheckpointStore.verify(defer_over=...)``,
#: ``verify_deferred``).
#: Why only those: readers act on metadata (shapes to allocate, names to open, offsets to
#: cut at), so a metadata file that is damaged yet still parses must never be interpreted.
#: Every file up to this size, and every file named like metadata whatever its size
#: (``is_metadata``), is therefore checksummed before anything is read. What is left is
#: bulk array bytes: damaged, they can only decode to wrong numbers, which the manager
#: drops when their checksum fails. Why 1 MiB: the metadata written here (driver.json,
#: tree.json, zarr.json, Orbax's _METADATA, DCP's .metadata, objects.json) stays far below
#: it for ordinary models, and it equals OrbaxBackend's default ``pack_leaf_bytes``, so
#: every array file of a default Orbax checkpoint but the smallest packs is above it and the
#: up-front pass is a handful of small reads.
DEFER_CHECKSUMS_OVER = 1024 * 1024
# Names of files that are metadata whatever their size (the tree.json of a state with
# about ten thousand leaves passes 1 MiB): never deferred.
_METADATA_SUFFIXES = (".json", ".txt", ".pbtxt", ".ocdbt")
_METADATA_NAMES = frozenset({COMMIT_MARKER, "_METADATA", "_CHECKPOINT_METADATA", "_sharding"})


def is_metadata(rel: str) -> bool:
    """Whether a manifest path names a file that some reader parses (rather than bulk data)."""
    name = rel.rsplit("/", 1)[-1]
    return (name.startswith(".") or name in _METADATA_NAMES
            or name.endswith(_METADATA_SUFFIXES))


def deferrable(rel: str, info: dict[str, Any], over: int) -> bool:
    """Whether ``rel``'s checksum may wait until its bytes are being read (see
    ``DEFER_CHECKSUMS_OVER``)."""
    return info["size"] > over and not is_metadata(rel)


def algorithm_of(info: dict[str, Any]) -> str:
    """The checksum algorithm of one (parsed, hence valid) manifest entry."""
    return next(name for name in ALGORITHMS if name in info)


def safe_relpath(rel: Any) -> bool:
    """A manifest path must stay inside its checkpoint directory."""
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or "\x00" in rel:
        return False
    parts = rel.split("/")
    return all(p not in ("", ".", "..") for p in parts)


# --- what is wrong with one file (the store observes, these say it) --------------------------
def outside_problem(rel: str) -> str:
    return (f"{rel}: resolves outside the checkpoint (a symlink); refusing to read "
            f"data that does not belong to it")


def missing_problem(rel: str) -> str:
    return f"{rel}: missing"


def unreadable_problem(rel: str, exc: BaseException) -> str:
    return f"{rel}: unreadable ({exc})"


def unlisted_problem(rel: str) -> str:
    return f"{rel}: not in the manifest (added after the commit)"


def size_problem(rel: str, info: dict[str, Any], size: int) -> str | None:
    """What is wrong with a file of ``size`` bytes listed as ``info`` (None: nothing)."""
    if size != info["size"]:
        return f"{rel}: size {size} bytes, manifest says {info['size']} (truncated or overwritten)"
    return None


def checksum_problem(rel: str, info: dict[str, Any], checksum: str) -> str | None:
    """What is wrong with a file whose bytes have ``checksum`` (in ``info``'s algorithm)
    (None: nothing)."""
    algorithm = algorithm_of(info)
    if checksum != info[algorithm]:
        return f"{rel}: {algorithm} {checksum}, manifest says {info[algorithm]} (contents altered)"
    return None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    """The content of a ``COMMITTED`` marker."""

    step: int
    """Global step of the checkpoint."""
    files: dict[str, dict[str, Any]]
    """Relative path -> {"size": int, "crc32c": "8 hex digits"} for every file written
    ("crc32" instead of "crc32c" in format-1 manifests; see jaxckpt/checksum.py)."""
    created: float
    """Unix time of the commit."""
    refs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Ref key (``layout.ref_key``: the path under ``recover/`` of a file physically held by
    an earlier checkpoint) -> that file's entry, for every file this checkpoint uses without
    having written it (incremental saves). Empty for a plain checkpoint."""

    @property
    def total_bytes(self) -> int:
        """Bytes of the files this checkpoint wrote itself."""
        return sum(int(f["size"]) for f in self.files.values())

    @property
    def referenced_bytes(self) -> int:
        """Bytes of the earlier checkpoints' files this one uses (``refs``)."""
        return sum(int(f["size"]) for f in self.refs.values())

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {"format": MANIFEST_FORMAT, "step": self.step,
                                "created": self.created, "total_bytes": self.total_bytes,
                                "files": self.files}
        if self.refs:
            body.update(format=REFS_MANIFEST_FORMAT, refs=self.refs,
                        referenced_bytes=self.referenced_bytes)
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> Manifest:
        """The manifest in ``data`` (read from checkpoint ``where``, named in errors); raises
        ``CheckpointCorruptError`` saying what is wrong when it cannot be trusted."""
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(
                f"{where}: commit marker is not valid JSON ({exc})") from exc
        if not isinstance(body, dict) or body.get("format") not in READABLE_MANIFEST_FORMATS:
            found = body.get("format") if isinstance(body, dict) else body
            raise CheckpointCorruptError(
                f"{where}: commit marker has format {found!r}, "
                f"expected one of {', '.join(READABLE_MANIFEST_FORMATS)}")
        files = body.get("files")
        if not isinstance(files, dict):
            raise CheckpointCorruptError(f"{where}: commit marker has no file list")
        _check_entries(files, body["format"], where)
        refs = _parsed_refs(body, where)
        step, created = body.get("step"), body.get("created", 0.0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointCorruptError(
                f"{where}: commit marker has step {step!r}, not an int >= 0")
        if (isinstance(created, bool) or not isinstance(created, (int, float))
                or not math.isfinite(created)):
            raise CheckpointCorruptError(
                f"{where}: commit marker has created={created!r}, not a time")
        if not files:
            raise CheckpointCorruptError(
                f"{where}: commit marker lists no files; a real checkpoint always has some, so "
                f"this marker cannot vouch for anything")
        _check_ref_owners(refs, step, where)
        return cls(step=step, files=files, created=float(created), refs=refs)


def _parsed_refs(body: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """The ``refs`` of a parsed manifest body (format 3 only), every key checked."""
    if "refs" not in body:
        return {}
    refs = body["refs"]
    if body["format"] != REFS_MANIFEST_FORMAT or not isinstance(refs, dict):
        raise CheckpointCorruptError(
            f"{where}: commit marker has refs, which only a {REFS_MANIFEST_FORMAT} marker "
            f"may hold as a table of ref keys")
    for key in refs:
        parsed = parse_ref_key(key) if isinstance(key, str) else None
        if parsed is None or not safe_relpath(parsed[1]):
            raise CheckpointCorruptError(
                f"{where}: commit marker refers to {key!r}, not a file of an earlier "
                f"checkpoint of this root; refusing to trust this checkpoint")
    _check_entries(refs, body["format"], where)
    return refs


def _check_ref_owners(refs: dict[str, dict[str, Any]], step: int, where: str) -> None:
    """A ref names a file of an EARLIER checkpoint (which cannot, in turn, refer back)."""
    for key in refs:
        owner = parse_ref_key(key)
        assert owner is not None  # checked by _parsed_refs
        if owner[0] >= step:
            raise CheckpointCorruptError(
                f"{where}: commit marker of step {step} refers to {key!r}, a file of step "
                f"{owner[0]}; a checkpoint may only refer to earlier steps")


def _check_entries(files: dict[Any, Any], fmt: str, where: str) -> None:
    """Every entry names a path inside the checkpoint, an int size, exactly one checksum its
    format allows and, optionally, a content hash (``HASH_NAME``)."""
    # Format 1 knows crc32 only; format 2 entries carry crc32c, or crc32 where the
    # writer had no crc32c extension.
    allowed = ("crc32",) if fmt == "jaxckpt.commit/1" else ALGORITHMS
    for rel, info in files.items():
        if not safe_relpath(rel):
            raise CheckpointCorruptError(
                f"{where}: commit marker names {rel!r}, a path outside the checkpoint; "
                f"refusing to trust this checkpoint")
        if (not isinstance(info, dict) or not isinstance(info.get("size"), int)
                or [isinstance(info.get(name), str) for name in allowed].count(True) != 1
                or (HASH_NAME in info and not is_hash(info[HASH_NAME]))):
            raise CheckpointCorruptError(f"{where}: malformed manifest entry for {rel!r}")
