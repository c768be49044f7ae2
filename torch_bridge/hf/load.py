"""Reading a Hugging Face model directory into a Flax param tree: ``load_hf``.

Owns: checking a directory against a table before any tensor is read (config.json's
``model_type``, every missing, unexpected and mis-shaped tensor, a tied LM head that is not
equal to the embedding it is tied to) and reading the tensors, one file open at a time, into
per-index or stacked Flax leaves.

Must not import jax or torch: ``load_hf`` returns numpy leaves.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxckpt.errors import CheckpointNotFoundError, CheckpointWarning, ConfigError

from .architectures import (
    ARCHITECTURES,
    LAYER,
    Architecture,
    arch_for_model_type,
    flag_of,
    resolve_architecture,
)
from .config_files import CONFIG_FILE
from .mapping import (
    Entry,
    HFMismatchError,
    expand,
    fmt_shape,
    mismatch_error,
    part_sizes,
    table_dims,
    unflatten,
)
from .safetensors_io import (
    Progress,
    Stored,
    open_safetensors,
    read_tensor,
    resolve_dtype,
    scan_directory,
)

__all__ = ["load_hf"]


def load_hf(path: str | os.PathLike[str], *, arch: str | Architecture, stacked: bool = False,
            dtype: Any = None,
            progress: Progress | None = None) -> tuple[dict[Any, Any], dict[str, Any]]:
    """Read an HF model directory into a Flax param tree; return ``(params, config)``.

    ``params`` is a nested dict of numpy arrays in the layout of ``jaxckpt.llm``'s models
    (layer indices as int keys, as ``nnx.to_pure_dict`` writes them; ``stacked=True`` gives
    layers stacked on a leading axis instead, for ``scan_layers=True`` models). ``config`` is
    config.json's dict; when the file unties the embeddings that its config says are tied
    (an LM head that differs from the embedding, which transformers loads untied with only a
    warning), ``config["tie_word_embeddings"]`` comes back False with a warning so the Flax
    model computes the same logits. ``dtype`` casts every tensor (default: as stored).

    Raises ``HFMismatchError`` (a ``TreeMismatchError``) when config.json's ``model_type`` is
    not one ``arch`` reads (even when every tensor name fits: Mistral and Gemma directories
    have Llama's tensor names but compute something else), naming both and the arch to pass;
    and when tensors do not fit, listing every missing, unexpected and mis-shaped tensor
    with expected vs found shapes. ``CheckpointNotFoundError`` when the directory has no
    config.json or no safetensors.
    """
    table = resolve_architecture(arch)
    path = os.fspath(path)
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path) or not os.path.exists(config_path):
        raise CheckpointNotFoundError(
            f"{path} is not a Hugging Face model directory (no {CONFIG_FILE}).")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    cast = resolve_dtype(dtype)
    stored = scan_directory(path)
    if table.base_prefix and stored and not any(k.startswith(table.base_prefix) for k in stored):
        # e.g. the original GPT-2 files: "h.0.attn..." for "transformer.h.0.attn...".
        stored = {(k if k.startswith("lm_head.") else table.base_prefix + k): v
                  for k, v in stored.items()}

    flags = {**table.defaults, **{k: v for k, v in config.items() if v is not None}}
    notes: list[str] = []
    model_type = config.get("model_type")
    wrong_type = model_type is not None and model_type not in table.model_types
    dims: dict[str, int] | None
    try:
        dims = table_dims(table, flags)
        num_layers = dims[table.layers]
    except ConfigError as exc:
        # Still list every tensor the table wants (shapes by name) so the report is complete.
        dims = None
        num_layers = _count_layers(table, config, stored)
        notes.append(f"config.json cannot size the {table.name!r} table's tensors: {exc}")
    entries, inactive = expand(table, flags, dims, num_layers)
    untie = None if wrong_type else _check_tied(inactive, stored)
    if untie:
        heads = sorted({e.hf for e in inactive if e.row.tied_to and e.hf in stored})
        warnings.warn(
            f"{path}: config.json says {untie}=True but {', '.join(heads)} differs from the "
            f"tensor it should be tied to. transformers loads this model UNTIED (with only a "
            f"warning); returning the untied head and {untie}=False in the config so the Flax "
            f"model computes the same logits.", CheckpointWarning, stacklevel=2)
        config[untie] = False
        flags[untie] = False
        entries, inactive = expand(table, flags, dims, num_layers)
    # A tied head saved anyway (equal to the embedding) is what transformers loads tied.
    ignored = {e.hf for e in inactive if e.row.tied_to is not None}

    problems = _stored_problems(table, entries, stored, ignored)
    if wrong_type:
        raise _model_type_error(path, table, model_type, problems, len(entries))
    if problems or dims is None:
        raise mismatch_error(
            f"{path} does not match", table, problems,
            "".join(f"{note}\n" for note in notes)
            + f"Fix: pass the arch that wrote this directory (known: {sorted(ARCHITECTURES)}), "
              f"or a config.json that matches its tensors.")

    flat = _read_entries(entries, stored, stacked=stacked, num_layers=num_layers, dims=dims,
                         cast=cast, progress=progress)
    return unflatten(flat), config


def _stored_problems(table: Architecture, entries: list[Entry],
                     stored: Mapping[str, Stored], ignored: set[str]) -> list[str]:
    """Every missing, mis-shaped and unexpected tensor of a directory against the table."""
    problems = []
    expected = {e.hf: e for e in entries}
    for name, entry in expected.items():
        found = stored.get(name)
        want = (fmt_shape(entry.hf_shape) if entry.hf_shape is not None
                else "(" + ", ".join(entry.row.shape) + ")")
        if found is None:
            problems.append(f"missing {name}: expected {want}")
        elif entry.hf_shape is not None and found.shape != entry.hf_shape:
            problems.append(f"mis-shaped {name}: expected {want}, found {fmt_shape(found.shape)}")
    ignore = [re.compile(p) for p in table.ignore]
    for name in sorted(set(stored) - set(expected) - ignored):
        if not any(p.search(name) for p in ignore):
            problems.append(f"unexpected {name}: found {fmt_shape(stored[name].shape)} "
                            f"{stored[name].dtype}")
    return problems


def _model_type_error(path: str, table: Architecture, model_type: Any, problems: list[str],
                      expected: int) -> HFMismatchError:
    """config.json names another model: refused even when every tensor name fits, since
    models that share Llama's tensor names (Mistral, Gemma) compute different functions."""
    other = arch_for_model_type(model_type)
    if other is not None:
        fix = f"Fix: pass arch={other!r}."
    else:
        fix = (f"Fix: none of the known tables reads model_type {model_type!r} (known: "
               + ", ".join(f"arch={name!r} for model_type {t.model_types[0]!r}"
                           for name, t in sorted(ARCHITECTURES.items()))
               + "); it is unsupported, or pass an Architecture table written for it as arch=.")
    if problems:
        tensors = (f"Its tensors do not fit the {table.name!r} table either:\n"
                   + "\n".join(f"  {line}" for line in sorted(problems)) + "\n")
    else:
        tensors = (f"Its tensor names all fit the {table.name!r} table ({expected} expected), "
                   f"but the weights belong to another model: reading them as {table.name!r} "
                   f"would give wrong parameters.\n")
    return HFMismatchError(
        f"{path}: arch={table.name!r} was asked for, but config.json says model_type "
        f"{model_type!r} ({table.name!r} reads model_type "
        f"{' or '.join(repr(t) for t in table.model_types)}).\n{tensors}{fix}",
        [f"model_type: expected {table.model_types[0]!r}, found {model_type!r}", *problems])


def _count_layers(table: Architecture, config: Mapping[str, Any],
                  stored: Mapping[str, Stored]) -> int:
    """Layer count when the table's dims cannot read the config (a mismatch report)."""
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(key), int):
            return config[key]
    found = set()
    for row in table.tensors:
        if row.per_layer:
            pattern = re.compile(re.escape(row.hf).replace(re.escape(LAYER), r"(\d+)") + "$")
            for name in stored:
                match = pattern.match(name)
                if match:
                    found.add(int(match[1]))
    return max(found) + 1 if found else 0


