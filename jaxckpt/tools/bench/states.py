"""The synthetic states of ``jaxckpt bench``: incompressible bytes as trees of arrays.

Owns: the random bytes, their split into float32 and bfloat16 leaves, the jax state made of
them (XLA's own buffers, as a training step's), its abstract form and size, and a Llama config
and param tree of about a given size for the Hugging Face export rows.

Must not import at module level: jax, flax (imported inside the functions).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def _random_bytes(nbytes: int, seed: int) -> np.ndarray:
    """Incompressible data (random float32 values; no compression is applied anyway)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(-(-nbytes // 4), dtype=np.float32).view(np.uint8)[:nbytes]


def _leaf_arrays(data: np.ndarray, leaves: int) -> list[np.ndarray]:
    """Split ``data`` into ``leaves`` arrays, every fourth one bfloat16, float32 otherwise."""
    import ml_dtypes

    per = data.size // leaves
    out = []
    for index in range(leaves):
        dtype = np.dtype(ml_dtypes.bfloat16) if index % 4 == 3 else np.dtype(np.float32)
        count = max(1, per // dtype.itemsize)
        chunk = data[index * per:index * per + count * dtype.itemsize]
        out.append(chunk.view(dtype))
    return out


def _jax_state(arrays: list[np.ndarray]) -> dict[str, Any]:
    """A two-level param-like tree of jax.Arrays (``{"layer_00017": {"w": ...}}``), each
    the output of a computation, as a training step's state is: XLA's own buffers, not
    arrays made by ``jnp.asarray`` from numpy, whose memory writes differently
    (benchmarks/results/leaves-many_cpu2core_2026-11-25.md)."""
    import jax
    import jax.numpy as jnp

    state = {f"layer_{index:05d}": {"w": jnp.asarray(array) + 0}
             for index, array in enumerate(arrays)}
    return jax.block_until_ready(state)


def _abstract(state: Any) -> Any:
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def _tree_bytes(state: Any) -> int:
    import jax

    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(state))


def _llama_config(nbytes: int) -> dict[str, Any]:
    """A Llama config (transformers' keys) whose float32 params total about ``nbytes``."""
    # Per layer about 12 hidden^2 params (attention 4, gated MLP 3 x 8/3), plus 16 hidden^2
    # for embedding and LM head with vocab = 8 hidden: four layers make 64 hidden^2.
    layers = 4
    hidden = 64 * max(1, round(math.sqrt(nbytes / 4 / 64) / 64))
    vocab = 8 * hidden
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "hidden_size": hidden, "intermediate_size": max(64, hidden * 8 // 3 // 64 * 64),
            "num_hidden_layers": layers, "num_attention_heads": max(1, hidden // 64),
            "num_key_value_heads": max(1, hidden // 64), "vocab_size": vocab,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "rope_theta": 10000.0}


def _llama_params(nbytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Llama config whose float32 params total about ``nbytes``, and random params in
    jaxckpt.llm's layout (numpy leaves: the export's cost, not a device transfer's)."""
    import jax
    from flax import nnx

    from jaxckpt.llm import from_config, params_of

    config = _llama_config(nbytes)
    abstract = nnx.eval_shape(lambda: from_config(config, rngs=nnx.Rngs(0)))
    shapes = params_of(abstract)
    rng = np.random.default_rng(1)
    params = jax.tree.map(
        lambda leaf: rng.standard_normal(leaf.shape, dtype=np.float32) * 0.02, shapes)
    return config, params
