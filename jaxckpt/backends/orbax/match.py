"""Matching a ``like`` tree to a checkpoint's tree.json, before any array but the packs is read.

Owns: what each ``like`` leaf asks for (:class:`Target`: a jax, numpy or Python leaf, its
shape and dtype), its tree path (``tree.plain_paths`` for trees of plain containers, else
jax's), and the comparison of ``like`` with the saved leaves by tree path
(``compare``: every mismatch at once; with ``partial``, ``like`` may be a subtree), raised
as one ``TreeMismatchError`` by ``match_like``. A Python scalar like leaf asks for an
array where an array was saved (``as_saved``). The way back, once ``like`` matches, is
``read``'s; only the packs' reads may start while it matches (``on_parsed``).

Must not import: torch, orbax.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from etils import epath

from jaxckpt.backends.orbax.tree import (
    PY_SCALAR_DTYPE_KINDS,
    PY_SCALAR_TYPES,
    TREE_FILE,
    SavedLeaf,
    dtype_name,
    numpy_dtype,
    plain_paths,
    read_tree_json,
)
from jaxckpt.errors import CheckpointNotFoundError, TreeMismatchError

__all__ = ["Target", "as_saved", "compare", "like_targets", "match_like", "plain_paths",
           "target_of"]


class Target(NamedTuple):
    """What a ``like`` leaf asks for (a named tuple: a restore makes one per leaf)."""

    target: str
    """"jax" (jax.Array, also for ShapeDtypeStruct), "numpy", "numpy_scalar" or "python"."""
    shape: tuple[int, ...]
    dtype: Any
    """numpy or key dtype; the Python type for target "python"."""
    sharding: jax.sharding.Sharding | None = None
    """Where a "jax" leaf goes; None means the default device."""

    def describe(self) -> str:
        if self.target == "python":
            return f"python {self.dtype.__name__}"
        return f"shape {self.shape} {dtype_name(self.dtype)}"


def target_of(leaf: Any) -> Target | None:
    if isinstance(leaf, jax.Array):
        return Target("jax", tuple(leaf.shape), leaf.dtype, leaf.sharding)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return Target("jax", tuple(leaf.shape), leaf.dtype, leaf.sharding)
    if isinstance(leaf, np.ndarray):
        return Target("numpy", tuple(leaf.shape), leaf.dtype)
    if isinstance(leaf, np.generic):
        return Target("numpy_scalar", (), leaf.dtype)
    for py_type in PY_SCALAR_TYPES.values():
        if type(leaf) is py_type:
            return Target("python", (), py_type)
    return None


def mismatch(target: Target, saved: SavedLeaf) -> bool:
    if target.target == "python":
        # A Python scalar like accepts any 0-d, non-key saved leaf of a matching kind (a
        # step counter saved as a jnp.int32 matches a Python int, and restores as the
        # saved array: as_saved).
        type_name = target.dtype.__name__
        return (saved.kind == "key" or saved.shape != ()
                or np.dtype(saved.dtype).kind not in PY_SCALAR_DTYPE_KINDS[type_name])
    return saved.shape != target.shape or saved.dtype != dtype_name(target.dtype)


def like_targets(like: Any) -> tuple[list[tuple[str, Target]], Any]:
    """``(tree path, what the leaf asks for)`` of every leaf of ``like``, and its treedef;
    TypeError listing every leaf that describes no array."""
    leaves, like_treedef = jax.tree_util.tree_flatten(like)
    paths = plain_paths(like, leaves)
    if paths is None:
        with_paths = jax.tree_util.tree_flatten_with_path(like)[0]
        # jax.tree_util.keystr(key_path), without its call: this runs once per leaf.
        paths = ["".join(map(str, key_path)) for key_path, _ in with_paths]
    targets: list[tuple[str, Target]] = []
    bad_like: list[str] = []
    abstract, new = jax.ShapeDtypeStruct, tuple.__new__
    target: Target | None
    for path, leaf in zip(paths, leaves, strict=True):
        if type(leaf) is abstract:  # the usual like leaf (jax.eval_shape, nnx.eval_shape)
            target = new(Target, ("jax", tuple(leaf.shape), leaf.dtype, leaf.sharding))
        else:
            target = target_of(leaf)
        if target is None:
            bad_like.append(f"  {path}: {type(leaf).__module__}.{type(leaf).__qualname__}")
        else:
            targets.append((path, target))
    if bad_like:
        raise TypeError(
            "like has leaves that describe no array:\n" + "\n".join(bad_like) + "\nFix: "
            "give like leaves that are jax.Array, jax.ShapeDtypeStruct, numpy arrays or "
            "Python bool/int/float (e.g. from nnx.eval_shape or jax.eval_shape).")
    return targets, like_treedef


def compare(targets: list[tuple[str, Target]], saved: dict[str, SavedLeaf], *,
            partial: bool = False) -> list[str]:
    """Every difference between like and the checkpoint, one line per tree path. With
    ``partial`` (like is a subtree of what was saved) saved leaves outside like are not
    differences: they are simply not read."""
    problems = []
    missing = False
    names: dict[Any, str] = {}  # dtype_name of each like dtype, asked once per dtype
    for path, target in targets:
        # Item access rather than calls (saved.get): this loop runs once per leaf.
        if path not in saved:
            missing = True
            problems.append(f"{path}: missing from checkpoint (like has {target.describe()})")
            continue
        entry = saved[path]
        # mismatch(), spelled out for the usual leaf.
        if target.target == "python":
            differs = mismatch(target, entry)
        else:
            dtype = target.dtype
            if dtype not in names:
                names[dtype] = dtype_name(dtype)
            differs = entry.shape != target.shape or entry.dtype != names[dtype]
        if differs:
            problems.append(f"{path}: expected {target.describe()}, checkpoint has "
                            f"{entry.describe()}")
    if not partial:
        like_paths = {path for path, _ in targets}
        # Every like path is saved: the saved ones outside like are the surplus, if any.
        if missing or len(like_paths) != len(saved):
            problems.extend(f"{path}: not in like (checkpoint has {entry.describe()})"
                            for path, entry in saved.items() if path not in like_paths)
    # Sorted by path so that related problems (a renamed subtree) read side by side.
    return sorted(problems)


def match_like(root: epath.Path, directory: str, like: Any, *, partial: bool = False,
               on_parsed: Callable[[dict[str, SavedLeaf]], None] | None = None,
               ) -> tuple[dict[str, SavedLeaf], list[tuple[str, Target]], Any]:
    """The saved leaves of ``directory`` by tree path, the targets of ``like`` and its
    treedef, once ``like`` matches the checkpoint. Raises CheckpointNotFoundError for a
    missing directory, CheckpointCorruptError for an unreadable tree.json, TypeError for
    like leaves that describe no array, and one TreeMismatchError listing every mismatch
    (missing, extra, shape, dtype, key impl); no array has been read then, though the
    packs' reads may have begun. ``partial``: like may leave saved leaves out (see
    ``compare``). ``on_parsed(saved)`` is called once tree.json is parsed, before like is
    matched (the backend starts reading the packs: ``read.PackReads``); whoever started
    something there ends it when this raises."""
    if not root.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {directory}: the directory does "
                                      "not exist")
    saved = read_tree_json(root, directory)
    if on_parsed is not None:
        on_parsed(saved)
    targets, like_treedef = like_targets(like)
    problems = compare(targets, saved, partial=partial)
    if problems:
        fix = ("build like as a subtree of the saved tree (the same paths, shapes and "
               "dtypes for what it keeps; `jaxckpt info PATH --tree` lists every saved "
               "path)" if partial else
               "build like with the same code and configuration that produced the "
               "checkpoint (e.g. nnx.eval_shape of the same model and optimizer)")
        if not partial and all(": not in like " in line for line in problems):
            fix += "; to read only the part like describes, pass partial=True"
        raise TreeMismatchError(
            f"cannot restore {directory} into like: {len(problems)} tree path(s) do not "
            "match:\n" + "\n".join(f"  {line}" for line in problems) + f"\nFix: {fix}, "
            f"or read with a like that matches {directory}/{TREE_FILE} and convert the "
            "result yourself.",
            problems)
    return saved, as_saved(targets, saved), like_treedef


def as_saved(targets: list[tuple[str, Target]],
             saved: dict[str, SavedLeaf]) -> list[tuple[str, Target]]:
    """``targets`` where each Python-scalar like leaf whose saved leaf is an array asks for
    the array (a jax.Array of the saved shape and dtype on the default device) instead: a
    restore gives back what was saved, and a Python scalar only where one was saved. A Linen
    ``TrainState.create`` holds ``step=0``, an int, while the state saved after a jitted
    step holds an int32 array; restored into the fresh state the step stays that array.
    Changed in place and returned."""
    for slot, (path, target) in enumerate(targets):
        if target.target == "python" and saved[path].kind != "scalar":
            entry = saved[path]
            targets[slot] = (path, Target("jax", entry.shape, numpy_dtype(entry.dtype)))
    return targets
