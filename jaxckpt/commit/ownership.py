"""Whose directory is this: telling a jaxckpt root or checkpoint from anything else.

Owns: ``foreign_entries`` (what under a root jaxckpt never writes), ``check_root`` (refuse
a root that another tool owns, before anything is written), and ``classify_path`` (what a
path given to a CLI command is: missing, a file, empty, foreign, a root or a checkpoint),
with the hint that names ``import-orbax`` when the foreign entries look like Orbax's.

These read names only, never contents, and write nothing. They look at a local filesystem
(``os``), where the paths a user types live; for a root on an object store ``check_root``
asks the same question through its ``jaxckpt.storage.base.Storage`` (``foreign_objects``).

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import os
import re
from typing import Literal

from jaxckpt.core.layout import (
    COMMIT_MARKER,
    DRIVER_FILE,
    EXPORT,
    ITEMS,
    RECOVER,
    ROOT_NAMES,
    SYSTEM_NAMES,
    allowed_in_export,
    allowed_in_recover,
    is_tmp_name,
    parse_step_dirname,
    parse_version_dirname,
)
from jaxckpt.errors import CheckpointRootError
from jaxckpt.storage.base import Storage

__all__ = ["PathKind", "foreign_entries", "foreign_objects", "check_root", "classify_path"]

#: What a path given to a command is (see ``classify_path``).
PathKind = Literal["missing", "unreadable", "file", "empty", "foreign", "root", "checkpoint"]

# Names by which another tool's checkpoint is recognised, for a hint in the error: Orbax's
# step directories are plain numbers (or prefix_number) holding _CHECKPOINT_METADATA.
_ORBAX_HINTS = frozenset({"_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt",
                          "commit_success.txt"})


def _listdir(path: str) -> list[str] | None:
    """Names in ``path``; None when it is not a directory (missing, a file)."""
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return None


def foreign_entries(root: str) -> list[str]:
    """Entries under ``root`` that jaxckpt never writes, as paths relative to it (sorted;
    directories end in '/'). Empty for a missing or empty directory and for one that holds
    only what jaxckpt writes: ``.lock``, ``recover/`` (step directories, ``items/``,
    ``superseded/``, temporary ``.tmp-*`` entries) and ``export/`` (export directories,
    temporary entries). Reads names only, never contents; writes nothing."""
    names = _listdir(root)
    if names is None:
        return []
    allowed = {RECOVER: allowed_in_recover, EXPORT: allowed_in_export}
    found = []
    for name in names:
        full = os.path.join(root, name)
        is_dir = os.path.isdir(full) and not os.path.islink(full)
        shown = name + "/" if is_dir else name
        if name in SYSTEM_NAMES or is_tmp_name(name):
            continue
        if name not in ROOT_NAMES or (name in allowed) != is_dir:
            found.append(shown)
            continue
        if name in allowed:  # a directory of ours: check one level down too
            for child in _listdir(full) or []:
                if not (is_tmp_name(child) or child in SYSTEM_NAMES or allowed[name](child)):
                    found.append(f"{name}/{child}")
    return found


def foreign_objects(storage: Storage, root: str) -> list[str]:
    """``foreign_entries`` of a root on an object store, listed through ``storage`` (a
    "directory" there is a key prefix, a name ending in "/")."""
    allowed = {RECOVER: allowed_in_recover, EXPORT: allowed_in_export}
    found = []
    for entry in storage.list_names(root):
        name, is_dir = entry.rstrip("/"), entry.endswith("/")
        if name in SYSTEM_NAMES or is_tmp_name(name):
            continue
        if name not in ROOT_NAMES or (name in allowed) != is_dir:
            found.append(entry)
            continue
        if name in allowed:
            for child in storage.list_names(f"{root}/{name}"):
                child = child.rstrip("/")
                if not (is_tmp_name(child) or child in SYSTEM_NAMES or allowed[name](child)):
                    found.append(f"{name}/{child}")
    return found


def _describe_foreign(path: str, found: list[str]) -> str:
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    looks_orbax = any(entry.rstrip("/") in _ORBAX_HINTS for entry in found) or any(
        re.fullmatch(r"(?:\w+_)?\d+/", entry)
        and os.path.exists(os.path.join(path, entry, "_CHECKPOINT_METADATA"))
        for entry in found)
    hint = (f" It looks like an Orbax checkpoint: `jaxckpt import-orbax {path} NEW_ROOT` (or "
            f"jaxckpt.import_orbax(src, new_root)) turns it into a jaxckpt checkpoint without "
            f"changing it." if looks_orbax else "")
    return f"{path!r} holds entries jaxckpt never writes: {shown}.{hint}"


def check_root(root: str, storage: Storage | None = None) -> None:
    """Raise ``CheckpointRootError`` when ``root`` holds entries jaxckpt did not write (see
    ``foreign_entries``; ``foreign_objects`` for a root on the object store ``storage``),
    naming some and the fix, or cannot be listed (what it holds is unknown, so nothing may
    be written there either). Reads names only; writes nothing."""
    try:
        found = foreign_entries(root) if storage is None else foreign_objects(storage, root)
    except Exception as exc:
        if storage is not None:
            # The object store's client: no credentials, endpoint unreachable, no bucket
            # (requests' errors, which the gs:// client raises, are OSErrors too).
            raise CheckpointRootError(
                f"checkpoint root {root!r} cannot be used: listing it failed: "
                f"{str(exc).rstrip('.')}. Fix: "
                f"check the endpoint, region and credentials (storage_options=, or "
                f"AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY for "
                f"s3://; STORAGE_EMULATOR_HOST or GOOGLE_APPLICATION_CREDENTIALS for gs://) "
                f"and that the bucket exists.") from exc
        if not isinstance(exc, OSError):
            raise
        raise CheckpointRootError(
            f"checkpoint root {root!r} cannot be used: listing it failed: {exc.strerror or exc} "
            f"({exc.filename}). Fix: pass another root, or give this user read and write "
            f"access to it (chmod/chown).") from exc
    if found:
        raise CheckpointRootError(
            f"refusing checkpoint root: {_describe_foreign(root, found)} jaxckpt writes into "
            f"and deletes under its root, so it never shares one with other files. Fix: pass "
            f"a new or empty directory as the root (e.g. a subdirectory of this one).")


def _looks_like_checkpoint(path: str, names: list[str]) -> bool:
    """A jaxckpt checkpoint directory, committed or not: it has the marker or driver state,
    or is named and placed like one (``recover/step_N``, ``items/NAME/vN``), even if empty
    (a job killed right after creating it)."""
    if COMMIT_MARKER in names or DRIVER_FILE in names:
        return True
    name, parent = os.path.basename(path), os.path.dirname(path)
    return bool((parse_step_dirname(name) is not None and os.path.basename(parent) == RECOVER)
                or (parse_version_dirname(name) is not None
                    and os.path.basename(os.path.dirname(parent)) == ITEMS))


def classify_path(path: str) -> tuple[PathKind, str]:
    """What ``path`` is, and a sentence saying so for the user: "missing", "unreadable"
    (no permission), "file", "empty" (a directory with nothing in it), "foreign" (holds
    entries jaxckpt never writes), "checkpoint" (one checkpoint directory, committed or
    partial) or "root"."""
    if not os.path.lexists(path):
        return "missing", f"no such file or directory: {path!r}"
    try:
        names = _listdir(path)
        found = foreign_entries(path)
    except OSError as exc:
        return "unreadable", f"cannot read {path!r}: {exc.strerror or exc} ({exc.filename})"
    if names is None:
        return "file", f"{path!r} is a file, not a jaxckpt checkpoint or root (a directory)"
    if _looks_like_checkpoint(path, names):
        return "checkpoint", f"{path!r} is a checkpoint directory"
    if not [name for name in names if name not in SYSTEM_NAMES]:
        return "empty", (f"{path!r} is an empty directory: not a jaxckpt checkpoint or root "
                         f"(nothing was ever saved here)")
    if found:
        return "foreign", f"not a jaxckpt checkpoint or root: {_describe_foreign(path, found)}"
    return "root", f"{path!r} is a checkpoint root"
