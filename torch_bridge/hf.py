"""The Hugging Face bridge: Flax param trees <-> torch-layout safetensors that transformers loads.

Owns: one declarative table per architecture (which Flax param becomes which HF tensor, with
what layout change), the generic engine that reads those tables in both directions, the
streaming sharded safetensors writer (``export_hf``, ``hf_exporter``) and the reader
(``load_hf``). Picking the params out of a training state is ``_hf_params``'s; the text of
config.json and generation_config.json is ``_hf_config``'s.

A table (:class:`Architecture`) is a tuple of :class:`HFTensor` rows, one per HF tensor:

- ``flax`` / ``hf``: dotted Flax param path and HF tensor name; ``{i}`` stands for the layer
  index. A Flax tree may hold the layers one per index (``layers.0.attn...``) or stacked on a
  leading axis (``layers.attn...``, as ``nnx.scan``/``nnx.vmap`` make them): export detects
  which, ``load_hf(stacked=True)`` returns the stacked form.
- ``shape``: the HF tensor's shape in named sizes that the table's ``dims`` derives from the
  config; every tensor is checked against it in both directions.
- ``transpose``: torch ``nn.Linear`` weights are (out, in), Flax kernels (in, out).
- a tuple of Flax paths: the HF tensor is those params concatenated on ``fuse_axis`` (GPT-2's
  fused ``c_attn`` = [q | k | v]); sizes from ``split`` (default: equal parts).
- ``when``: the row exists only when a config flag holds (``"attention_bias"``,
  ``"not tie_word_embeddings"``), or always/never (True/False).
- ``tied_to``: the HF tensor this one equals when the embeddings are tied. transformers loads a
  present-but-different LM head UNTIED with only a warning (docs/design.md, "Measured facts"),
  so ``load_hf`` compares the two, and export refuses a tree whose tied/untied state
  contradicts the config.

Adding an architecture means adding one table to ``ARCHITECTURES`` (or passing an
``Architecture`` as ``arch=``); the engine has no per-architecture code.

Memory: export plans every shard's header from shapes alone, then converts (transposes,
casts, concatenates), writes and frees one tensor at a time, converting the next while the
current one is written: the extra host memory is at most the two largest converted tensors,
whatever the shard size, never a second copy of the model.
Durability: every file and directory is fsynced, and each shard is re-opened with safetensors
before it counts as written; ``export_hf`` writes into a temporary sibling directory
(``.{name}.tmp-XXXXXXXX``) and renames it into place, so an interrupted export never leaves a
complete-looking model (a SIGKILLed one leaves that hidden temp directory behind).

Must not import jax or torch at import time: params may have jax or numpy leaves and are
converted leaf by leaf with ``np.asarray``; ``load_hf`` returns numpy leaves. Writing an
export's config files imports transformers (and with it torch, when installed); an
``HFExporter`` does so when it is made, on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from jaxckpt import __version__
from jaxckpt.core.extras import requires_extra
from jaxckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWarning,
    ConfigError,
    TreeMismatchError,
)
from jaxckpt.storage.posix import fsync_dir, fsync_file

from ._hf_config import GENERATION_CONFIG_FILE, config_files
from ._hf_params import check_is_params, parse_params_path, pick_params

with requires_extra("hf", "torch_bridge's Hugging Face bridge (export_hf, load_hf, hf_exporter)"):
    from safetensors import safe_open

__all__ = [
    "HFTensor",
    "Architecture",
    "ARCHITECTURES",
    "LLAMA",
    "QWEN2",
    "GPT2",
    "HFMismatchError",
    "ExportExistsError",
    "HFExporter",
    "EXPORTER_RECORD_FORMAT",
    "export_hf",
    "hf_exporter",
    "load_hf",
    "PROVENANCE_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "resolve_architecture",
    "arch_for_model_type",
]

#: written next to the model: where it came from and how it was written.
PROVENANCE_FILE = "jaxckpt_provenance.json"
PROVENANCE_FORMAT = "jaxckpt.hf_export/1"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# Files a tokenizer directory may hold (transformers and sentencepiece/tiktoken variants).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                    "tokenizer.model", "spiece.model", "chat_template.jinja",
                    "chat_template.json")
_LAYER = "{i}"

Progress = Callable[[int, int], Any]
"""progress(bytes_done, bytes_total), called after every tensor."""


class HFMismatchError(TreeMismatchError):
    """Params or an HF directory do not fit an architecture table, or the directory's
    config.json names another model type; ``problems`` lists every missing, unexpected and
    mis-shaped tensor (and the model_type found). A ``jaxckpt.CheckpointError`` and a
    ``ValueError``."""


class ExportExistsError(CheckpointError, FileExistsError):
    """``export_hf``'s ``out_dir`` already holds something (pass ``overwrite=True``)."""


# ------------------------------------------------------------------------------ tables


@dataclasses.dataclass(frozen=True, slots=True)
class HFTensor:
    """One row of an architecture table: one HF tensor and the Flax param(s) it holds."""

    flax: str | tuple[str, ...]
    """Dotted Flax param path (``{i}`` = layer index); a tuple when several Flax params are
    concatenated into this one HF tensor."""
    hf: str
    """HF tensor name (``{i}`` = layer index)."""
    shape: tuple[str, ...]
    """HF shape as names of sizes from the table's ``dims``, e.g. ``("V", "D")``."""
    _: dataclasses.KW_ONLY
    transpose: bool = False
    """Swap the last two axes: torch Linear (out, in) <-> Flax kernel (in, out)."""
    fuse_axis: int = -1
    """HF axis on which a tuple of Flax params is concatenated (after their transposes)."""
    split: tuple[str, ...] | None = None
    """Sizes (names from ``dims``) of the fused parts along ``fuse_axis``; None = equal."""
    when: bool | str = True
    """Whether the row exists: True, False, a config flag name, or ``"not <flag>"``."""
    tied_to: str | None = None
    """HF name of the tensor this one equals when ``when`` is false (tied embeddings)."""

    @property
    def parts(self) -> tuple[str, ...]:
        return (self.flax,) if isinstance(self.flax, str) else tuple(self.flax)

    @property
    def per_layer(self) -> bool:
        return _LAYER in self.hf


