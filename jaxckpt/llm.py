"""Flax NNX reference decoders that match Hugging Face checkpoints: Llama (with Qwen2) and GPT-2.

Owns: the models ``torch_bridge.hf`` maps to and from (their param trees are in the class
docstrings), reading a transformers config into a validated spec, and moving a plain param
tree in and out of a model (``params_of`` / ``load_params``). They reproduce transformers'
float32 numerics (logits within about 1e-5 of ``AutoModelForCausalLM``); plain Flax layout
(``nnx.Linear`` kernels (in, out)); ``scan_layers=True`` stacks the layers on a leading
axis. Inference and parity references only: no dropout, no KV cache.

Must not import: torch. Imports jax and flax (the ``jax`` extra); ``import jaxckpt`` does not
load this module.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .core.extras import requires_extra
from .errors import ConfigError, TreeMismatchError

with requires_extra("jax", "jaxckpt.llm (the Flax reference decoders)"):
    import jax
    import jax.numpy as jnp
    from flax import nnx

__all__ = [
    "LlamaSpec",
    "GPT2Spec",
    "Llama",
    "GPT2",
    "RMSNorm",
    "spec_from_config",
    "from_config",
    "params_of",
    "load_params",
]

_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    # transformers' "gelu_new" (GPT-2) and "gelu_pytorch_tanh" are the tanh approximation.
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


# ------------------------------------------------------------------------------ configs


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise ConfigError(
        f"config must be a transformers PretrainedConfig or its dict (config.json), got "
        f"{type(config).__name__}. Write e.g. from_config(transformers.AutoConfig."
        f"from_pretrained(path), rngs=nnx.Rngs(0)) or pass json.load(open('config.json')).")


def _first(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` present (not None) in config: GPT-2 spells ``hidden_size``
    ``n_embd`` in its config.json, other models the other way round."""
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    if default is not None:
        return default
    raise ConfigError(f"config has none of {names}; it is not a complete config of this "
                      f"architecture (model_type {config.get('model_type')!r}).")


def _act(name: str, model: str) -> Callable[[jax.Array], jax.Array]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(f"{model}: activation {name!r} is not supported by the reference "
                          f"model; supported: {sorted(_ACTIVATIONS)}.") from None


def _check_positive_ints(spec: Any, owner: str, names: tuple[str, ...]) -> None:
    """Every named field of a model spec is a positive int (a bool is not)."""
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{owner}.{name} must be a positive int, got {value!r}.")


