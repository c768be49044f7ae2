"""The engine that reads an architecture table, in both directions.

Owns: a table's rows made concrete for one config (``expand``: one ``Entry`` per layer, with
the HF shape and the Flax part shapes from the table's named sizes, ``table_dims``), the
mismatch report (``HFMismatchError``, every missing, unexpected and mis-shaped tensor at
once), and flat Flax trees (``flatten`` of nested mappings, ``nnx.State`` or an
``nnx.Module``; ``unflatten`` back to nested dicts).

Must not import jax or torch; flax is imported only to read the params of an ``nnx.Module``
the caller passed (it has imported flax already).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from jaxckpt.errors import ConfigError, TreeMismatchError

from .architectures import LAYER, Architecture, HFTensor, flag_of

__all__ = ["HFMismatchError", "Entry", "expand", "table_dims", "part_sizes", "fmt_shape",
           "mismatch_error", "flatten", "unflatten"]


class HFMismatchError(TreeMismatchError):
    """Params or an HF directory do not fit an architecture table, or the directory's
    config.json names another model type; ``problems`` lists every missing, unexpected and
    mis-shaped tensor (and the model_type found). A ``jaxckpt.CheckpointError`` and a
    ``ValueError``."""


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One row of a table, made concrete for one layer of one configured model."""

    row: HFTensor
    hf: str
    layer: int | None
    flax: tuple[str, ...]
    """Per-layer Flax keys (``layers.3.attn...``)."""
    stacked: tuple[str, ...]
    """The same keys in the stacked form (``layers.attn...``), for per-layer rows."""
    hf_shape: tuple[int, ...] | None
    """None when the config does not give the sizes (only while reporting a mismatch)."""
    part_shapes: tuple[tuple[int, ...], ...] | None


def _swap_last(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2]) if len(shape) >= 2 else shape


def part_sizes(row: HFTensor, hf_shape: tuple[int, ...], dims: Mapping[str, int]) -> list[int]:
    if row.split is not None:
        return [dims[name] for name in row.split]
    total = hf_shape[row.fuse_axis]
    return [total // len(row.parts)] * len(row.parts)


def _part_shapes(row: HFTensor, hf_shape: tuple[int, ...],
                 dims: Mapping[str, int]) -> tuple[tuple[int, ...], ...]:
    """Flax shapes of a row's params: the HF shape cut on fuse_axis, then transposed."""
    shapes = []
    axis = row.fuse_axis % len(hf_shape)
    for size in part_sizes(row, hf_shape, dims) if len(row.parts) > 1 else [hf_shape[axis]]:
        part = hf_shape[:axis] + (size,) + hf_shape[axis + 1:]
        shapes.append(_swap_last(part) if row.transpose else part)
    return tuple(shapes)


def _holds(when: bool | str, flags: Mapping[str, Any]) -> bool:
    flag, truth = flag_of(when)
    return truth if flag is None else bool(flags.get(flag)) == truth


def _stacked_key(template: str) -> str:
    return ".".join(part for part in template.split(".") if part != LAYER)


def expand(arch: Architecture, flags: Mapping[str, Any], dims: Mapping[str, int] | None,
            num_layers: int) -> tuple[list[Entry], list[Entry]]:
    """(rows that exist for this config, rows that do not), one entry per layer."""
    active: list[Entry] = []
    inactive: list[Entry] = []
    for row in arch.tensors:
        hf_shape = part_shapes = None
        if dims is not None:
            hf_shape = tuple(int(dims[name]) for name in row.shape)
            part_shapes = _part_shapes(row, hf_shape, dims)
        stacked = tuple(_stacked_key(p) for p in row.parts)
        for layer in range(num_layers) if row.per_layer else [None]:
            index = str(layer)
            entry = Entry(row=row, hf=row.hf.replace(LAYER, index), layer=layer,
                           flax=tuple(p.replace(LAYER, index) for p in row.parts),
                           stacked=stacked, hf_shape=hf_shape, part_shapes=part_shapes)
            (active if _holds(row.when, flags) else inactive).append(entry)
    return active, inactive


def table_dims(arch: Architecture, flags: Mapping[str, Any]) -> dict[str, int]:
    try:
        dims = arch.dims(flags)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ConfigError(
            f"the config lacks what the {arch.name!r} table needs ({type(exc).__name__}: "
            f"{exc}); pass the model's complete transformers config (or config.json dict)."
        ) from None
    if arch.layers not in dims:
        raise ConfigError(f"table {arch.name!r}: dims gives no {arch.layers!r} (layer count)")
    return dims


def fmt_shape(shape: Iterable[int]) -> str:
    dims = [str(int(s)) for s in shape]  # once: ``shape`` may be an iterator
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def mismatch_error(lead: str, arch: Architecture, problems: list[str],
                    hint: str) -> HFMismatchError:
    problems = sorted(problems)
    counts = {kind: sum(line.startswith(kind) for line in problems)
              for kind in ("missing", "unexpected", "mis-shaped")}
    summary = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n) or "sizes unknown"
    return HFMismatchError(
        f"{lead} the {arch.name!r} table ({summary}):\n"
        + "\n".join(f"  {line}" for line in problems) + f"\n{hint}", problems)


# --------------------------------------------------------------------- flat Flax trees


def _is_rng_variable(node: Any) -> bool:
    # nnx RNG keys and counters live next to params in an nnx.State; they are not weights.
    return any(cls.__name__ == "RngState" and cls.__module__.startswith("flax")
               for cls in type(node).__mro__)


def _unwrap(node: Any) -> Any:
    """An nnx.Variable's value (params may be an nnx.State holding Variables)."""
    cls = type(node)
    if any(c.__name__ == "Variable" and c.__module__.startswith("flax") for c in cls.__mro__):
        getter = getattr(node, "get_value", None)
        return getter() if callable(getter) else node.value
    return node


def flatten(params: Any) -> dict[str, Any]:
    """Dotted path -> array leaf, for nested mappings/sequences, nnx.State or an nnx.Module."""
    if any(c.__name__ == "Module" and c.__module__.startswith("flax.nnx")
           for c in type(params).__mro__):
        from flax import nnx  # only reached when the caller already uses flax

        params = nnx.state(params, nnx.Param)
    flat: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if _is_rng_variable(node):
            return
        node = _unwrap(node)
        if isinstance(node, Mapping):
            for key, child in node.items():
                walk(child, f"{path}.{key}" if path else str(key))
        elif isinstance(node, (list, tuple)):
            for index, child in enumerate(node):
                walk(child, f"{path}.{index}" if path else str(index))
        elif node is None:
            return
        elif hasattr(node, "shape") and hasattr(node, "dtype"):
            flat[path] = node
        else:
            raise TypeError(
                f"param {path or '<root>'} is a {type(node).__module__}.{type(node).__qualname__}"
                f", not an array. Pass the params alone (e.g. nnx.state(model, nnx.Param), "
                f"jaxckpt.llm.params_of(model), or params_of= in hf_exporter).")

    walk(params, "")
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[Any, Any]:
    """Nested dicts; all-digit components become int keys, as nnx.to_pure_dict writes
    nnx.List indices."""
    tree: dict[Any, Any] = {}
    for path, leaf in flat.items():
        node = tree
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return tree