def _flag(when: bool | str) -> tuple[str | None, bool]:
    """(flag name, expected truth) of a ``when``; (None, when) for a constant."""
    if isinstance(when, bool):
        return None, when
    if when.startswith("not "):
        return when[4:].strip(), False
    return when.strip(), True


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Architecture:
    """The mapping between one HF causal-LM class and a Flax param tree."""

    name: str
    """The ``arch=`` name, e.g. "llama"."""
    model_types: tuple[str, ...]
    """config.json ``model_type`` values this table reads; the first is written."""
    hf_class: str
    """transformers class written to config.json ``architectures``."""
    dims: Callable[[Mapping[str, Any]], dict[str, int]]
    """Named sizes used in ``HFTensor.shape`` (and the layer count) from a config dict."""
    defaults: Mapping[str, Any]
    """transformers' default of every config flag a row's ``when`` names."""
    tensors: tuple[HFTensor, ...]
    """The rows, in the order tensors are written."""
    layers: str = "L"
    """Name in ``dims`` of the number of layers."""
    base_prefix: str = ""
    """Prefix of the base model that some checkpoints omit (GPT-2's original files have
    ``h.0...`` where transformers writes ``transformer.h.0...``)."""
    ignore: tuple[str, ...] = ()
    """Regexes of HF tensors that are buffers, not params (ignored on load)."""

    def __post_init__(self) -> None:
        problems = []
        for row in self.tensors:
            for part in row.parts:
                if (_LAYER in part) != row.per_layer:
                    problems.append(f"{row.hf}: {part} and the HF name must both or neither "
                                    f"contain {_LAYER}")
                if _LAYER in part and f".{_LAYER}." not in f".{part}.":
                    problems.append(f"{row.hf}: {_LAYER} must be a whole component of {part}")
            flag, _ = _flag(row.when)
            if flag is not None and flag not in self.defaults:
                problems.append(f"{row.hf}: flag {flag!r} has no entry in defaults")
            if row.split is not None and len(row.split) != len(row.parts):
                problems.append(f"{row.hf}: split names {len(row.split)} sizes for "
                                f"{len(row.parts)} parts")
            if row.tied_to is not None and flag is None:
                problems.append(f"{row.hf}: tied_to needs a flag in when")
        if problems:
            raise ConfigError(f"architecture table {self.name!r} is inconsistent: "
                              + "; ".join(problems))

    def describe(self) -> str:
        """The table as aligned text (for docs and error messages)."""
        rows = [("flax", "hf", "shape", "layout")]
        for row in self.tensors:
            layout = []
            if row.transpose:
                layout.append("T")
            if len(row.parts) > 1:
                layout.append(f"fused axis {row.fuse_axis}")
            if row.when is not True:
                layout.append(f"when {row.when}")
            if row.tied_to:
                layout.append(f"tied_to {row.tied_to}")
            rows.append((" | ".join(row.parts), row.hf, "(" + ", ".join(row.shape) + ")",
                         ", ".join(layout)))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(
            f"{a.ljust(widths[0])}  {b.ljust(widths[1])}  {c.ljust(widths[2])}  {d}".rstrip()
            for a, b, c, d in rows)


def _llama_dims(c: Mapping[str, Any]) -> dict[str, int]:
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    return {"V": int(c["vocab_size"]), "D": hidden, "F": int(c["intermediate_size"]),
            "Q": heads * head_dim, "KV": kv_heads * head_dim, "L": int(c["num_hidden_layers"])}


def _gpt2_dims(c: Mapping[str, Any]) -> dict[str, int]:
    def first(*names: str) -> int:
        for name in names:
            if c.get(name) is not None:
                return int(c[name])
        raise KeyError(names[0])

    hidden = first("n_embd", "hidden_size")
    return {"V": int(c["vocab_size"]), "D": hidden, "3D": 3 * hidden,
            "F": int(c.get("n_inner") or 4 * hidden),
            "P": first("n_positions", "max_position_embeddings"),
            "L": first("n_layer", "num_hidden_layers")}


def _llama_family(*, name: str, model_type: str, hf_class: str, qkv_bias: bool | str,
                  o_bias: bool | str, mlp_bias: bool | str,
                  defaults: Mapping[str, Any]) -> Architecture:
    """Llama and its descendants differ only in which projections carry biases."""
    return Architecture(
        name=name, model_types=(model_type,), hf_class=hf_class, dims=_llama_dims,
        defaults=defaults,
        tensors=(
            HFTensor("embed.embedding", "model.embed_tokens.weight", ("V", "D")),
            HFTensor("layers.{i}.input_norm.scale", "model.layers.{i}.input_layernorm.weight",
                     ("D",)),
            HFTensor("layers.{i}.attn.q_proj.kernel", "model.layers.{i}.self_attn.q_proj.weight",
                     ("Q", "D"), transpose=True),
            HFTensor("layers.{i}.attn.q_proj.bias", "model.layers.{i}.self_attn.q_proj.bias",
                     ("Q",), when=qkv_bias),
            HFTensor("layers.{i}.attn.k_proj.kernel", "model.layers.{i}.self_attn.k_proj.weight",
                     ("KV", "D"), transpose=True),
            HFTensor("layers.{i}.attn.k_proj.bias", "model.layers.{i}.self_attn.k_proj.bias",
                     ("KV",), when=qkv_bias),
            HFTensor("layers.{i}.attn.v_proj.kernel", "model.layers.{i}.self_attn.v_proj.weight",
                     ("KV", "D"), transpose=True),
            HFTensor("layers.{i}.attn.v_proj.bias", "model.layers.{i}.self_attn.v_proj.bias",
                     ("KV",), when=qkv_bias),
            HFTensor("layers.{i}.attn.o_proj.kernel", "model.layers.{i}.self_attn.o_proj.weight",
                     ("D", "Q"), transpose=True),
            HFTensor("layers.{i}.attn.o_proj.bias", "model.layers.{i}.self_attn.o_proj.bias",
                     ("D",), when=o_bias),
            HFTensor("layers.{i}.post_attn_norm.scale",
                     "model.layers.{i}.post_attention_layernorm.weight", ("D",)),
            HFTensor("layers.{i}.mlp.gate_proj.kernel", "model.layers.{i}.mlp.gate_proj.weight",
                     ("F", "D"), transpose=True),
            HFTensor("layers.{i}.mlp.gate_proj.bias", "model.layers.{i}.mlp.gate_proj.bias",
                     ("F",), when=mlp_bias),
            HFTensor("layers.{i}.mlp.up_proj.kernel", "model.layers.{i}.mlp.up_proj.weight",
                     ("F", "D"), transpose=True),
            HFTensor("layers.{i}.mlp.up_proj.bias", "model.layers.{i}.mlp.up_proj.bias",
                     ("F",), when=mlp_bias),
            HFTensor("layers.{i}.mlp.down_proj.kernel", "model.layers.{i}.mlp.down_proj.weight",
                     ("D", "F"), transpose=True),
            HFTensor("layers.{i}.mlp.down_proj.bias", "model.layers.{i}.mlp.down_proj.bias",
                     ("D",), when=mlp_bias),
            HFTensor("norm.scale", "model.norm.weight", ("D",)),
            HFTensor("lm_head.kernel", "lm_head.weight", ("V", "D"), transpose=True,
                   when="not tie_word_embeddings", tied_to="model.embed_tokens.weight"),
        ))