def _rope_theta(config: Mapping[str, Any]) -> float:
    # transformers 5 nests RoPE settings in rope_parameters; older config.json files keep
    # rope_theta / rope_scaling at the top level.
    rope = config.get("rope_parameters") or {}
    legacy = config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if rope_type != "default":
        raise ConfigError(
            f"rope_type {rope_type!r} is not supported by the reference Llama (only the "
            f"default rotate-half RoPE); the checkpoint itself exports and imports fine.")
    return float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LlamaSpec:
    """The sizes and switches of a Llama-family decoder (Llama, Qwen2)."""

    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    head_dim: int
    """Width of one head (``hidden_size // num_heads`` unless the config says otherwise)."""
    rms_norm_eps: float = 1e-6
    """Added to the mean square inside the root of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    hidden_act: str = "silu"
    """Activation of the gate projection."""
    qkv_bias: bool = False
    """Whether q/k/v projections have biases (Llama ``attention_bias``; always for Qwen2)."""
    o_bias: bool = False
    """Whether the output projection has a bias (Llama ``attention_bias``; never for Qwen2)."""
    mlp_bias: bool = False
    """Whether the MLP projections have biases (Llama ``mlp_bias``)."""
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding (no ``lm_head`` param)."""

    def __post_init__(self) -> None:
        _check_positive_ints(self, "LlamaSpec", ("vocab_size", "hidden_size", "intermediate_size",
                                                 "num_layers", "num_heads", "num_kv_heads",
                                                 "head_dim"))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"LlamaSpec.num_heads={self.num_heads} must be a multiple of "
                              f"num_kv_heads={self.num_kv_heads}.")
        _act(self.hidden_act, "LlamaSpec")

    @classmethod
    def from_hf(cls, config: Any) -> LlamaSpec:
        """Read a transformers ``LlamaConfig`` / ``Qwen2Config`` (or its dict)."""
        c = _as_dict(config)
        model_type = c.get("model_type", "llama")
        if model_type not in ("llama", "qwen2"):
            raise ConfigError(f"Llama reads model_type 'llama' or 'qwen2', got {model_type!r}. "
                              f"Use jaxckpt.llm.from_config to pick the model from the config.")
        if c.get("use_sliding_window") and "sliding_attention" in (c.get("layer_types") or []):
            raise ConfigError("sliding-window attention is not supported by the reference "
                              "Llama; set use_sliding_window=False.")
        hidden = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            qkv_bias = o_bias = bool(c.get("attention_bias", False))
            mlp_bias = bool(c.get("mlp_bias", False))
        return cls(
            vocab_size=int(c["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(c["intermediate_size"]),
            num_layers=int(c["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(c),
            hidden_act=str(c.get("hidden_act", "silu")), qkv_bias=qkv_bias, o_bias=o_bias,
            mlp_bias=mlp_bias, tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GPT2Spec:
    """The sizes and switches of a GPT-2 decoder."""

    vocab_size: int
    """Rows of the token embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream (``n_embd``)."""
    num_layers: int
    """Blocks (``n_layer``)."""
    num_heads: int
    """Attention heads (``n_head``)."""
    max_positions: int
    """Rows of the learned position embedding (``n_positions``)."""
    inner_size: int
    """Width of the MLP (``n_inner``, default 4 x hidden)."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon."""
    activation: str = "gelu_new"
    """MLP activation (``activation_function``)."""
    scale_attn_weights: bool = True
    """Scale attention logits by 1/sqrt(head_dim)."""
    scale_attn_by_inverse_layer_idx: bool = False
    """Also divide attention logits by (layer index + 1)."""
    tie_word_embeddings: bool = True
    """The LM head reuses ``wte`` (no ``lm_head`` param)."""

    def __post_init__(self) -> None:
        _check_positive_ints(self, "GPT2Spec", ("vocab_size", "hidden_size", "num_layers",
                                                "num_heads", "max_positions", "inner_size"))
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"GPT2Spec.hidden_size={self.hidden_size} must be a multiple of "
                              f"num_heads={self.num_heads}.")
        _act(self.activation, "GPT2Spec")

    @classmethod
    def from_hf(cls, config: Any) -> GPT2Spec:
        """Read a transformers ``GPT2Config`` (or its dict)."""
        c = _as_dict(config)
        if c.get("model_type", "gpt2") != "gpt2":
            raise ConfigError(f"GPT2 reads model_type 'gpt2', got {c.get('model_type')!r}.")
        if c.get("add_cross_attention"):
            raise ConfigError("GPT-2 cross-attention is not supported by the reference model.")
        hidden = int(_first(c, "n_embd", "hidden_size"))
        return cls(
            vocab_size=int(c["vocab_size"]), hidden_size=hidden,
            num_layers=int(_first(c, "n_layer", "num_hidden_layers")),
            num_heads=int(_first(c, "n_head", "num_attention_heads")),
            max_positions=int(_first(c, "n_positions", "max_position_embeddings")),
            inner_size=int(c.get("n_inner") or 4 * hidden),
            layer_norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
            activation=str(c.get("activation_function", "gelu_new")),
            scale_attn_weights=bool(c.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(c.get("scale_attn_by_inverse_layer_idx", False)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)))


def spec_from_config(config: Any) -> LlamaSpec | GPT2Spec:
    """The spec of whichever reference model ``config``'s ``model_type`` names."""
    model_type = _as_dict(config).get("model_type")
    if model_type in ("llama", "qwen2"):
        return LlamaSpec.from_hf(config)
    if model_type == "gpt2":
        return GPT2Spec.from_hf(config)
    raise ConfigError(f"no reference model for model_type {model_type!r}; supported: "
                      f"'llama', 'qwen2' (class Llama) and 'gpt2' (class GPT2).")


# ------------------------------------------------------------------------------ layers


def _normal(std: float = 0.02) -> Any:
    return nnx.initializers.normal(stddev=std)


class RMSNorm(nnx.Module):
    """transformers' RMSNorm: normalise in float32 (eps inside the root), cast back to the
    input dtype, then multiply by ``scale``. The order matters in low precision."""

    def __init__(self, dim: int, *, eps: float, param_dtype: Any = jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return self.scale[...] * normed


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rope_tables(positions: jax.Array, head_dim: int, theta: float,
                 dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape (batch, seq, 1, head_dim): frequencies repeated as [f | f]
    (rotate-half convention, as transformers computes them, in float32)."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                      scale: jax.Array | float) -> jax.Array:
    """q (b, t, h, d), k/v (b, t, kv, d) -> (b, t, h, d). Softmax in float32."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:  # query head j reads kv head j // groups, as transformers' repeat_kv
        k = jnp.repeat(k, groups, axis=2)
        v = jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    length = q.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class Attention(nnx.Module):
    """Multi-head (grouped-query) causal self-attention with separate q/k/v/o projections."""

    def __init__(self, hidden: int, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 qkv_bias: bool, o_bias: bool, param_dtype: Any, rngs: nnx.Rngs):
        def linear(n_in: int, n_out: int, bias: bool) -> nnx.Linear:
            return nnx.Linear(n_in, n_out, use_bias=bias, kernel_init=_normal(),
                              param_dtype=param_dtype, rngs=rngs)

        self.q_proj = linear(hidden, num_heads * head_dim, qkv_bias)
        self.k_proj = linear(hidden, num_kv_heads * head_dim, qkv_bias)
        self.v_proj = linear(hidden, num_kv_heads * head_dim, qkv_bias)
        self.o_proj = linear(num_heads * head_dim, hidden, o_bias)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def __call__(self, x: jax.Array, *, scale: jax.Array | float,
                 rope: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        batch, length, _ = x.shape
        q = self.q_proj(x).reshape(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        if rope is not None:
            cos, sin = rope
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        out = _causal_attention(q, k, v, scale)
        return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim))


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)), the Llama MLP."""

    def __init__(self, hidden: int, inner: int, *, act: str, bias: bool, param_dtype: Any,
                 rngs: nnx.Rngs):
        def linear(n_in: int, n_out: int) -> nnx.Linear:
            return nnx.Linear(n_in, n_out, use_bias=bias, kernel_init=_normal(),
                              param_dtype=param_dtype, rngs=rngs)

        self.gate_proj = linear(hidden, inner)
        self.up_proj = linear(hidden, inner)
        self.down_proj = linear(inner, hidden)
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(_ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nnx.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: LlamaSpec, *, param_dtype: Any, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps, param_dtype=param_dtype)
        self.attn = Attention(spec.hidden_size, num_heads=spec.num_heads,
                              num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                              qkv_bias=spec.qkv_bias, o_bias=spec.o_bias,
                              param_dtype=param_dtype, rngs=rngs)
        self.post_attn_norm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps,
                                      param_dtype=param_dtype)
        self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size, act=spec.hidden_act,
                            bias=spec.mlp_bias, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], scale: float) -> jax.Array:
        x = x + self.attn(self.input_norm(x), scale=scale, rope=rope)
        return x + self.mlp(self.post_attn_norm(x))


class GPT2MLP(nnx.Module):
    """proj(act(fc(x))), GPT-2's MLP (transformers' Conv1D c_fc / c_proj)."""

    def __init__(self, hidden: int, inner: int, *, act: str, param_dtype: Any, rngs: nnx.Rngs):
        self.fc = nnx.Linear(hidden, inner, kernel_init=_normal(), param_dtype=param_dtype,
                             rngs=rngs)
        self.proj = nnx.Linear(inner, hidden, kernel_init=_normal(), param_dtype=param_dtype,
                               rngs=rngs)
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(_ACTIVATIONS[self.act](self.fc(x)))


class GPT2Block(nnx.Module):
    """Pre-LayerNorm GPT-2 block."""

    def __init__(self, spec: GPT2Spec, *, param_dtype: Any, rngs: nnx.Rngs):
        def layer_norm() -> nnx.LayerNorm:
            # use_fast_variance=False: E[(x - mean)^2], as torch computes it.
            return nnx.LayerNorm(spec.hidden_size, epsilon=spec.layer_norm_eps,
                                 use_fast_variance=False, param_dtype=param_dtype, rngs=rngs)

        self.ln_1 = layer_norm()
        self.attn = Attention(spec.hidden_size, num_heads=spec.num_heads,
                              num_kv_heads=spec.num_heads,
                              head_dim=spec.hidden_size // spec.num_heads, qkv_bias=True,
                              o_bias=True, param_dtype=param_dtype, rngs=rngs)
        self.ln_2 = layer_norm()
        self.mlp = GPT2MLP(spec.hidden_size, spec.inner_size, act=spec.activation,
                           param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, scale: jax.Array | float) -> jax.Array:
        x = x + self.attn(self.ln_1(x), scale=scale)
        return x + self.mlp(self.ln_2(x))


# ------------------------------------------------------------------------ layer stacks


def _make_layers(build: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs,
                 scan_layers: bool) -> Any:
    if not scan_layers:
        return nnx.List([build(rngs) for _ in range(count)])

    # One module whose params carry a leading layer axis; each layer gets its own RNG split.
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs: nnx.Rngs) -> nnx.Module:
        return build(layer_rngs)

    return make(rngs)


def _run_layers(layers: Any, x: jax.Array, per_layer: jax.Array, scan_layers: bool,
                step: Callable[[Any, jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """Apply every layer in order; ``per_layer[i]`` is handed to layer i (e.g. its scale)."""
    if not scan_layers:
        for index, layer in enumerate(layers):
            x = step(layer, x, per_layer[index])
        return x

    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
    def body(carry: jax.Array, layer: Any, extra: jax.Array) -> jax.Array:
        return step(layer, carry, extra)

    return body(x, layers, per_layer)


def _positions(input_ids: jax.Array, positions: jax.Array | None) -> jax.Array:
    if positions is not None:
        return jnp.broadcast_to(positions, input_ids.shape)
    return jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)


# ------------------------------------------------------------------------------ models


class Llama(nnx.Module):
    """A Llama-family causal LM (Llama, Qwen2) with transformers' numerics.

    ``config``: a ``LlamaSpec``, a transformers ``LlamaConfig``/``Qwen2Config`` or its dict.
    ``scan_layers``: keep the layers stacked (leading layer axis) and run them with
    ``nnx.scan``: one compiled layer instead of ``num_layers`` copies.

    Param tree (``params_of(model)``; ``{i}`` is the layer; with ``scan_layers`` the ``{i}``
    level disappears and every layer leaf gains a leading axis of size ``num_layers``)::

        embed.embedding                       (vocab, hidden)
        layers.{i}.input_norm.scale           (hidden,)
        layers.{i}.attn.{q,k,v,o}_proj.kernel (hidden, heads*head_dim) ... (.bias if set)
        layers.{i}.post_attn_norm.scale       (hidden,)
        layers.{i}.mlp.{gate,up,down}_proj.kernel
        norm.scale                            (hidden,)
        lm_head.kernel                        (hidden, vocab)   only when untied

    Concurrency contract: an NNX module is mutable Python state; use one from one thread.
    """

    def __init__(self, config: Any, *, rngs: nnx.Rngs, scan_layers: bool = False,
                 param_dtype: Any = jnp.float32):
        spec = config if isinstance(config, LlamaSpec) else LlamaSpec.from_hf(config)
        self.spec = spec
        self.scan_layers = bool(scan_layers)
        self.embed = nnx.Embed(spec.vocab_size, spec.hidden_size, embedding_init=_normal(),
                               param_dtype=param_dtype, rngs=rngs)
        self.layers = _make_layers(lambda r: LlamaBlock(spec, param_dtype=param_dtype, rngs=r),
                                   spec.num_layers, rngs, self.scan_layers)
        self.norm = RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps, param_dtype=param_dtype)
        if not spec.tie_word_embeddings:
            self.lm_head = nnx.Linear(spec.hidden_size, spec.vocab_size, use_bias=False,
                                      kernel_init=_normal(), param_dtype=param_dtype, rngs=rngs)

    def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None) -> jax.Array:
        """Logits (batch, seq, vocab) for token ids (batch, seq)."""
        spec = self.spec
        x = self.embed(input_ids)
        rope = _rope_tables(_positions(input_ids, positions), spec.head_dim, spec.rope_theta,
                            x.dtype)
        scale = spec.head_dim ** -0.5
        per_layer = jnp.zeros((spec.num_layers,), jnp.float32)  # nothing varies per layer
        x = _run_layers(self.layers, x, per_layer, self.scan_layers,
                        lambda layer, h, _: layer(h, rope, scale))
        x = self.norm(x)
        if spec.tie_word_embeddings:
            return self.embed.attend(x)
        return self.lm_head(x)


class GPT2(nnx.Module):
    """GPT-2 (``GPT2LMHeadModel``) with transformers' numerics and separate q/k/v params.

    ``config``: a ``GPT2Spec``, a transformers ``GPT2Config`` or its dict. ``scan_layers`` as
    for :class:`Llama`.

    Param tree: ``wte.embedding``, ``wpe.embedding``, ``layers.{i}.{ln_1,ln_2}.{scale,bias}``,
    ``layers.{i}.attn.{q,k,v,o}_proj.{kernel,bias}`` (the bridge splits and joins GPT-2's
    fused ``c_attn``), ``layers.{i}.mlp.{fc,proj}.{kernel,bias}``, ``ln_f.{scale,bias}``, and
    ``lm_head.kernel`` when untied.

    Concurrency contract: an NNX module is mutable Python state; use one from one thread.
    """

    def __init__(self, config: Any, *, rngs: nnx.Rngs, scan_layers: bool = False,
                 param_dtype: Any = jnp.float32):
        spec = config if isinstance(config, GPT2Spec) else GPT2Spec.from_hf(config)
        self.spec = spec
        self.scan_layers = bool(scan_layers)
        self.wte = nnx.Embed(spec.vocab_size, spec.hidden_size, embedding_init=_normal(),
                             param_dtype=param_dtype, rngs=rngs)
        self.wpe = nnx.Embed(spec.max_positions, spec.hidden_size, embedding_init=_normal(0.01),
                             param_dtype=param_dtype, rngs=rngs)
        self.layers = _make_layers(lambda r: GPT2Block(spec, param_dtype=param_dtype, rngs=r),
                                   spec.num_layers, rngs, self.scan_layers)
        self.ln_f = nnx.LayerNorm(spec.hidden_size, epsilon=spec.layer_norm_eps,
                                  use_fast_variance=False, param_dtype=param_dtype, rngs=rngs)
        if not spec.tie_word_embeddings:
            self.lm_head = nnx.Linear(spec.hidden_size, spec.vocab_size, use_bias=False,
                                      kernel_init=_normal(), param_dtype=param_dtype, rngs=rngs)

    def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None) -> jax.Array:
        """Logits (batch, seq, vocab) for token ids (batch, seq)."""
        spec = self.spec
        x = self.wte(input_ids) + self.wpe(_positions(input_ids, positions))
        head_dim = spec.hidden_size // spec.num_heads
        scale = head_dim ** -0.5 if spec.scale_attn_weights else 1.0
        layer_scale: np.ndarray = np.full((spec.num_layers,), scale, np.float32)
        if spec.scale_attn_by_inverse_layer_idx:
            layer_scale = layer_scale / np.arange(1, spec.num_layers + 1, dtype=np.float32)
        x = _run_layers(self.layers, x, jnp.asarray(layer_scale), self.scan_layers,
                        lambda layer, h, s: layer(h, s))
        x = self.ln_f(x)
        if spec.tie_word_embeddings:
            return self.wte.attend(x)
        return self.lm_head(x)


def from_config(config: Any, *, rngs: nnx.Rngs, scan_layers: bool = False,
                param_dtype: Any = jnp.float32) -> Llama | GPT2:
    """The reference model for a transformers config (object or config.json dict), chosen by
    its ``model_type``: 'llama' and 'qwen2' -> :class:`Llama`, 'gpt2' -> :class:`GPT2`."""
    spec = spec_from_config(config)
    cls = GPT2 if isinstance(spec, GPT2Spec) else Llama
    return cls(spec, rngs=rngs, scan_layers=scan_layers, param_dtype=param_dtype)


# ------------------------------------------------------------------------ param trees


def params_of(model: nnx.Module) -> dict[str, Any]:
    """The model's params as a plain nested dict (``nnx.to_pure_dict``), the tree that
    ``torch_bridge.export_hf`` takes and ``torch_bridge.load_hf`` returns."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def load_params(model: nnx.Module, params: Mapping[Any, Any]) -> None:
    """Put a plain param tree (e.g. from ``torch_bridge.load_hf``) into ``model`` in place.

    Leaves are matched by tree path and cast to the model's param dtype. Raises
    ``TreeMismatchError`` listing every missing, unexpected and mis-shaped path (nothing is
    changed then)."""
    state = nnx.state(model, nnx.Param)
    expected = {jax.tree_util.keystr(path): leaf
                for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]}
    given = {jax.tree_util.keystr(path): leaf
             for path, leaf in jax.tree_util.tree_flatten_with_path(dict(params))[0]}
    problems = []
    for path, leaf in expected.items():
        if path not in given:
            problems.append(f"{path}: missing (model has shape {tuple(leaf.shape)})")
        elif tuple(np.shape(given[path])) != tuple(leaf.shape):
            problems.append(f"{path}: expected shape {tuple(leaf.shape)}, found "
                            f"{tuple(np.shape(given[path]))}")
    for path in given.keys() - expected.keys():
        problems.append(f"{path}: unexpected (not a param of {type(model).__name__})")
    if problems:
        problems.sort()
        raise TreeMismatchError(
            f"params do not fit {type(model).__name__}: {len(problems)} path(s) differ:\n"
            + "\n".join(f"  {line}" for line in problems)
            + "\nFix: build the model from the same config the params came with (e.g. the "
              "config returned by load_hf), with the same scan_layers setting.", problems)

    def cast(like: Any, value: Any) -> Any:
        return jnp.asarray(value, dtype=like.dtype)

    pure = jax.tree_util.tree_map(cast, nnx.to_pure_dict(state), dict(params))
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
