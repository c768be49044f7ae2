"""Importing checkpoints that plain Orbax wrote.

Owns: recognising the Orbax layouts (a ``CheckpointManager`` directory, one step directory,
one checkpointer directory), choosing the step, reading every item as Orbax's restore
without a target does, and saving it as a committed, verified jaxckpt checkpoint (the
source is only read): the tree itself for one ``default`` item or a checkpointer directory,
else ``{item name: tree}``; a ``JsonSave`` item of numbers and bools is kept, any other is
left out with a ``CheckpointWarning``.

Must not import at module level: jax, orbax (``import jaxckpt`` loads this module; both are
imported when ``import_orbax`` runs). Never imports torch.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

from jaxckpt.core.extras import requires_extra
from jaxckpt.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointRootError,
    CheckpointWarning,
    ConfigError,
)
from jaxckpt.storage.url import root_scheme

__all__ = ["import_orbax"]

# Orbax's own files: per checkpoint (step or single checkpointer directory), per PyTree item,
# per JSON item.
_STEP_METADATA = "_CHECKPOINT_METADATA"
_PYTREE_METADATA = "_METADATA"
_JSON_ITEM_FILE = "metadata"
_COMMIT_SUCCESS = "commit_success.txt"
# Step directory names: "100", or "{step_prefix}_100". Temporary directories of unfinished
# saves ("100.orbax-checkpoint-tmp-...") never match.
_STEP_NAME = re.compile(r"^(?:.+_)?(\d+)$")
_DEFAULT_ITEM = "default"


def import_orbax(src: str | os.PathLike[str], root: str | os.PathLike[str], *,
                 step: int | None = None,
                 storage_options: Mapping[str, Any] | None = None) -> str:
    """Turn an Orbax checkpoint into a committed, verified jaxckpt checkpoint under ``root``.

    Args:
      src: an Orbax ``CheckpointManager`` directory (step directories ``0/``, ``100/``, each
        with item subdirectories such as ``default/``), one such step directory, or one
        directory written by ``PyTreeCheckpointer`` / ``StandardCheckpointer``. Never changed.
      root: a jaxckpt root (new, empty, or one jaxckpt wrote): a local path, or an
        ``s3://`` / ``gs://`` URL; one holding other files is refused with
        ``CheckpointRootError`` and nothing is written into it.
      step: the Orbax step to import; None takes the latest. A single step directory has its
        own step (its name), a single checkpointer directory step 0. It becomes the global
        step of the jaxckpt checkpoint.
      storage_options: for an ``s3://`` / ``gs://`` ``root``, the client's settings
        (``jaxckpt.storage.url.parse_root``); None takes them from the standard environment.

    Returns the checkpoint directory (``root/recover/step_N``). ``CheckpointManager(root)
    .restore(like)`` then gives what Orbax's restore of ``src`` gives, bit for bit.

    Raises ``CheckpointNotFoundError`` when ``src`` is no Orbax checkpoint, ``ConfigError``
    for a step ``src`` does not hold (listing those it does) or a ``root`` inside ``src``,
    ``CheckpointRootError`` when ``root`` is another tool's directory or already holds that
    step.
    """
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ConfigError(f"step must be None (the latest) or an int >= 0, got {step!r}.")
    src_path = os.path.abspath(os.fspath(src))
    if root_scheme(root) == "local":  # a URL cannot lie inside a local src
        root = os.path.abspath(os.fspath(root))
        real_src, real_root = os.path.realpath(src_path), os.path.realpath(root)
        if real_root == real_src or real_root.startswith(real_src + os.sep):
            raise ConfigError(f"root {root!r} lies inside src {src_path!r}: writing it "
                              f"would change the Orbax checkpoint. Pass a root outside src.")
    chosen, kind, path = _choose(src_path, step)
    _require_orbax()
    state = _restore(kind, path)
    return _save(state, os.fspath(root), chosen, src_path, storage_options)


# --- finding the checkpoint ------------------------------------------------------------------
def _names(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointNotFoundError(f"no Orbax checkpoint at {path!r}: not a directory") from None


def _own_step(path: str) -> int:
    match = _STEP_NAME.match(os.path.basename(path))
    return int(match.group(1)) if match else 0


def _is_step_dir(path: str) -> bool:
    """A step directory: Orbax's step metadata and no tree of its own (items below)."""
    return (os.path.isfile(os.path.join(path, _STEP_METADATA))
            and not os.path.exists(os.path.join(path, _PYTREE_METADATA)))


def _choose(src: str, step: int | None) -> tuple[int, str, str]:
    """(step, "single" or "step", directory to read) for ``step`` of ``src``."""
    names = _names(src)
    if _PYTREE_METADATA in names:
        available = {_own_step(src): ("single", src)}
    elif _STEP_METADATA in names:
        available = {_own_step(src): ("step", src)}
    else:
        available = {}
        for name in names:
            match = _STEP_NAME.match(name)
            full = os.path.join(src, name)
            if match and os.path.isdir(full) and _is_step_dir(full):
                available[int(match.group(1))] = ("step", full)
        if not available:
            shown = ", ".join(names[:8]) or "nothing"
            raise CheckpointNotFoundError(
                f"{src!r} is not an Orbax checkpoint: no {_PYTREE_METADATA} or "
                f"{_STEP_METADATA} file and no step directories (0/, 100/, ...) holding one; "
                f"it holds {shown}. Pass the directory given to ocp.CheckpointManager, one of "
                f"its step directories, or a directory written by a PyTree/StandardCheckpointer.")
    if step is None:
        step = max(available)
    elif step not in available:
        raise ConfigError(f"{src!r} holds no Orbax step {step}; steps there: "
                          f"{', '.join(map(str, sorted(available)))}. Pass one of them as step "
                          f"(--step), or leave it out for the latest.")
    return (step, *available[step])


