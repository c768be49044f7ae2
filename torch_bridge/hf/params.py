"""Picking a model's params out of the training state an HF exporter is handed.

Owns: ``params_of`` given as a tree path ("model/params", '/'-separated keys) and its
resolution through dicts, lists/tuples, ``nnx.State`` and live nnx objects (a key of an
object is its attribute); the top-level keys of a state, for error messages; and the check
that a state given without ``params_of`` really is a param tree of the architecture (else a
``ConfigError`` that names ``params_of=``, lists the keys and suggests a path where the
params were found deeper down).

What counts as a param once picked is ``mapping.flatten``'s business (an nnx.Module gives its
``nnx.Param`` variables; RNG state is dropped).

Must not import jax, torch or flax at import time: flax is imported only for values that are
already flax objects (the caller has imported it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from jaxckpt.errors import ConfigError

__all__ = ["parse_params_path", "resolve_params_path", "top_level_keys", "check_is_params",
           "pick_params"]


def _is_flax(node: Any, name: str) -> bool:
    """Whether ``node`` is an instance of flax's class ``name`` (no flax import)."""
    return any(cls.__name__ == name and cls.__module__.startswith("flax")
               for cls in type(node).__mro__)


def parse_params_path(path: Any) -> tuple[str, ...]:
    """``"model/params"`` -> ("model", "params"); ConfigError for an empty component."""
    if not isinstance(path, str):
        raise ConfigError(f"params_of must be a tree path string such as 'model/params' or a "
                          f"callable(state) -> params, got {path!r}.")
    parts = tuple(path.split("/"))
    if not path or any(part == "" for part in parts):
        raise ConfigError(f"params_of={path!r} has an empty key; write the keys from the "
                          f"state's top level down, separated by '/', e.g. 'model/params' "
                          f"or '0' (for nnx.state((model, optimizer))).")
    return parts


def top_level_keys(node: Any) -> list[str]:
    """The keys one level below ``node``, as a '/' path would spell them."""
    if isinstance(node, Mapping):
        return [str(key) for key in node]
    if isinstance(node, (list, tuple)):
        return [str(index) for index in range(len(node))]
    if _is_flax(node, "Pytree") or _is_flax(node, "Object"):  # a live nnx Module / Optimizer
        return sorted(key for key in vars(node) if not key.startswith("_"))
    return []


_MISSING = object()


def _child(node: Any, key: str) -> Any:
    if isinstance(node, Mapping):
        if key in node:
            return node[key]
        if key.lstrip("-").isdigit() and int(key) in node:  # nnx.State keys indices as ints
            return node[int(key)]
        return _MISSING
    if isinstance(node, (list, tuple)):
        if key.isdigit() and int(key) < len(node):
            return node[int(key)]
        return _MISSING
    if (_is_flax(node, "Pytree") or _is_flax(node, "Object")) and not key.startswith("_"):
        return getattr(node, key, _MISSING)
    return _MISSING


def resolve_params_path(state: Any, path: str) -> Any:
    """The value at ``path`` in ``state``; ConfigError naming the first key not found and
    the keys that exist at that level."""
    node = state
    parts = parse_params_path(path)
    for depth, key in enumerate(parts):
        child = _child(node, key)
        if child is _MISSING:
            where = "/".join(parts[:depth]) or "the state's top level"
            keys = top_level_keys(node)
            raise ConfigError(
                f"params_of={path!r}: no key {key!r} at {where} (a "
                f"{type(node).__module__}.{type(node).__qualname__}; its keys: "
                f"{keys if keys else 'none'}). Fix params_of= so it names the subtree that "
                f"holds the model params.")
        node = child
    return node


def _walk_leaves(node: Any, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """Paths of array-like leaves, tolerating anything else (strings, loaders, ...)."""
    if _is_flax(node, "Module"):
        from flax import nnx  # the caller already uses flax

        node = nnx.state(node, nnx.Param)
    if _is_flax(node, "Variable"):
        if not _is_flax(node, "Param"):
            return
        getter = getattr(node, "get_value", None)
        node = getter() if callable(getter) else node.value
    if isinstance(node, Mapping):
        for key, child in node.items():
            yield from _walk_leaves(child, (*path, str(key)))
    elif isinstance(node, (list, tuple)):
        for index, child in enumerate(node):
            yield from _walk_leaves(child, (*path, str(index)))
    elif hasattr(node, "shape") and hasattr(node, "dtype"):
        yield path


def check_is_params(state: Any, *, arch_name: str, roots: set[str],
                    anchor: tuple[str, ...]) -> None:
    """Raise ConfigError unless ``state`` looks like an ``arch_name`` param tree: one of its
    top-level keys must be a top-level name of the table (``roots``). ``anchor`` is a
    param every model of the table has (e.g. ("embed", "embedding")): where it is found
    deeper in the state, the error suggests the path above it."""
    if _is_flax(state, "Module"):
        return  # a live model: its nnx.Param variables are the params
    keys = top_level_keys(state)
    if set(keys) & roots:
        return
    found = sorted({"/".join(path[: -len(anchor)]) for path in _walk_leaves(state, ())
                    if len(path) > len(anchor) and path[-len(anchor):] == anchor},
                   key=lambda p: (p.count("/"), p))
    if found:
        hint = (f" The {arch_name!r} params seem to be at params_of={found[0]!r}"
                + (f" (also found at {found[1:]})" if len(found) > 1 else "") + ".")
    else:
        hint = f" No {'/'.join(anchor)!r} param was found anywhere in it."
    raise ConfigError(
        f"the HF exporter was given a {type(state).__module__}.{type(state).__qualname__} "
        f"with top-level keys {keys}, which is not a {arch_name!r} param tree (those start "
        f"with {sorted(roots)}): it looks like a whole training state.{hint} Fix: pass "
        f"params_of= to torch_bridge.hf_exporter, a tree path such as "
        f"params_of={(found[0] if found else 'model/params')!r} ('/'-separated keys) or a "
        f"callable(state) -> params.")


def pick_params(state: Any, params_of: str | Callable[[Any], Any] | None) -> Any:
    """The value ``params_of`` selects from ``state`` (``state`` itself when None)."""
    if params_of is None:
        return state
    if isinstance(params_of, str):
        return resolve_params_path(state, params_of)
    return params_of(state)
