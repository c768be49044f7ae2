"""Small Flax NNX reference models used by the demo, the notebooks and the parity tests.

Owns: the catalogue of model definitions (no training loops, no checkpointing logic):
``MLP``, a tiny multilayer perceptron whose dropout draws from an ``nnx.Rngs`` stream, so
the model's state holds a typed JAX PRNG key and a counter (a resume is only exact when
those are checkpointed too); and, re-exported from ``jaxckpt.llm``, the Hugging Face
reference architectures ``Llama`` (also Qwen2) and ``GPT2`` with ``from_config``.

Importing this module imports jax and flax; ``import jaxckpt`` does not import it.
"""

from __future__ import annotations

from collections.abc import Sequence

from .core.extras import requires_extra
from .llm import GPT2, Llama, from_config, load_params, params_of

with requires_extra("jax", "jaxckpt.models (the Flax reference models)"):
    import jax
    from flax import nnx

__all__ = ["MLP", "Llama", "GPT2", "from_config", "params_of", "load_params"]


class MLP(nnx.Module):
    """``len(sizes) - 1`` Linear layers with GELU and dropout between them.

    ``sizes`` lists the widths from input to output, e.g. ``(8, 32, 32, 1)``. Dropout keeps
    its own PRNG stream (split from ``rngs``), advanced on every training-mode call; call
    ``model.eval()`` / ``model.train()`` to switch it off and on.

    Concurrency contract: an NNX module is mutable Python state; use one from one thread.
    """

    def __init__(self, sizes: Sequence[int], *, rngs: nnx.Rngs, dropout_rate: float = 0.1):
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) < 2 or any(s <= 0 for s in sizes):
            raise ValueError(
                f"MLP sizes must list at least an input and an output width, all positive, "
                f"got {sizes!r}. Write e.g. MLP((8, 32, 1), rngs=nnx.Rngs(0)).")
        if not 0.0 <= dropout_rate < 1.0:
            raise ValueError(f"MLP dropout_rate must be in [0, 1), got {dropout_rate!r}.")
        self.sizes = sizes
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs)
                                for a, b in zip(sizes[:-1], sizes[1:], strict=True)])
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        *hidden, last = self.layers
        for layer in hidden:
            x = self.dropout(jax.nn.gelu(layer(x)))
        return last(x)
