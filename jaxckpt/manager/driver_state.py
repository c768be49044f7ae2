"""Driver state: everything besides the arrays that an exact resume needs.

Owns: capturing and restoring counters (``StepInfo``), ``stateful`` objects (anything with
``state_dict``/``load_state_dict`` or ``get_state``/``set_state``, NumPy Generators,
``random.Random``; torch loaders through ``manager.loader_state``), Python's and NumPy's
global RNGs, the backend's RNG and library versions; and their files: ``driver.json`` (the
primary's) and ``driver.p{index:05d}.json`` (each other process's local state). A stateful
object is per process unless its class sets ``jaxckpt_state_scope = "global"``: then every
process restores the primary's copy. All through ``core.codec`` (never pickle); a key an
older checkpoint lacks warns instead of failing.

Must not import: jax, orbax, torch.
"""

from __future__ import annotations

import json
import platform
import random
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxckpt._version import __version__
from jaxckpt.config import StepInfo
from jaxckpt.core import codec
from jaxckpt.core.layout import DRIVER_FILE, local_driver_filename
from jaxckpt.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointWarning,
    CodecError,
    ConfigError,
)
from jaxckpt.manager import loader_state

if TYPE_CHECKING:
    from jaxckpt.commit.store import CheckpointStore

__all__ = [
    "DRIVER_FORMAT",
    "LOCAL_FORMAT",
    "capture_stateful",
    "restore_stateful",
    "capture_global_rng",
    "restore_global_rng",
    "global_rng_state",
    "set_global_rng_state",
    "build_driver",
    "build_local",
    "parse_driver",
    "read_driver",
    "local_filename",
    "clean_metrics",
    "STATE_SCOPE_ATTR",
    "has_global_state",
]

DRIVER_FORMAT = "jaxckpt.driver/1"
LOCAL_FORMAT = "jaxckpt.local/1"

#: The class attribute by which a stateful object declares its state the same on every
#: process ("global"); anything else, or no attribute, means per process.
STATE_SCOPE_ATTR = "jaxckpt_state_scope"

_PROTOCOL_HELP = (
    "A stateful object needs state_dict()/load_state_dict(d) (PyTorch style), or "
    "get_state()/set_state(s) (grain iterators), or be a numpy.random.Generator or "
    "random.Random.")


def local_filename(process_index: int) -> str:
    """The file of process ``process_index``'s local state (named in jaxckpt.core.layout)."""
    return local_driver_filename(process_index)


def _get_state(name: str, obj: Any) -> Any:
    if isinstance(obj, np.random.Generator):
        return {"kind": "numpy.Generator", "state": obj.bit_generator.state}
    if isinstance(obj, random.Random):
        return {"kind": "random.Random", "state": obj.getstate()}
    if (callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))):
        loader_state.check_resumable(name, obj)
        saved: dict[str, Any] = {"kind": "state_dict", "state": obj.state_dict()}
        generator = loader_state.generator_state(obj)
        if generator is not None:
            saved[loader_state.GENERATOR_KEY] = generator
        return saved
    if callable(getattr(obj, "get_state", None)) and callable(getattr(obj, "set_state", None)):
        return {"kind": "get_state", "state": obj.get_state()}
    raise ConfigError(f"stateful[{name!r}] is a {type(obj).__qualname__}, which has no state "
                      f"protocol. {_PROTOCOL_HELP}")


def _set_state(name: str, obj: Any, saved: Any) -> None:
    kind, state = saved.get("kind"), saved.get("state")
    if isinstance(obj, np.random.Generator):
        expected = "numpy.Generator"
    elif isinstance(obj, random.Random):
        expected = "random.Random"
    elif (callable(getattr(obj, "load_state_dict", None))
          and callable(getattr(obj, "state_dict", None))):
        expected = "state_dict"
    elif callable(getattr(obj, "set_state", None)) and callable(getattr(obj, "get_state", None)):
        expected = "get_state"
    else:
        raise ConfigError(f"stateful[{name!r}] is a {type(obj).__qualname__}, which has no "
                          f"state protocol. {_PROTOCOL_HELP}")
    if kind != expected:
        raise ConfigError(
            f"stateful[{name!r}]: the checkpoint holds {kind!r} state but the object given is a "
            f"{type(obj).__qualname__} ({expected!r}). Pass the same kind of object that was "
            f"saved.")
    if expected == "numpy.Generator":
        obj.bit_generator.state = state
    elif expected == "random.Random":
        obj.setstate(_as_random_state(state))
    elif expected == "state_dict":
        obj.load_state_dict(state)
        loader_state.after_load(obj, saved)
    else:
        obj.set_state(state)


def _as_random_state(state: Any) -> tuple:
    # random.Random.setstate wants (version, tuple_of_ints, gauss_next).
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


def capture_stateful(stateful: Mapping[str, Any] | None) -> dict[str, Any]:
    """Snapshot every stateful object (JSON-encoded now, so later mutation cannot leak in)."""
    if stateful is None:
        return {}
    if not isinstance(stateful, Mapping):
        raise ConfigError(f"stateful must be a dict of name -> object, got "
                          f"{type(stateful).__name__}. Write stateful={{'loader': loader}}.")
    out = {}
    for name, obj in stateful.items():
        if not isinstance(name, str):
            raise ConfigError(f"stateful keys must be str, got {name!r}.")
        saved = _get_state(name, obj)
        out[name] = codec.encode(saved, f"stateful[{name!r}]")
    return out


def has_global_state(obj: Any) -> bool:
    """True when ``obj`` declares its state the same on every process (``STATE_SCOPE_ATTR``)."""
    return getattr(obj, STATE_SCOPE_ATTR, None) == "global"


