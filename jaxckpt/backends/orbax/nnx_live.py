"""Live Flax NNX objects as values of a state tree, saved whole and restored in place.

Owns: finding NNX objects (any ``nnx.Pytree`` / ``nnx.Object``: modules, optimizers,
``Rngs``, metrics) among a state tree's values; the pure tree written in their place (each
object's ``nnx.State``: the same files as ``nnx.state(obj)``, a Variable shared by several
objects stored once); reading back in two steps (``read_into``, then
``PendingUpdate.apply`` with ``nnx.update``) so that a read thrown away never changes the
caller's objects; and naming NNX objects of the caller's scope a save leaves out.

Must not import: orbax, torch. Flax is never imported here, only looked up in
``sys.modules`` (no NNX object exists before ``flax.nnx`` is imported).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["holds_live", "to_state_tree", "read_into", "PendingUpdate", "left_out"]

# Layouts (treedefs) already looked at -> whether they hold an NNX object. Hashing a
# treedef is far cheaper than walking it, and a run saves the same layout again and again.
_SEEN: dict[Any, bool] = {}
_MAX_SEEN = 16


def _nnx() -> Any:
    """``flax.nnx`` if it was imported, else None."""
    return sys.modules.get("flax.nnx")


def _live_types(nnx: Any) -> tuple[type, ...]:
    # flax >= 0.11: every NNX object is an nnx.Pytree (nnx.Object is one of its subclasses);
    # older releases have nnx.Object as the base.
    return tuple(t for t in (getattr(nnx, "Pytree", None), getattr(nnx, "Object", None))
                 if isinstance(t, type))


#: Containers looked into, and the nodes of ``holds_live``'s quick walk, before it asks
#: the treedef instead.
_QUICK_NODES = 256


def holds_live(tree: Any, treedef: Any = None) -> bool:
    """Whether ``tree`` holds an NNX object (``treedef``: its treedef, when the caller has
    it). Cheap for the usual shapes: a quick walk through dicts, lists and tuples answers
    for a dict of objects and arrays, an nnx.State or a dict of States at once; anything
    larger or of other node types is answered by the treedef, in which flax's objects
    show as node types."""
    nnx = _nnx()
    if nnx is None:
        return False
    types = _live_types(nnx)
    opaque = (nnx.State, nnx.Variable, jax.Array, np.ndarray, np.generic, bool, int, float,
              complex, str, bytes)
    stack, budget = [tree], _QUICK_NODES
    while stack:
        node = stack.pop()
        if isinstance(node, types):
            return True
        if node is None or isinstance(node, opaque):
            pass  # a State holds Variables, never live objects
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        else:
            budget = 0  # a pytree node type of its own: only jax knows its children
        budget -= 1
        if budget <= 0:
            break
    else:
        return False
    if treedef is None:
        treedef = jax.tree_util.tree_structure(tree)
    return _treedef_holds_live(treedef, types)


def _treedef_holds_live(treedef: Any, types: tuple[type, ...]) -> bool:
    try:
        found = _SEEN.get(treedef)
    except TypeError:  # an unhashable node's auxiliary data: look every time
        found = None
    if found is not None:
        return found
    found, stack = False, [treedef]
    while stack:
        node = stack.pop()
        data = node.node_data()
        if data is not None and isinstance(data[0], type) and issubclass(data[0], types):
            found = True
            break
        stack.extend(node.children())
    try:
        if len(_SEEN) >= _MAX_SEEN:
            _SEEN.pop(next(iter(_SEEN)))
        _SEEN[treedef] = found
    except TypeError:
        pass
    return found


class _Split:
    """A tree cut at its NNX objects: the tree's structure with each object as a leaf."""

    def __init__(self, tree: Any):
        nnx = _nnx()
        types = _live_types(nnx)
        stop = (*types, nnx.State)  # a State holds Variables, never live objects
        self.leaves, treedef = jax.tree_util.tree_flatten(
            tree, is_leaf=lambda node: isinstance(node, stop))
        self.treedef: Any = treedef  # jaxlib's PyTreeDef, a type mypy cannot resolve
        self.slots = [index for index, leaf in enumerate(self.leaves) if isinstance(leaf, types)]
        self.objects = [self.leaves[index] for index in self.slots]

    def pure(self) -> Any:
        """The tree with every object replaced by its nnx.State (shared Variables once)."""
        nnx = _nnx()
        # One nnx.state over all objects: a Variable reachable from two of them is listed
        # once, under the first, so it is written once and restored into one place.
        joint = nnx.state(list(self.objects))
        leaves = list(self.leaves)
        for number, index in enumerate(self.slots):
            leaves[index] = joint[number] if number in joint else nnx.State({})
        return self.treedef.unflatten(leaves)


