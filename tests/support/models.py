"""The tiny models tests build: one Flax NNX module and the tiny Hugging Face configs.

Small enough to build in milliseconds, yet each carries what a checkpoint must get right: the
NNX module has parameters, batch statistics and an RNG stream; the HF configs cover the
architectures the bridge exports (Llama with and without biases, Qwen2 with tied embeddings,
GPT-2 tied and untied) and two it must refuse (Mistral, Gemma). Importing this module needs
flax; ``tiny_hf_config`` imports transformers only when called. Imports nothing from the
library.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

#: Vocabulary of every tiny HF config (token ids drawn in tests stay below it).
HF_VOCAB = 128

#: Architectures the bridge exports, as ``tiny_hf_config`` kinds.
HF_EXPORTED = ("llama", "llama_bias", "qwen2", "gpt2", "gpt2_untied")


class TinyNet(nnx.Module):
    """Linear(3 -> 4), BatchNorm(4), Dropout(0.5): params, batch stats and a dropout stream."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.norm(self.linear(x)))


def tiny_hf_config(kind: str) -> Any:
    """A fresh transformers config of ``kind``: one of HF_EXPORTED, "mistral" or "gemma"
    (two layers, hidden size 32, bos/eos ids inside the vocabulary)."""
    import transformers

    llama_like = dict(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    gpt2 = dict(vocab_size=HF_VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                bos_token_id=1, eos_token_id=2)
    builders = {
        "llama": lambda: transformers.LlamaConfig(**llama_like),
        # Llama with every optional bias switched on.
        "llama_bias": lambda: transformers.LlamaConfig(
            **{**llama_like, "num_key_value_heads": 4}, attention_bias=True, mlp_bias=True),
        # Qwen2: q/k/v biases, tied embeddings.
        "qwen2": lambda: transformers.Qwen2Config(**llama_like, tie_word_embeddings=True),
        "gpt2": lambda: transformers.GPT2Config(**gpt2),
        # GPT-2 with its own LM head.
        "gpt2_untied": lambda: transformers.GPT2Config(**gpt2, tie_word_embeddings=False),
        # Same tensor names as Llama, another model type: the bridge must refuse them.
        "mistral": lambda: transformers.MistralConfig(**llama_like),
        "gemma": lambda: transformers.GemmaConfig(head_dim=8, **llama_like),
    }
    return builders[kind]()