# --- reading with Orbax ----------------------------------------------------------------------
def _require_orbax() -> None:
    with requires_extra("jax", "import_orbax"):
        import jax  # noqa: F401
        import orbax.checkpoint  # noqa: F401


def _handlers(step_dir: str) -> dict[str, str]:
    """Item name -> Orbax handler class name, from the step's metadata (empty if unreadable:
    each item's own files then tell)."""
    try:
        with open(os.path.join(step_dir, _STEP_METADATA), encoding="utf-8") as handle:
            handlers = json.load(handle).get("item_handlers")
    except (OSError, ValueError, AttributeError):
        return {}
    return {name: str(cls) for name, cls in handlers.items()} if isinstance(handlers, dict) else {}


def _restore(kind: str, path: str) -> Any:
    import jax

    if jax.process_count() > 1:
        raise ConfigError("import_orbax runs in one process; run it outside the "
                          "jax.distributed job.")
    if kind == "single":
        return _restore_tree(path, _handlers_of_single(path))
    handlers = _handlers(path)
    items: dict[str, Any] = {}
    for name in _names(path):
        item_dir = os.path.join(path, name)
        if not os.path.isdir(item_dir):
            continue
        handler = handlers.get(name, "")
        json_file = _json_file(item_dir)
        if "Json" in handler or (not handler and json_file == _JSON_ITEM_FILE):
            value = _restore_json(item_dir, name, json_file)
            if value is not None:
                items[name] = value
        elif os.path.isfile(os.path.join(item_dir, _PYTREE_METADATA)):
            items[name] = _restore_tree(item_dir, handler)
        elif handler:
            raise CheckpointNotFoundError(
                f"{item_dir}: item {name!r} was written by {handler.rsplit('.', 1)[-1]}, which "
                f"import_orbax does not read (it reads PyTree, Standard and Json items).")
    if not items:
        raise CheckpointNotFoundError(f"{path!r} holds no Orbax item that import_orbax reads "
                                      f"(PyTree, Standard or Json).")
    return items[_DEFAULT_ITEM] if list(items) == [_DEFAULT_ITEM] else items


def _handlers_of_single(path: str) -> str:
    try:
        with open(os.path.join(path, _STEP_METADATA), encoding="utf-8") as handle:
            handler = json.load(handle).get("item_handlers")
    except (OSError, ValueError, AttributeError):
        return ""
    return handler if isinstance(handler, str) else ""


def _restore_tree(path: str, handler: str) -> Any:
    """What Orbax's own restore without a target returns for this item."""
    import orbax.checkpoint as ocp

    checkpointer = (ocp.StandardCheckpointer() if "Standard" in handler
                    else ocp.PyTreeCheckpointer())
    with checkpointer:
        return checkpointer.restore(path)


def _json_file(item_dir: str) -> str | None:
    """The one file a JSON item holds besides Orbax's commit marker ("metadata", or the item's
    name when a CheckpointManager wrote it); None when there is not exactly one."""
    files = [name for name in _names(item_dir) if name != _COMMIT_SUCCESS
             and os.path.isfile(os.path.join(item_dir, name))]
    return files[0] if len(files) == 1 else None


def _restore_json(path: str, name: str, filename: str | None) -> Any:
    import orbax.checkpoint as ocp

    if filename is None:
        raise CheckpointNotFoundError(f"{path}: JSON item {name!r} does not hold exactly one "
                                      f"file besides {_COMMIT_SUCCESS}; cannot tell which to read.")
    with ocp.Checkpointer(ocp.JsonCheckpointHandler(filename=filename)) as checkpointer:
        value = checkpointer.restore(path)
    bad = _non_numeric(value, "")
    if bad:
        warnings.warn(CheckpointWarning(
            f"Orbax item {name!r} ({path}) is JSON with values that are not numbers "
            f"({', '.join(bad[:3])}); jaxckpt checkpoints hold arrays and numbers only, so this "
            f"item is left out of the import."), stacklevel=4)
        return None
    return value


def _non_numeric(value: Any, where: str) -> list[str]:
    """Paths in a JSON value whose leaves are not int, float or bool."""
    if isinstance(value, dict):
        return [bad for key, child in value.items()
                for bad in _non_numeric(child, f"{where}[{key!r}]")]
    if isinstance(value, list):
        return [bad for i, child in enumerate(value)
                for bad in _non_numeric(child, f"{where}[{i}]")]
    return [] if isinstance(value, (int, float, bool)) else [where or "(the whole item)"]


# --- writing the jaxckpt checkpoint ----------------------------------------------------------
def _save(state: Any, root: str, step: int, src: str,
          storage_options: Mapping[str, Any] | None) -> str:
    from jaxckpt.config import RecoverConfig, StepInfo
    from jaxckpt.manager.manager import CheckpointManager

    with CheckpointManager(root, recover=RecoverConfig(mode="on", keep_last_n=None),
                           mode="sync", preemption_signals=(),
                           storage_options=storage_options) as manager:
        if step in manager.committed_steps():
            raise CheckpointRootError(
                f"{root!r} already holds a checkpoint at step {step} "
                f"({manager.store.step_path(step)}); import_orbax never replaces one. Pass "
                f"another root, or another step of {src!r}.")
        report = manager.save(StepInfo(0, 0, step), state, mode="sync")
        problems = manager.store.verify(report.path, checksums=True)
    if problems:
        raise CheckpointCorruptError(f"the imported checkpoint {report.path} failed "
                                     f"verification: " + "; ".join(problems))
    return report.path