def to_state_tree(tree: Any) -> Any:
    """The tree to write in place of ``tree``: each NNX object replaced by its state. The
    caller checked ``holds_live(tree)``."""
    return _Split(tree).pure()


class PendingUpdate:
    """Values read for a tree with NNX objects, not yet put into them (see ``apply``)."""

    __slots__ = ("_split", "_restored")

    def __init__(self, split: _Split, restored: Any):
        self._split = split
        self._restored = restored

    def apply(self) -> Any:
        """Put the values into the objects (``nnx.update``, in place: each Variable takes
        the restored array, on the sharding it was read onto) and return the tree: the same
        objects where the like tree had objects, restored values elsewhere."""
        nnx = _nnx()
        split = self._split
        parts = split.treedef.flatten_up_to(self._restored)
        nnx.update(list(split.objects),
                   nnx.State({number: parts[index] for number, index in enumerate(split.slots)}))
        leaves = list(parts)
        for index, obj in zip(split.slots, split.objects, strict=True):
            leaves[index] = obj
        return split.treedef.unflatten(leaves)


def read_into(like: Any, read: Callable[[Any], Any]) -> PendingUpdate:
    """Read with ``read(pure_like)``, where ``pure_like`` is ``like`` with each NNX object
    replaced by its state (its current arrays: their shapes, dtypes and shardings are the
    targets). Nothing is changed until ``apply`` of the result."""
    split = _Split(like)
    return PendingUpdate(split, read(split.pure()))


# ------------------------------------------------------------------ what a save leaves out


def _variables(nnx: Any, tree: Any) -> list[Any]:
    return [leaf for leaf in jax.tree_util.tree_leaves(
        tree, is_leaf=lambda node: isinstance(node, nnx.Variable))
        if isinstance(leaf, nnx.Variable)]


def _value_id(nnx: Any, variable: Any) -> int:
    getter = getattr(variable, "get_value", None)
    return id(getter() if callable(getter) else variable.value)


def left_out(saved: Any, scope: Mapping[str, Any]) -> str | None:
    """A warning naming the NNX objects in ``scope`` (the caller's local variables) whose
    state ``saved`` does not hold, or None. Only a save that holds NNX state (live objects,
    an nnx.State or Variables) is judged; a pure pytree may be anything the user chose."""
    nnx = _nnx()
    if nnx is None:
        return None
    types = _live_types(nnx)
    split = _Split(saved)
    if split.objects:
        saved = split.pure()
    variables = _variables(nnx, saved)
    if not split.objects and not variables:
        return None
    # nnx.state holds the objects' own Variables; a state built some other way still holds
    # their arrays.
    saved_variables = {id(variable) for variable in variables}
    saved_values = {_value_id(nnx, variable) for variable in variables}
    missing: list[str] = []
    seen: set[int] = set()
    for name, value in scope.items():
        if not isinstance(value, types) or id(value) in seen:
            continue
        seen.add(id(value))
        own = _variables(nnx, nnx.state(value))
        absent = [v for v in own if id(v) not in saved_variables
                  and _value_id(nnx, v) not in saved_values]
        if not absent:
            continue
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        if len(absent) == len(own):
            missing.append(f"{name!r} ({kind})")
        else:
            missing.append(f"{name!r} ({kind}, {len(absent)} of its {len(own)} variables)")
    if not missing:
        return None
    return (
        "this checkpoint holds NNX state but not the state of " + ", ".join(missing)
        + ", NNX object(s) of the code that called save: a run resumed from it restores "
        "them fresh and differs from an uninterrupted run (RNG streams, metric totals, EMA "
        "copies...). Fix: pass them in the state dict, e.g. {'model': model, "
        "'optimizer': optimizer, 'rngs': rngs, 'metrics': metrics}; live objects are "
        "saved whole and recover() restores them in place. (Warned once per manager.)")