LLAMA = _llama_family(
    name="llama", model_type="llama", hf_class="LlamaForCausalLM",
    qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
    defaults={"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False})

# Qwen2: q/k/v always have biases, o_proj and the MLP never do.
QWEN2 = _llama_family(
    name="qwen2", model_type="qwen2", hf_class="Qwen2ForCausalLM",
    qkv_bias=True, o_bias=False, mlp_bias=False, defaults={"tie_word_embeddings": False})

_GPT2_QKV = ("layers.{i}.attn.q_proj", "layers.{i}.attn.k_proj", "layers.{i}.attn.v_proj")

# transformers' GPT-2 uses Conv1D, whose weights are already (in, out): no transposes.
GPT2 = Architecture(
    name="gpt2", model_types=("gpt2",), hf_class="GPT2LMHeadModel", dims=_gpt2_dims,
    defaults={"tie_word_embeddings": True}, base_prefix="transformer.",
    ignore=(r"(^|\.)attn\.(masked_)?bias$", r"(^|\.)crossattention\.(masked_)?bias$"),
    tensors=(
        HFTensor("wte.embedding", "transformer.wte.weight", ("V", "D")),
        HFTensor("wpe.embedding", "transformer.wpe.weight", ("P", "D")),
        HFTensor("layers.{i}.ln_1.scale", "transformer.h.{i}.ln_1.weight", ("D",)),
        HFTensor("layers.{i}.ln_1.bias", "transformer.h.{i}.ln_1.bias", ("D",)),
        HFTensor(tuple(f"{p}.kernel" for p in _GPT2_QKV), "transformer.h.{i}.attn.c_attn.weight",
                 ("D", "3D")),
        HFTensor(tuple(f"{p}.bias" for p in _GPT2_QKV), "transformer.h.{i}.attn.c_attn.bias",
                 ("3D",)),
        HFTensor("layers.{i}.attn.o_proj.kernel", "transformer.h.{i}.attn.c_proj.weight",
                 ("D", "D")),
        HFTensor("layers.{i}.attn.o_proj.bias", "transformer.h.{i}.attn.c_proj.bias", ("D",)),
        HFTensor("layers.{i}.ln_2.scale", "transformer.h.{i}.ln_2.weight", ("D",)),
        HFTensor("layers.{i}.ln_2.bias", "transformer.h.{i}.ln_2.bias", ("D",)),
        HFTensor("layers.{i}.mlp.fc.kernel", "transformer.h.{i}.mlp.c_fc.weight", ("D", "F")),
        HFTensor("layers.{i}.mlp.fc.bias", "transformer.h.{i}.mlp.c_fc.bias", ("F",)),
        HFTensor("layers.{i}.mlp.proj.kernel", "transformer.h.{i}.mlp.c_proj.weight", ("F", "D")),
        HFTensor("layers.{i}.mlp.proj.bias", "transformer.h.{i}.mlp.c_proj.bias", ("D",)),
        HFTensor("ln_f.scale", "transformer.ln_f.weight", ("D",)),
        HFTensor("ln_f.bias", "transformer.ln_f.bias", ("D",)),
        HFTensor("lm_head.kernel", "lm_head.weight", ("V", "D"), transpose=True,
               when="not tie_word_embeddings", tied_to="transformer.wte.weight"),
    ))

#: the tables ``arch="..."`` names.
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, QWEN2, GPT2)}


def resolve_architecture(arch: str | Architecture) -> Architecture:
    """The table ``arch`` names (a key of ``ARCHITECTURES``), or ``arch`` itself when it is
    already an ``Architecture``; a ``ConfigError`` listing the known names otherwise."""
    if isinstance(arch, Architecture):
        return arch
    try:
        return ARCHITECTURES[arch]
    except (KeyError, TypeError):
        raise ConfigError(f"arch must be one of {sorted(ARCHITECTURES)} or a "
                          f"torch_bridge.hf.Architecture, got {arch!r}.") from None


def arch_for_model_type(model_type: Any) -> str | None:
    """The ``arch`` whose table reads a config.json of this ``model_type``, or None."""
    for name, table in ARCHITECTURES.items():
        if model_type in table.model_types:
            return name
    return None


# ------------------------------------------------------------------------ the engine


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
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