def restore_stateful(stateful: Mapping[str, Any] | None, saved: Mapping[str, Any],
                     where: str, *, primary: Mapping[str, Any] | None = None) -> None:
    """Restore each given object in place; a name missing on either side warns.

    ``saved`` is this process's saved state; ``primary``, when given, the primary process's:
    objects with global state (``has_global_state``) are restored from it."""
    stateful = stateful or {}
    for name, obj in stateful.items():
        source = primary if primary is not None and has_global_state(obj) else saved
        if name not in source:
            warnings.warn(
                f"stateful[{name!r}] has no saved state in {where} (it was added after that "
                f"checkpoint was written); it keeps its current state.",
                CheckpointWarning, stacklevel=3)
            continue
        _set_state(name, obj, codec.decode(source[name], f"stateful[{name!r}]"))
    extra = sorted(set(saved) - set(stateful))
    if extra:
        warnings.warn(
            f"{where} holds state for {extra} but recover() was not given objects of those names; "
            f"that state is not restored. Pass them in stateful= to restore them.",
            CheckpointWarning, stacklevel=3)


def global_rng_state() -> dict[str, Any]:
    """Python ``random``'s and NumPy's legacy global RNG state, as values ``core.codec``
    stores exactly (the one capture of these two; ``torch_bridge.rng`` adds torch's)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(legacy=False)}


def set_global_rng_state(saved: Mapping[str, Any], where: str, *, stacklevel: int = 2) -> None:
    """Restore what :func:`global_rng_state` returned (also its tuples as lists, and NumPy's
    legacy tuple); a missing entry warns and keeps that generator's current state.

    Args:
        saved: the ``{"python": ..., "numpy": ...}`` values.
        where: the checkpoint, named in a warning.
        stacklevel: of those warnings, counted from the caller.
    """
    if "python" in saved:
        random.setstate(_as_random_state(saved["python"]))
    else:
        warnings.warn(f"{where} has no Python RNG state; random keeps its current state.",
                      CheckpointWarning, stacklevel=stacklevel + 1)
    if "numpy" in saved:
        state = saved["numpy"]
        np.random.set_state(tuple(state) if isinstance(state, list) else state)
    else:
        warnings.warn(f"{where} has no NumPy RNG state; numpy.random keeps its current state.",
                      CheckpointWarning, stacklevel=stacklevel + 1)


def capture_global_rng() -> dict[str, Any]:
    """:func:`global_rng_state`, each entry JSON-encoded."""
    return {name: codec.encode(value, f"rng[{name!r}]")
            for name, value in global_rng_state().items()}


def restore_global_rng(saved: Mapping[str, Any], where: str) -> None:
    """Restore what :func:`capture_global_rng` returned."""
    set_global_rng_state({name: codec.decode(value, f"rng[{name!r}]")
                          for name, value in saved.items() if name in ("python", "numpy")},
                         where, stacklevel=3)


def clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | int]:
    """Metrics as JSON numbers (jax/NumPy scalars are converted with float())."""
    out: dict[str, float | int] = {}
    for key, value in (metrics or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise CodecError(f"metrics[{key!r}] = {value!r} is not a number; pass scalars "
                                 f"only (e.g. float(loss)).") from None
        out[str(key)] = value
    return out


def build_local(*, process_index: int, stateful_state: Mapping[str, Any],
                rng: Mapping[str, Any] | None, backend_rng: Any) -> dict[str, Any]:
    """This process's local state (already codec-encoded pieces)."""
    return {
        "format": LOCAL_FORMAT,
        "process_index": process_index,
        "stateful": dict(stateful_state),
        "rng": dict(rng or {}),
        "backend_rng": codec.encode(backend_rng, "backend_rng"),
    }


def build_driver(*, kind: str, reason: str, step: StepInfo, backend_name: str,
                 backend_versions: Mapping[str, str], process_count: int,
                 metrics: Mapping[str, Any] | None, local: Mapping[str, Any],
                 saved_at: float) -> dict:
    return {
        "format": DRIVER_FORMAT,
        "kind": kind,
        "reason": reason,
        "step_info": step.to_json(),
        "backend": backend_name,
        "process_count": process_count,
        "saved_at": saved_at,
        "metrics": clean_metrics(metrics),
        "versions": {"jaxckpt": __version__, "python": platform.python_version(),
                     "numpy": np.__version__, **backend_versions},
        "local": dict(local),
    }


def read_driver(store: CheckpointStore, path: str) -> dict[str, Any]:
    """The parsed driver.json of the checkpoint ``path`` (``parse_driver``), read through
    the store; ``CheckpointCorruptError`` when it is missing. The one reader of driver.json
    for the manager and the tools."""
    try:
        data = store.read_file(path, DRIVER_FILE)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path}: {DRIVER_FILE} is missing") from None
    return parse_driver(data, path)


def parse_driver(data: bytes, where: str) -> dict[str, Any]:
    """Parse and sanity-check a driver.json (format, step info)."""
    try:
        body = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(
            f"{where}: driver.json is not valid JSON ({exc}). Fix: restore another step "
            f"(restore(step=None) picks the latest valid checkpoint), or check the disk that "
            f"holds this checkpoint.") from exc
    if not isinstance(body, dict) or body.get("format") != DRIVER_FORMAT:
        found = body.get("format") if isinstance(body, dict) else type(body).__name__
        newer = isinstance(found, str) and found.startswith("jaxckpt.driver/")
        raise (CheckpointFormatError if newer else CheckpointCorruptError)(
            f"{where}: driver.json has format {found!r}, expected {DRIVER_FORMAT!r}; it was not "
            f"written by this version of jaxckpt (upgrade jaxckpt to read newer formats).")
    if "step_info" not in body:
        raise CheckpointCorruptError(f"{where}: driver.json has no step_info")
    return body
