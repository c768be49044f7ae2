"""Names on disk: every file and directory name jaxckpt writes under a root, and their parsing.

Owns the layout of a root, strings only: ``.lock``, ``pins.json``, ``tier.json``;
``recover/step_{global_step:08d}/`` (``COMMITTED`` or ``RETIRED``, ``driver.json``,
``driver.p{index:05d}.json``, ``done.p{index:05d}``, ``state/``);
``recover/items/{name}/v{version:06d}/``; ``recover/superseded/``; ``export/
epoch{E}epochstep{S}globalstep{G}/``; ``.tmp-*`` entries. docs/design.md draws the tree.
Each format function and its parser are inverse (``parse_*`` returns None for a name of
another kind); tests/unit/core/test_layout.py holds the table.

Pure: no I/O. Must not import: jax, orbax, torch, or any jaxckpt module.
"""

from __future__ import annotations

import re

__all__ = [
    "RECOVER", "EXPORT", "ITEMS", "SUPERSEDED", "STATE_DIR", "TMP_PREFIX", "LOCK_FILE",
    "PINS_FILE", "TIER_FILE", "COMMIT_MARKER", "RETIRED_MARKER", "DRIVER_FILE", "TREE_FILE",
    "OBJECTS_FILE",
    "ROOT_NAMES", "SYSTEM_NAMES",
    "step_dirname", "parse_step_dirname", "ref_key", "parse_ref_key", "version_dirname",
    "parse_version_dirname",
    "is_item_dirname", "export_dirname", "parse_export_dirname", "local_driver_filename",
    "parse_local_driver_filename", "done_marker_name", "parse_done_marker_name",
    "superseded_name", "tmp_name", "is_tmp_name", "allowed_in_recover", "allowed_in_export",
]

RECOVER = "recover"
EXPORT = "export"
ITEMS = "items"
SUPERSEDED = "superseded"
#: The backend's directory inside a checkpoint (and inside each item version).
STATE_DIR = "state"
#: Entries named so are being written or deleted; start-up cleanup removes them.
TMP_PREFIX = ".tmp-"
LOCK_FILE = ".lock"
#: The steps pinned by hand, never deleted by retention (jaxckpt.commit.pins).
PINS_FILE = "pins.json"
#: In a local tier's root only: the durable root it belongs to (jaxckpt.manager.local_tier).
TIER_FILE = "tier.json"
COMMIT_MARKER = "COMMITTED"
#: In a step directory that is no longer a checkpoint but still holds files later
#: (incremental) checkpoints refer to: which files it keeps and for whom (jaxckpt.commit.retire).
RETIRED_MARKER = "RETIRED"
DRIVER_FILE = "driver.json"
#: Written by the Orbax backend into its directory (jaxckpt/backends/orbax/backend.py).
TREE_FILE = "tree.json"
#: Written by the DCP backend into its directory (torch_bridge/dcp/backend.py).
OBJECTS_FILE = "objects.json"

#: What jaxckpt itself writes directly under a root. Any other entry there (or under recover/
#: and export/, see ``allowed_in_recover``/``allowed_in_export``) means another tool owns the
#: directory: jaxckpt then refuses the root rather than write beside, or clean up, files it
#: does not understand. A new file or directory written into a root must be added here.
ROOT_NAMES = frozenset({RECOVER, EXPORT, LOCK_FILE, PINS_FILE, TIER_FILE})
#: Entries the filesystem or the OS put into any directory (a mount point's lost+found).
SYSTEM_NAMES = frozenset({"lost+found", ".DS_Store"})

_STEP_RE = re.compile(r"^step_(\d{8,})$")
_VERSION_RE = re.compile(r"^v(\d{6,})$")
_ITEM_DIR_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_EXPORT_RE = re.compile(r"^epoch(\d+)epochstep(\d+)globalstep(\d+)$")
_LOCAL_DRIVER_RE = re.compile(r"^driver\.p(\d{5,})\.json$")
_DONE_RE = re.compile(r"^done\.p(\d{5,})$")


def step_dirname(step: int) -> str:
    """``recover/``'s name for the checkpoint of global step ``step``."""
    return f"step_{step:08d}"


def parse_step_dirname(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def ref_key(step: int, rel: str) -> str:
    """How an incremental checkpoint names a file of an earlier checkpoint it uses: the path
    of that file relative to ``recover/`` (``step_00000005/state/arrays/leaf_000001/c/0``)."""
    return f"{step_dirname(step)}/{rel}"


def parse_ref_key(key: str) -> tuple[int, str] | None:
    """``(step, path inside that checkpoint)`` of a ``ref_key``; None when ``key`` is not one
    (the caller also checks the path with ``manifest.safe_relpath``)."""
    head, sep, rel = key.partition("/")
    step = parse_step_dirname(head)
    if step is None or not sep or not rel:
        return None
    return step, rel


def version_dirname(version: int) -> str:
    """``items/{name}/``'s name for one version of an item."""
    return f"v{version:06d}"


def parse_version_dirname(name: str) -> int | None:
    match = _VERSION_RE.match(name)
    return int(match.group(1)) if match else None


def is_item_dirname(name: str) -> bool:
    """Whether ``name`` may be an item's directory under ``recover/items/``."""
    return bool(_ITEM_DIR_RE.match(name))


def export_dirname(epoch: int, epoch_step: int, global_step: int) -> str:
    return f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"


def parse_export_dirname(name: str) -> tuple[int, int, int] | None:
    """(epoch, epoch_step, global_step) of an export directory's name."""
    match = _EXPORT_RE.match(name)
    return (int(match.group(1)), int(match.group(2)), int(match.group(3))) if match else None


def local_driver_filename(process_index: int) -> str:
    """The file holding process ``process_index``'s local driver state (not the primary's:
    that is in ``driver.json``)."""
    return f"driver.p{process_index:05d}.json"


def parse_local_driver_filename(name: str) -> int | None:
    match = _LOCAL_DRIVER_RE.match(name)
    return int(match.group(1)) if match else None


def done_marker_name(process_index: int) -> str:
    """The empty file by which a non-primary process says its writes of a save are durable."""
    return f"done.p{process_index:05d}"


def parse_done_marker_name(name: str) -> int | None:
    match = _DONE_RE.match(name)
    return int(match.group(1)) if match else None


def superseded_name(dirname: str, reason: str, when: int, tag: str) -> str:
    """The name under ``recover/superseded/`` of checkpoint ``dirname`` moved aside at unix
    time ``when`` for ``reason`` (``tag`` keeps two moves in one second apart)."""
    return f"{dirname}.{reason}.{when}.{tag}"


def tmp_name(name: str, tag: str) -> str:
    """A temporary name for ``name`` (``tag`` keeps concurrent writers apart)."""
    return f"{TMP_PREFIX}{name}.{tag}"


def is_tmp_name(name: str) -> bool:
    return name.startswith(TMP_PREFIX)


def allowed_in_recover(name: str) -> bool:
    """Whether jaxckpt may have written an entry of this name directly under ``recover/``
    (temporary entries aside)."""
    return parse_step_dirname(name) is not None or name in (ITEMS, SUPERSEDED)


def allowed_in_export(name: str) -> bool:
    """Whether jaxckpt may have written an entry of this name directly under ``export/``
    (temporary entries aside)."""
    return parse_export_dirname(name) is not None
