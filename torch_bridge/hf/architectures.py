"""The architecture tables: which Flax param becomes which HF tensor, with what layout change.

Owns: ``HFTensor`` (one row), ``Architecture`` (one table, checked for consistency when made),
the tables ``LLAMA``, ``QWEN2`` and ``GPT2`` with their config sizes, ``ARCHITECTURES`` (the
``arch=`` names) and looking a table up by name or config.json ``model_type``. Adding an
architecture means adding one table here (or passing an ``Architecture`` as ``arch=``): the
engine (``mapping``) has no per-architecture code. The Flax side of every table is the layout
of ``jaxckpt.llm``'s reference models.

Must not import jax or torch: a table is data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxckpt.errors import ConfigError

__all__ = ["HFTensor", "Architecture", "LLAMA", "QWEN2", "GPT2", "ARCHITECTURES",
           "resolve_architecture", "arch_for_model_type", "flag_of", "LAYER"]

#: stands for the layer index in a row's Flax path and HF name.
LAYER = "{i}"


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
        return LAYER in self.hf


def flag_of(when: bool | str) -> tuple[str | None, bool]:
    """(flag name, expected truth) of a ``when``; (None, when) for a constant."""
    if isinstance(when, bool):
        return None, when
    if when.startswith("not "):
        return when[4:].strip(), False
    return when.strip(), True


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Architecture:
    """The mapping between one HF causal-LM class and a Flax param tree: a tuple of
    :class:`HFTensor` rows, one per HF tensor.

    - ``flax`` / ``hf``: dotted Flax param path and HF tensor name; ``{i}`` stands for the
      layer index. A Flax tree may hold the layers one per index (``layers.0.attn...``) or
      stacked on a leading axis (``layers.attn...``, as ``nnx.scan``/``nnx.vmap`` make them):
      export detects which, ``load_hf(stacked=True)`` returns the stacked form.
    - ``shape``: the HF tensor's shape in named sizes that the table's ``dims`` derives from
      the config; every tensor is checked against it in both directions.
    - ``transpose``: torch ``nn.Linear`` weights are (out, in), Flax kernels (in, out).
    - a tuple of Flax paths: the HF tensor is those params concatenated on ``fuse_axis``
      (GPT-2's fused ``c_attn`` = [q | k | v]); sizes from ``split`` (default: equal parts).
    - ``when``: the row exists only when a config flag holds (``"attention_bias"``,
      ``"not tie_word_embeddings"``), or always/never (True/False).
    - ``tied_to``: the HF tensor this one equals when the embeddings are tied. transformers
      loads a present-but-different LM head UNTIED with only a warning (docs/design.md,
      "Measured facts"), so ``load_hf`` compares the two, and export refuses a tree whose
      tied/untied state contradicts the config.

    The fields below are its constructor's arguments (keyword only).
    """

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
                if (LAYER in part) != row.per_layer:
                    problems.append(f"{row.hf}: {part} and the HF name must both or neither "
                                    f"contain {LAYER}")
                if LAYER in part and f".{LAYER}." not in f".{part}.":
                    problems.append(f"{row.hf}: {LAYER} must be a whole component of {part}")
            flag, _ = flag_of(row.when)
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