def _part_sizes(row: HFTensor, hf_shape: tuple[int, ...], dims: Mapping[str, int]) -> list[int]:
    if row.split is not None:
        return [dims[name] for name in row.split]
    total = hf_shape[row.fuse_axis]
    return [total // len(row.parts)] * len(row.parts)


def _part_shapes(row: HFTensor, hf_shape: tuple[int, ...],
                 dims: Mapping[str, int]) -> tuple[tuple[int, ...], ...]:
    """Flax shapes of a row's params: the HF shape cut on fuse_axis, then transposed."""
    shapes = []
    axis = row.fuse_axis % len(hf_shape)
    for size in _part_sizes(row, hf_shape, dims) if len(row.parts) > 1 else [hf_shape[axis]]:
        part = hf_shape[:axis] + (size,) + hf_shape[axis + 1:]
        shapes.append(_swap_last(part) if row.transpose else part)
    return tuple(shapes)


def _holds(when: bool | str, flags: Mapping[str, Any]) -> bool:
    flag, truth = _flag(when)
    return truth if flag is None else bool(flags.get(flag)) == truth


def _stacked_key(template: str) -> str:
    return ".".join(part for part in template.split(".") if part != _LAYER)


def _expand(arch: Architecture, flags: Mapping[str, Any], dims: Mapping[str, int] | None,
            num_layers: int) -> tuple[list[_Entry], list[_Entry]]:
    """(rows that exist for this config, rows that do not), one entry per layer."""
    active: list[_Entry] = []
    inactive: list[_Entry] = []
    for row in arch.tensors:
        hf_shape = part_shapes = None
        if dims is not None:
            hf_shape = tuple(int(dims[name]) for name in row.shape)
            part_shapes = _part_shapes(row, hf_shape, dims)
        stacked = tuple(_stacked_key(p) for p in row.parts)
        for layer in range(num_layers) if row.per_layer else [None]:
            index = str(layer)
            entry = _Entry(row=row, hf=row.hf.replace(_LAYER, index), layer=layer,
                           flax=tuple(p.replace(_LAYER, index) for p in row.parts),
                           stacked=stacked, hf_shape=hf_shape, part_shapes=part_shapes)
            (active if _holds(row.when, flags) else inactive).append(entry)
    return active, inactive


def _dims(arch: Architecture, flags: Mapping[str, Any]) -> dict[str, int]:
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


def _fmt_shape(shape: Iterable[int]) -> str:
    dims = [str(int(s)) for s in shape]  # once: ``shape`` may be an iterator
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def _mismatch_error(lead: str, arch: Architecture, problems: list[str],
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


def _flatten(params: Any) -> dict[str, Any]:
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


def _unflatten(flat: Mapping[str, Any]) -> dict[Any, Any]:
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


# ------------------------------------------------------------------------ dtype + json


def _resolve_dtype(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    import ml_dtypes  # registers bfloat16 with numpy

    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                   "fp32": "float32", "float": "float32"}
        name = aliases.get(name, name)
        if name == "bfloat16":
            return np.dtype(ml_dtypes.bfloat16)
        dtype = name
    elif type(dtype).__module__ == "torch":  # torch.bfloat16 etc., without importing torch
        return _resolve_dtype(str(dtype))
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise ConfigError(f"dtype must be e.g. 'bfloat16', 'float16', 'float32' or a numpy/jax "
                          f"dtype, got {dtype!r}.") from None
    if resolved.kind != "f" and resolved != np.dtype(ml_dtypes.bfloat16):
        raise ConfigError(f"dtype must be a floating dtype, got {resolved}.")
    return resolved


def _json_default(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if type(value).__module__ == "torch" and "dtype" in type(value).__name__:
        return str(value).removeprefix("torch.")
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _config_dict(config: Any) -> dict[str, Any]:
    """A deep, JSON-clean copy of a transformers config or its dict."""
    if isinstance(config, Mapping):
        raw = dict(config)
    elif callable(getattr(config, "to_dict", None)):
        raw = config.to_dict()
    else:
        raise ConfigError(f"config must be a transformers PretrainedConfig or its dict, got "
                          f"{type(config).__name__}.")
    return json.loads(json.dumps(raw, default=_json_default))


def _write_json(path: str, body: Any) -> int:
    return _write_text(path, json.dumps(body, indent=2, sort_keys=True, default=_json_default)
                       + "\n")


def _write_text(path: str, text: str) -> int:
    data = text.encode()
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return len(data)


# ------------------------------------------------------------------------------ export


@dataclasses.dataclass(frozen=True, slots=True)
class _Planned:
    """One HF tensor to write: where its data comes from, and what it will be."""

    hf: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sources: tuple[tuple[Any, int | None], ...]
    """(leaf, layer index on axis 0 or None) per fused part."""
    transpose: bool
    fuse_axis: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def materialize(self) -> np.ndarray:
        """The HF tensor as a C-contiguous little-endian array: at most one new buffer
        (none for a numpy or CPU jax leaf that needs no transpose, cast or concatenation)."""
        parts = []
        for leaf, layer in self.sources:
            # Slicing before np.asarray moves one layer off an accelerator, not the stack.
            array = np.asarray(leaf if layer is None else leaf[layer])
            parts.append(np.swapaxes(array, -1, -2) if self.transpose else array)
        dtype = self.dtype.newbyteorder("<")
        if self.transpose:
            # Fused parts sit side by side on fuse_axis; each is copied into its slice.
            out = np.empty(self.shape, dtype)
            axis = self.fuse_axis % out.ndim
            start = 0
            for part in parts:
                where = [slice(None)] * out.ndim
                where[axis] = slice(start, start + part.shape[axis])
                _copy_in_tiles(out[tuple(where)], part)
                start += part.shape[axis]
            return out
        if len(parts) > 1:
            return np.concatenate(parts, axis=self.fuse_axis, dtype=dtype, casting="unsafe")
        array = parts[0]
        if array.dtype == dtype and array.flags.c_contiguous:
            return array
        return np.array(array, dtype=dtype, order="C")


def _copy_in_tiles(out: np.ndarray, source: np.ndarray) -> None:
    """``out[...] = source`` (casting as needed) for a ``source`` whose last two axes are a
    transposed view, copied in square tiles of the last two axes. numpy's own copy walks
    such a view against its memory order; with tiles both sides stay within a few cache
    lines per row, about three times faster for a transposed weight matrix."""
    if source.ndim < 2:
        out[...] = source
        return
    edge = 128 if out.dtype.itemsize <= 2 else 64
    rows, cols = source.shape[-2:]
    for row in range(0, rows, edge):
        for col in range(0, cols, edge):
            out[..., row:row + edge, col:col + edge] = source[..., row:row + edge,
                                                              col:col + edge]


# safetensors dtype codes of the numpy dtypes we write.
_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                       "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
                       "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
                       "float8_e5m2": "F8_E5M2"}
_WRITE_CHUNK = 64 * 2**20  # measured: 64 MiB pieces stream at about raw disk speed


def _write_safetensors(path: str, items: list[_Planned],
                       on_tensor: Callable[[_Planned], Any]) -> int:
    """Write one safetensors file, converting one tensor at a time.

    The header is known from the plan (shapes, dtypes, offsets) before any data exists, so
    each tensor is converted, written and freed in turn, the next one converted while this
    one is written: the extra memory is two tensors at most, whatever the shard size. The file
    is then opened with safetensors itself, so a file that library would reject is never
    reported as written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in items:
        code = _SAFETENSORS_DTYPES.get(item.dtype.name)
        if code is None:
            raise ConfigError(f"{item.hf}: dtype {item.dtype} has no safetensors encoding.")
        header[item.hf] = {"dtype": code, "shape": list(item.shape),
                           "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data starts 8-byte aligned, as safetensors writes
    # The next tensor is converted on a helper thread while this one is written: the
    # conversion (transpose, cast) is CPU work and the write waits on the disk; numpy's
    # copies and the file writes both release the GIL.
    with open(path, "wb") as handle, \
            concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="jaxckpt-hf-convert") as converter:
        handle.write(len(text).to_bytes(8, "little"))
        handle.write(text)
        upcoming = converter.submit(items[0].materialize) if items else None
        for index, item in enumerate(items):
            assert upcoming is not None
            array = upcoming.result()
            upcoming = (converter.submit(items[index + 1].materialize)
                        if index + 1 < len(items) else None)
            if array.nbytes != item.nbytes or tuple(array.shape) != item.shape:
                raise CheckpointError(f"{item.hf}: produced shape {array.shape} "
                                      f"{array.dtype}, planned {item.shape} {item.dtype}")
            data = array.reshape(-1).view(np.uint8)
            for start in range(0, data.size, _WRITE_CHUNK):
                handle.write(data[start:start + _WRITE_CHUNK].data)
            del array, data
            on_tensor(item)
        handle.flush()
        os.fsync(handle.fileno())
    with safe_open(path, framework="np") as check:
        if len(check.keys()) != len(items):
            raise CheckpointError(f"{path}: safetensors reads {len(check.keys())} tensors, "
                                  f"{len(items)} were written")
    return 8 + len(text) + offset


def _plan_export(flat: Mapping[str, Any], arch: Architecture, flags: Mapping[str, Any],
                 dtype: np.dtype | None) -> list[_Planned]:
    """Match the flat Flax tree to the table; raise HFMismatchError listing every problem."""
    dims = _dims(arch, flags)
    num_layers = dims[arch.layers]
    active, inactive = _expand(arch, flags, dims, num_layers)
    # Stacked (scanned) layers: the first per-layer key exists only without its index.
    first = next((e for e in active if e.layer is not None), None)
    stacked = (first is not None and first.flax[0] not in flat and first.stacked[0] in flat)
    problems: list[str] = []
    used: set[str] = set()
    checked: set[str] = set()
    planned: list[_Planned] = []
    for entry in active:
        # Sized: _dims above gave every size (or raised).
        assert entry.part_shapes is not None and entry.hf_shape is not None
        sources = []
        for index, expected in enumerate(entry.part_shapes):
            key = entry.stacked[index] if stacked and entry.layer is not None else entry.flax[index]
            want = (num_layers, *expected) if stacked and entry.layer is not None else expected
            used.add(key)
            leaf = flat.get(key)
            if leaf is None:
                if key not in checked:
                    problems.append(f"missing {key}: expected {_fmt_shape(want)} (for {entry.hf})")
            elif tuple(leaf.shape) != want:
                if key not in checked:
                    problems.append(f"mis-shaped {key}: expected {_fmt_shape(want)}, found "
                                    f"{_fmt_shape(leaf.shape)} (for {entry.hf})")
            else:
                sources.append((leaf, entry.layer if stacked and entry.layer is not None else None))
            checked.add(key)
        if len(sources) == len(entry.part_shapes):
            out_dtype = dtype or np.result_type(*[np.dtype(leaf.dtype) for leaf, _ in sources])
            planned.append(_Planned(hf=entry.hf, shape=entry.hf_shape, dtype=np.dtype(out_dtype),
                                    sources=tuple(sources), transpose=entry.row.transpose,
                                    fuse_axis=entry.row.fuse_axis))
    why_inactive: dict[str, bool | str] = {}
    for entry in inactive:
        for key in (*entry.flax, *entry.stacked):
            why_inactive[key] = entry.row.when
    for key in sorted(set(flat) - used):
        line = f"unexpected {key}: found {_fmt_shape(flat[key].shape)} {np.dtype(flat[key].dtype)}"
        flag, _ = _flag(why_inactive.get(key, False))
        if flag is not None:  # a row the config turns off (not one that never exists)
            line += (f" (not part of the model: the config has {flag}={flags.get(flag)!r}; "
                     f"set {flag}={not flags.get(flag)} if the model uses this param)")
        problems.append(line)
    if problems:
        raise _mismatch_error(
            "the params do not match", arch, problems,
            "Fix: export the params of the model built from this config (e.g. "
            "jaxckpt.llm.params_of(model)), or fix the config so it describes them.")
    return planned


def _shards(planned: list[_Planned], max_shard_bytes: int) -> list[list[_Planned]]:
    shards: list[list[_Planned]] = []
    size = 0
    for item in planned:
        if not shards or (size + item.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += item.nbytes
    return shards or [[]]


def _check_model_type(config: Mapping[str, Any], arch: Architecture) -> None:
    model_type = config.get("model_type")
    if model_type is not None and model_type not in arch.model_types:
        suggestion = arch_for_model_type(model_type)
        raise ConfigError(
            f"the config's model_type is {model_type!r} but arch={arch.name!r} writes "
            f"{arch.model_types[0]!r}."
            + (f" Pass arch={suggestion!r}." if suggestion else " Pass the matching config."))


def _hf_config_body(config: Mapping[str, Any], arch: Architecture,
                    flags: Mapping[str, Any]) -> dict[str, Any]:
    """The config dict to serialise: model_type set, every table flag explicit (so no
    library default can flip a tied head)."""
    body = dict(config)
    _check_model_type(body, arch)
    body["model_type"] = body.get("model_type") or arch.model_types[0]
    for flag in arch.defaults:
        body[flag] = flags[flag]
    return body


def _copy_tokenizer(tokenizer: Any, directory: str) -> list[str]:
    if hasattr(tokenizer, "save_pretrained"):  # a transformers tokenizer object
        before = set(os.listdir(directory))
        tokenizer.save_pretrained(directory)
        return sorted(set(os.listdir(directory)) - before)
    source = os.fspath(tokenizer)
    if not os.path.isdir(source):
        raise CheckpointNotFoundError(f"tokenizer_dir {source!r} is not a directory.")
    names = [n for n in sorted(os.listdir(source))
             if n in _TOKENIZER_FILES or n.endswith(".tiktoken")]
    if not names:
        raise CheckpointNotFoundError(
            f"tokenizer_dir {source!r} holds none of {list(_TOKENIZER_FILES)}; point it at the "
            f"directory a tokenizer's save_pretrained wrote.")
    for name in names:
        shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
        fsync_file(os.path.join(directory, name))
    return names


def _step_of(directory: str) -> dict[str, int]:
    """The manager names exports epoch{E}epochstep{S}globalstep{G} (its temp name too)."""
    match = re.search(r"epoch(\d+)epochstep(\d+)globalstep(\d+)", os.path.basename(directory))
    if not match:
        return {}
    return {"epoch": int(match[1]), "epoch_step": int(match[2]), "global_step": int(match[3])}


def _write_export(params: Any, directory: str, *, arch: str | Architecture, config: Any,
                  dtype: Any, max_shard_bytes: int, tokenizer_dir: Any, generation_config: Any,
                  provenance: Mapping[str, Any] | None, progress: Progress | None) -> int:
    """Write an HF model into the existing, empty ``directory``; return the bytes written."""
    table = resolve_architecture(arch)
    if (isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
            or max_shard_bytes <= 0):
        raise ConfigError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}.")
    cast = _resolve_dtype(dtype)
    config_body = _config_dict(config)
    _check_model_type(config_body, table)
    flags = {**table.defaults, **{k: v for k, v in config_body.items() if v is not None}}
    # Everything is validated before the first byte is written.
    planned = _plan_export(_flatten(params), table, flags, cast)
    # config.json's dtype: the cast, else the dtype holding most of the bytes.
    by_dtype: dict[str, int] = {}
    for item in planned:
        by_dtype[item.dtype.name] = by_dtype.get(item.dtype.name, 0) + item.nbytes
    dtype_name = cast.name if cast is not None else max(by_dtype, key=by_dtype.__getitem__)
    config_text, generation_text = config_files(
        _hf_config_body(config_body, table, flags), hf_class=table.hf_class,
        dtype_name=dtype_name, generation_config=generation_config)

    shards = _shards(planned, max_shard_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)])
    total = sum(p.nbytes for p in planned)
    done = 0
    written = 0
    weight_map: dict[str, str] = {}
    for shard, name in zip(shards, names, strict=True):

        def on_tensor(item: _Planned, name: str = name) -> None:
            nonlocal done
            weight_map[item.hf] = name
            done += item.nbytes
            if progress is not None:
                progress(done, total)

        written += _write_safetensors(os.path.join(directory, name), shard, on_tensor)
    if len(shards) > 1:
        params_count = sum(int(np.prod(p.shape, dtype=np.int64)) for p in planned)
        written += _write_json(os.path.join(directory, INDEX_FILE), {
            "metadata": {"total_size": total, "total_parameters": params_count},
            "weight_map": dict(sorted(weight_map.items()))})
    written += _write_text(os.path.join(directory, CONFIG_FILE), config_text)
    extra_files = []
    if generation_text is not None:
        written += _write_text(os.path.join(directory, GENERATION_CONFIG_FILE), generation_text)
        extra_files.append(GENERATION_CONFIG_FILE)
    if tokenizer_dir is not None:
        copied = _copy_tokenizer(tokenizer_dir, directory)
        written += sum(os.path.getsize(os.path.join(directory, n)) for n in copied)
        extra_files.extend(copied)
    source = {**_step_of(directory), **dict(provenance or {})}
    written += _write_json(os.path.join(directory, PROVENANCE_FILE), {
        "format": PROVENANCE_FORMAT,
        "jaxckpt_version": __version__,
        "arch": table.name,
        "architectures": [table.hf_class],
        "dtype": dtype_name,
        "tensors": len(planned),
        "tensor_bytes": total,
        "files": names + ([INDEX_FILE] if len(shards) > 1 else []) + [CONFIG_FILE] + extra_files,
        "created_unix": time.time(),
        "source": source,
    })
    fsync_dir(directory)
    return written


def export_hf(params: Any, out_dir: str | os.PathLike[str], *, arch: str | Architecture,
              config: Any, dtype: Any = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              tokenizer_dir: Any = None, generation_config: Any = None,
              provenance: Mapping[str, Any] | None = None, overwrite: bool = False,
              progress: Progress | None = None) -> int:
    """Write Flax params as a Hugging Face model directory that
    ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads; return bytes written.

    Args:
      params: the Flax param tree (nested dicts/lists with jax or numpy leaves, an
        ``nnx.State`` or an ``nnx.Module``), laid out as ``jaxckpt.llm``'s models; decoder
        layers one per index or stacked on a leading axis.
      out_dir: the model directory; written under a temporary sibling name and renamed into
        place at the end, so it appears complete or not at all.
      arch: a name in ``ARCHITECTURES`` ("llama", "qwen2", "gpt2") or an ``Architecture``.
      config: the transformers config (object or dict) of the model; written as config.json
        with ``architectures``, ``model_type``, ``dtype`` set.
      dtype: cast every tensor (e.g. "bfloat16"); None keeps the params' dtypes.
      max_shard_bytes: above this, tensors go to ``model-0000k-of-0000N.safetensors`` files
        with ``model.safetensors.index.json``.
      tokenizer_dir: a directory with tokenizer files (copied) or a tokenizer object.
      generation_config: a ``GenerationConfig``, its dict, or a path to its json.
      provenance: facts to record in ``jaxckpt_provenance.json`` under "source" (e.g.
        ``{"checkpoint": path, "step": 1200}``).
      overwrite: replace an existing ``out_dir`` (swapped in by rename, then deleted).
      progress: ``progress(bytes_done, bytes_total)`` after each tensor.

    Raises ``HFMismatchError`` (a ``TreeMismatchError``) listing every missing, unexpected
    and mis-shaped param before anything is written; ``ExportExistsError`` when ``out_dir``
    exists and is not empty (and ``overwrite`` is False).
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.lexists(out_dir) and not overwrite:
        if not os.path.isdir(out_dir) or os.listdir(out_dir):
            raise ExportExistsError(
                f"{out_dir} already exists; pass overwrite=True to replace it, or pick a new "
                f"directory.")
    parent, base = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = os.path.join(parent, f".{base}.tmp-{tag}")
    os.mkdir(tmp)
    try:
        written = _write_export(params, tmp, arch=arch, config=config, dtype=dtype,
                                max_shard_bytes=max_shard_bytes, tokenizer_dir=tokenizer_dir,
                                generation_config=generation_config, provenance=provenance,
                                progress=progress)
        old = None
        if os.path.lexists(out_dir):
            old = os.path.join(parent, f".{base}.old-{tag}")
            os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(old)
    return written


#: ``HFExporter.checkpoint_metadata["format"]``: what export-hf reads from driver.json.
EXPORTER_RECORD_FORMAT = "jaxckpt.hf_exporter/1"

ParamsOf = Callable[[Any], Any] | str
"""A callable ``state -> params`` or a '/'-separated tree path such as ``"model/params"``."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HFExporter:
    """``ExportConfig(exporter=...)`` callable: ``exporter(state, out_dir) -> bytes``.

    Writes straight into ``out_dir`` (the manager hands over a fresh temporary directory and
    renames it into place). In async mode it receives the backend's host copy of the state.
    Stateless: safe to call from the manager's background thread.
    """

    arch: str | Architecture
    """Table name or Architecture."""
    config: Any
    """transformers config (object or dict) of the exported model."""
    dtype: Any = None
    """Cast tensors (e.g. "bfloat16"); None keeps the params' dtypes."""
    params_of: ParamsOf | None = None
    """Where the params are in the state given to ``maybe_save``/``export``: a tree path of
    '/'-separated keys (``"model/params"``; ``"0"`` for ``nnx.state((model, optimizer))``;
    ``"model"`` for a live nnx.Module under "model") or a callable ``state -> params``. The
    value found may be a param pytree, an ``nnx.State`` or a live ``nnx.Module`` (its
    ``nnx.Param`` variables). None: the state is the params (checked at each export)."""
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    """Shard size limit."""
    tokenizer_dir: Any = None
    """Tokenizer files copied into every export."""
    generation_config: Any = None
    """generation_config.json of every export; None writes the one transformers derives from
    ``config``."""
    provenance: Mapping[str, Any] | None = None
    """Extra provenance facts; the epoch and steps are read from the export's name."""

    def __post_init__(self) -> None:
        table = resolve_architecture(self.arch)
        _resolve_dtype(self.dtype)
        body = _config_dict(self.config)
        _check_model_type(body, table)
        flags = {**table.defaults, **{k: v for k, v in body.items() if v is not None}}
        _dims(table, flags)
        if isinstance(self.params_of, str):
            parse_params_path(self.params_of)
        elif self.params_of is not None and not callable(self.params_of):
            raise ConfigError(f"params_of must be a tree path such as 'model/params' or a "
                              f"callable(state) -> params, got {self.params_of!r}.")
        # Builds config.json once now, on the caller's thread: a config transformers
        # refuses fails here, and transformers is imported before training starts.
        config_files(_hf_config_body(body, table, flags), hf_class=table.hf_class,
                     dtype_name="float32", generation_config=self.generation_config)

    @property
    def checkpoint_metadata(self) -> dict[str, Any]:
        """What ``jaxckpt export-hf ROOT OUT_DIR`` needs, JSON-safe: the manager records it
        in every recovery checkpoint's driver.json (under "export")."""
        table = resolve_architecture(self.arch)
        path = self.params_of if isinstance(self.params_of, str) else None
        return {"format": EXPORTER_RECORD_FORMAT, "arch": table.name,
                "arch_known": ARCHITECTURES.get(table.name) is table,
                "config": _config_dict(self.config), "params_path": path,
                "params_of": ("path" if path is not None else
                              "callable" if self.params_of is not None else "state")}

    def __call__(self, state: Any, out_dir: str) -> int:
        if self.params_of is None:
            table = resolve_architecture(self.arch)
            anchor = next(row.parts[0] for row in table.tensors if not row.per_layer)
            check_is_params(state, arch_name=table.name,
                            roots={p.split(".")[0] for row in table.tensors for p in row.parts},
                            anchor=tuple(anchor.split(".")))
        params = pick_params(state, self.params_of)
        return _write_export(params, os.fspath(out_dir), arch=self.arch, config=self.config,
                             dtype=self.dtype, max_shard_bytes=self.max_shard_bytes,
                             tokenizer_dir=self.tokenizer_dir,
                             generation_config=self.generation_config,
                             provenance=self.provenance, progress=None)


def hf_exporter(*, arch: str | Architecture, config: Any, dtype: Any = None,
                params_of: ParamsOf | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer_dir: Any = None,
                generation_config: Any = None,
                provenance: Mapping[str, Any] | None = None) -> HFExporter:
    """An exporter for ``jaxckpt.ExportConfig(exporter=...)`` writing HF directories; see
    :class:`HFExporter`. ``params_of`` picks the model params out of the training state
    (``"model/params"`` or ``lambda state: ...``). Configuration errors raise now, not at
    the first export."""
    return HFExporter(arch=arch, config=config, dtype=dtype, params_of=params_of,
                      max_shard_bytes=max_shard_bytes, tokenizer_dir=tokenizer_dir,
                      generation_config=generation_config, provenance=provenance)


# -------------------------------------------------------------------------------- load


@dataclasses.dataclass(frozen=True, slots=True)
class _Stored:
    """Where one tensor of an HF directory lives."""

    file: str
    key: str
    """Its name inside the file (the base prefix may have been added to the lookup name)."""
    shape: tuple[int, ...]
    dtype: str
    """safetensors dtype code ("F32", "BF16", ...)."""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _ITEMSIZE.get(self.dtype, 4)


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _scan_directory(path: str) -> dict[str, _Stored]:
    """Every tensor of an HF directory (single file or sharded with an index), lazily."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        found = sorted(os.listdir(path))
        raise CheckpointNotFoundError(
            f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE} (found {found}). Only "
            f"safetensors checkpoints are read (never pickled .bin files); re-save the model "
            f"with save_pretrained(..., safe_serialization=True).")
    stored: dict[str, _Stored] = {}
    for name in files:
        full = os.path.join(path, name)
        if not os.path.exists(full):
            raise CheckpointNotFoundError(f"{path}: {INDEX_FILE} lists {name}, which is missing.")
        with safe_open(full, framework="np") as handle:
            for key in handle.keys():
                view = handle.get_slice(key)
                stored[key] = _Stored(full, key, tuple(view.get_shape()), view.get_dtype())
    return stored


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
    cast = _resolve_dtype(dtype)
    stored = _scan_directory(path)
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
        dims = _dims(table, flags)
        num_layers = dims[table.layers]
    except ConfigError as exc:
        # Still list every tensor the table wants (shapes by name) so the report is complete.
        dims = None
        num_layers = _count_layers(table, config, stored)
        notes.append(f"config.json cannot size the {table.name!r} table's tensors: {exc}")
    entries, inactive = _expand(table, flags, dims, num_layers)
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
        entries, inactive = _expand(table, flags, dims, num_layers)
    # A tied head saved anyway (equal to the embedding) is what transformers loads tied.
    ignored = {e.hf for e in inactive if e.row.tied_to is not None}

    problems = _stored_problems(table, entries, stored, ignored)
    if wrong_type:
        raise _model_type_error(path, table, model_type, problems, len(entries))
    if problems or dims is None:
        raise _mismatch_error(
            f"{path} does not match", table, problems,
            "".join(f"{note}\n" for note in notes)
            + f"Fix: pass the arch that wrote this directory (known: {sorted(ARCHITECTURES)}), "
              f"or a config.json that matches its tensors.")

    flat = _read_entries(entries, stored, stacked=stacked, num_layers=num_layers, dims=dims,
                         cast=cast, progress=progress)
    return _unflatten(flat), config


def _stored_problems(table: Architecture, entries: list[_Entry],
                     stored: Mapping[str, _Stored], ignored: set[str]) -> list[str]:
    """Every missing, mis-shaped and unexpected tensor of a directory against the table."""
    problems = []
    expected = {e.hf: e for e in entries}
    for name, entry in expected.items():
        found = stored.get(name)
        want = (_fmt_shape(entry.hf_shape) if entry.hf_shape is not None
                else "(" + ", ".join(entry.row.shape) + ")")
        if found is None:
            problems.append(f"missing {name}: expected {want}")
        elif entry.hf_shape is not None and found.shape != entry.hf_shape:
            problems.append(f"mis-shaped {name}: expected {want}, found {_fmt_shape(found.shape)}")
    ignore = [re.compile(p) for p in table.ignore]
    for name in sorted(set(stored) - set(expected) - ignored):
        if not any(p.search(name) for p in ignore):
            problems.append(f"unexpected {name}: found {_fmt_shape(stored[name].shape)} "
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
                  stored: Mapping[str, _Stored]) -> int:
    """Layer count when the table's dims cannot read the config (a mismatch report)."""
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(key), int):
            return config[key]
    found = set()
    for row in table.tensors:
        if row.per_layer:
            pattern = re.compile(re.escape(row.hf).replace(re.escape(_LAYER), r"(\d+)") + "$")
            for name in stored:
                match = pattern.match(name)
                if match:
                    found.add(int(match[1]))
    return max(found) + 1 if found else 0


def _check_tied(inactive: list[_Entry], stored: Mapping[str, _Stored]) -> str | None:
    """The flag to turn off when a tied row's tensor is present and differs from its tie."""
    for entry in inactive:
        row = entry.row
        if row.tied_to is None or entry.hf not in stored or row.tied_to not in stored:
            continue
        head = _load_one(stored, entry.hf)
        tie = _load_one(stored, row.tied_to)
        if head.shape != tie.shape or not np.array_equal(head, tie):
            flag, _ = _flag(row.when)
            return flag
    return None


def _load_one(stored: Mapping[str, _Stored], name: str) -> np.ndarray:
    with safe_open(stored[name].file, framework="np") as handle:
        return handle.get_tensor(stored[name].key)


def _read_entries(entries: list[_Entry], stored: Mapping[str, _Stored], *, stacked: bool,
                  num_layers: int, dims: Mapping[str, int], cast: np.dtype | None,
                  progress: Progress | None) -> dict[str, np.ndarray]:
    """Read and convert every entry, one file open at a time; stacked leaves are filled in
    place (no second copy of a stack)."""
    flat: dict[str, np.ndarray] = {}
    by_file: dict[str, list[_Entry]] = {}
    for entry in entries:
        by_file.setdefault(stored[entry.hf].file, []).append(entry)
    total = sum(stored[e.hf].nbytes for e in entries)
    done = 0
    for file, group in by_file.items():
        with safe_open(file, framework="np") as handle:
            for entry in group:
                array = handle.get_tensor(stored[entry.hf].key)
                row = entry.row
                if len(row.parts) > 1:
                    assert entry.hf_shape is not None  # sized: dims given
                    sizes = _part_sizes(row, entry.hf_shape, dims)
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