def _check_tied(inactive: list[Entry], stored: Mapping[str, Stored]) -> str | None:
    """The flag to turn off when a tied row's tensor is present and differs from its tie."""
    for entry in inactive:
        row = entry.row
        if row.tied_to is None or entry.hf not in stored or row.tied_to not in stored:
            continue
        head = read_tensor(stored, entry.hf)
        tie = read_tensor(stored, row.tied_to)
        if head.shape != tie.shape or not np.array_equal(head, tie):
            flag, _ = flag_of(row.when)
            return flag
    return None


def _read_entries(entries: list[Entry], stored: Mapping[str, Stored], *, stacked: bool,
                  num_layers: int, dims: Mapping[str, int], cast: np.dtype | None,
                  progress: Progress | None) -> dict[str, np.ndarray]:
    """Read and convert every entry, one file open at a time; stacked leaves are filled in
    place (no second copy of a stack)."""
    flat: dict[str, np.ndarray] = {}
    by_file: dict[str, list[Entry]] = {}
    for entry in entries:
        by_file.setdefault(stored[entry.hf].file, []).append(entry)
    total = sum(stored[e.hf].nbytes for e in entries)
    done = 0
    for file, group in by_file.items():
        with open_safetensors(file) as handle:
            for entry in group:
                array = handle.get_tensor(stored[entry.hf].key)
                row = entry.row
                if len(row.parts) > 1:
                    assert entry.hf_shape is not None  # sized: dims given
                    sizes = part_sizes(row, entry.hf_shape, dims)
                    cuts = np.cumsum(sizes)[:-1]
                    pieces = np.split(array, cuts, axis=row.fuse_axis)
                else:
                    pieces = [array]
                for index, piece in enumerate(pieces):
                    if row.transpose:
                        piece = np.swapaxes(piece, -1, -2)
                    piece = np.ascontiguousarray(piece, dtype=cast or piece.dtype)
                    if stacked and entry.layer is not None:
                        key = entry.stacked[index]
                        if key not in flat:
                            flat[key] = np.empty((num_layers, *piece.shape), piece.dtype)
                        flat[key][entry.layer] = piece
                    else:
                        flat[entry.flax[index]] = piece
                done += stored[entry.hf].nbytes
                del array, pieces
                if progress is not None:
                    progress(done, total)
    return flat
